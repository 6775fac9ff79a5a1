"""flush's window plan on the CPU (ffi/include/dsv4/flush_windows.h): the
CPU handler folds each regular request entry by entry and walks the others
serially; the testing module's dsv4_flush_*_serial walk every row. The two
give the same bytes (pools poisoned, carried accumulators random, every
leaf of the state compared) on prefill chunks that start mid-window, on
several requests of uneven chunks, beside irregular requests, bad slots
and padding, with NaN/Inf rows. Chunking invariance of long streams:
tests/properties/test_flush_prefill_chunking.py; the CUDA kernels: test_flush_windows_gpu.py."""
import numpy as np
import pytest

from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind as EK
from support.flush_plan import SERIAL, call_flush, params, prefill_state, projections, rows
from support.marks import cpu_target_built
from support.trees import assert_trees_bytes_equal

pytestmark = cpu_target_built("dsv4_flush_csa_serial")

def _runs(kind):
    """Regular requests of uneven chunks: CSA chunks start and end anywhere
    in a window; HCA ones too, crossing several windows."""
    if kind == C.CSA:
        return [(2, 0, 77), (0, 130, 150), (3, 509, 3), (1, 255, 129)]
    return [(0, 100, 400), (2, 0, 128), (1, 383, 1), (3, 700, 200)]


def _compare(kind, fmt, slots, pos, *, nan_rows=(), missing=(), seed=0):
    st = prefill_state(fmt, missing=missing, seed=seed, empty_slots=(2,))
    proj = projections(kind, len(slots), seed=seed + 5, nan_rows=nan_rows)
    prm = params(kind, seed=seed + 9)
    plan = call_flush(st, kind, slots, pos, proj, prm)
    serial = call_flush(st, kind, slots, pos, proj, prm, target=SERIAL[kind])
    assert_trees_bytes_equal(plan, serial, f"{kind} plan vs serial ")
    return plan


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
@pytest.mark.parametrize("fmt", ["ds_fp8", "bf16"])
def test_one_request_starting_mid_window(kind, fmt):
    p0, n = (130, 300) if kind == C.CSA else (100, 400)
    slots, pos = rows((1, p0, n))
    out = _compare(kind, fmt, slots, pos)
    assert not np.asarray(out.errors).any()


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_several_requests_uneven_chunks(kind):
    slots, pos = rows(*_runs(kind), pad=3)
    _compare(kind, "fp8_token", slots, pos, seed=1)


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_irregular_requests_and_bad_slots_beside_regular(kind):
    """Slot 0 in two runs, slot 3 with a gap of positions and one out of
    range, a bad slot and padding, beside regular slots 1 and 2: the
    irregular ones take the serial walk inside the handler too."""
    reg_s, reg_p = rows(*[r for r in _runs(kind) if r[0] in (1, 2)], pad=1)
    s0, p0 = rows((0, 40, 30))
    s0b, p0b = rows((0, 70, 21))
    s3, p3 = rows((3, 10, 20), (3, 40, 5), (3, 2000, 1))
    bad = np.array([7, -1], np.int32), np.array([5, 0], np.int32)
    slots = np.concatenate([s0, reg_s, s3, bad[0], s0b])
    pos = np.concatenate([p0, reg_p, p3, bad[1], p0b])
    out = _compare(kind, "ds_fp8", slots, pos, seed=2)
    assert np.asarray(out.errors)[EK.BAD_SLOT] == 1


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_nan_rows_inside_regular_requests(kind):
    """NaN/Inf rows that close no window: dropped, counted, the rest folded."""
    slots, pos = rows(*_runs(kind))
    m = C.CSA_RATIO if kind == C.CSA else C.HCA_RATIO
    inside = [t for t in range(len(slots)) if pos[t] % m != m - 1]
    pick = np.random.default_rng(3).choice(inside, 9, replace=False)
    out = _compare(kind, "bf16", slots, pos, nan_rows=sorted(pick.tolist()), seed=3)
    assert np.asarray(out.errors)[EK.NONFINITE] == 9


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_dropped_closing_rows_close_their_windows(kind):
    """NaN/Inf rows at windows' last positions: their windows close anyway,
    from the other rows (docs/design/semantics.md), in the plan as in the walk."""
    slots, pos = rows(*_runs(kind))
    m = C.CSA_RATIO if kind == C.CSA else C.HCA_RATIO
    closing = [t for t in range(len(slots)) if pos[t] % m == m - 1][::3]
    out = _compare(kind, "ds_fp8", slots, pos, nan_rows=closing, seed=4)
    assert np.asarray(out.errors)[EK.NONFINITE] == len(closing)


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_missing_block_inside_regular_request(kind):
    """Block index 2 of slot 0 is missing: its rows are MISSING_BLOCK, its
    entries closed but not stored, the windows after it unaffected (CSA: the
    entry after the block starts from nothing but its own b halves)."""
    slots, pos = rows((0, 130, 500), (1, 0, 60))
    out = _compare(kind, "ds_fp8", slots, pos, missing=[(0, 2)], seed=5)
    assert np.asarray(out.errors)[EK.MISSING_BLOCK] == 128
