"""What each compiled module holds: the ops modules only the ops; the
test-only targets (the numerics probes, dsv4_noop, on the CPU flush on the
serial walk alone) only in the testing modules, which a default build does
not make (CMake option DSV4_BUILD_TESTING)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import _ffi

# in the order both modules register them (ffi/cpu/module_cpu.cc, cuda/module_cuda.cc)
OPS = ["dsv4_apply_step", "dsv4_append", "dsv4_flush_csa", "dsv4_flush_hca",
       "dsv4_write_layer_csa", "dsv4_write_layer_hca", "dsv4_gather_window", "dsv4_gather_topk",
       "dsv4_gather_all", "dsv4_indexer_topk", "dsv4_attention", "dsv4_take_rows",
       "dsv4_put_rows"]


@pytest.mark.parametrize("name", ["_dsv4_cpu", "_dsv4_cuda"])
def test_ops_module_holds_only_the_ops_in_one_order(name):
    module = pytest.importorskip(f"dsv4_jax.{name}")
    assert list(module.registrations()) == OPS
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
