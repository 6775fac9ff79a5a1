"""What each compiled module holds: the ops modules only the ops; the
test-only targets (the numerics probes, dsv4_noop, on the CPU flush on the
serial walk alone) only in the testing modules, which a default build does
not make (CMake option DSV4_BUILD_TESTING)."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import _ffi

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The one list of targets both modules register, in their order:
# DSV4_OP(op, target, CpuHandler, CudaHandler, OPERANDS) a line.
OPS_DEF = ROOT / "ffi" / "include" / "dsv4" / "ops.def"
OP_LINE = re.compile(r"^DSV4_OP\((\w+), (\w+), (\w+), (\w+), (\w+)\)$", re.M)


def _ops_def():
    return OP_LINE.findall(OPS_DEF.read_text())


def test_ops_list_is_well_formed_and_names_every_cuda_op_folder():
    """Every line of ops.def parses (CMake and this file read it by the same
    pattern), targets are unique, and the op folders it names are exactly
    cuda/'s folders but the shared code's and the test-only one's: a kernel
    folder no line names would never be built."""
    text = OPS_DEF.read_text()
    lines = [l for l in text.splitlines() if l.startswith("DSV4_OP")]
    rows = _ops_def()
    assert len(rows) == len(lines) >= 13
    targets = [t for _, t, _, _, _ in rows]
    assert len(set(targets)) == len(targets)
    assert all(t.startswith("dsv4_") for t in targets)
    folders = {p.name for p in (ROOT / "cuda").iterdir() if p.is_dir()}
    assert {op for op, _, _, _, _ in rows} == folders - {"common", "testing"}
    for op, _, _, _, _ in rows:
        assert list((ROOT / "cuda" / op).glob("*.cu")), op
        assert list((ROOT / "ffi" / "cpu").glob(f"{op}*_cpu.cc")), op


@pytest.mark.parametrize("name", ["_dsv4_cpu", "_dsv4_cuda"])
def test_ops_module_holds_only_the_ops_in_one_order(name):
    module = pytest.importorskip(f"dsv4_jax.{name}")
    assert list(module.registrations()) == [t for _, t, _, _, _ in _ops_def()]
    assert not hasattr(module, "numerics")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_testing_module_holds_the_noop_and_the_probes(platform):
    testing = _ffi.testing_module(platform)
    if testing is None:
        pytest.skip(f"no {platform} testing module loaded ({_ffi.TESTING_BUILD})")
    # the CPU's also flush on the serial walk alone (the window plan's oracle)
    serial = {"dsv4_flush_csa_serial", "dsv4_flush_hca_serial"} if platform == "cpu" else set()
    assert set(testing.registrations()) == {"dsv4_noop"} | serial
    assert _ffi.has_target(platform, "dsv4_noop")
    assert hasattr(testing.numerics, "bf16_bits")


def test_noop_returns_its_operand_on_the_cpu():
    if not _ffi.has_target("cpu", "dsv4_noop") or jax.default_backend() != "cpu":
        pytest.skip(f"no CPU testing module, or the default backend is not the CPU "
                    f"({_ffi.TESTING_BUILD})")
    noop = jax.ffi.ffi_call("dsv4_noop", jax.ShapeDtypeStruct((5,), jnp.int32),
                            input_output_aliases={0: 0})
    x = np.arange(5, dtype=np.int32) * 7
    np.testing.assert_array_equal(jax.jit(noop)(jnp.asarray(x)), x)


def test_layout_constants_agree_between_python_and_cpp():
    """dsv4_jax/config.py and errors.py hold the numbers ffi/include/dsv4/
    layout.h compiles into the handlers and kernels (docs/design/overview.md): one value
    changed on one side only fails here."""
    from dsv4_jax import config as C
    from dsv4_jax import errors as E
    module = pytest.importorskip("dsv4_jax._dsv4_cpu")
    cpp = module.layout()
    assert len(cpp) >= 14
    for name, value in cpp.items():
        expected = getattr(E if name in ("NUM_ERROR_KINDS", "DETAIL_FIELDS", "NO_ROW") else C,
                           name)
        assert value == expected, f"{name}: C++ {value}, Python {expected}"
