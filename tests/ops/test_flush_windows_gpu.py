"""flush's window-plan kernel (cuda/flush/flush_windows.cuh) on the GPU, and its
fallbacks. Two oracles:

* the CUDA serial kernel: the same rows cut into calls of fewer than
  kPlanMinRows (256) rows run the serial walk (cuda/flush/flush_block.cuh), and
  the serial walk and the plan fold in the same order, so the states are
  byte-identical (same device, same expf);
* the CPU handler (which runs the same plan): equal up to the one-code
  flips of sin/cos/expf between libm and CUDA (workload.compare_states).

Cases: one request x 4096 rows starting mid-window (carried accumulators),
several requests of uneven chunks, CSA and HCA, ds_fp8 and bf16 pools; NaN
rows and a missing block inside regular requests; an irregular request in
the call beside regular ones; many short requests (a verify step's) beside
long ones; a decode-sized call (the serial kernel);
write_layer's prefill launch."""
import jax
import numpy as np
import pytest

from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind as EK
from dsv4_jax.app.workload import Flips, compare_states
from support.flush_plan import call_flush, call_write_layer, params, prefill_state, projections, rows
from support.marks import CUDA
from support.trees import assert_trees_bytes_equal

pytestmark = CUDA
MAX_FLIP_FRACTION = 1e-3
PLAN_MIN_ROWS = 256          # flush_kernel::kPlanMinRows
MAX_CONTEXT = 8192


def _gpu():
    return jax.devices("cuda")[0]


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _runs(kind):
    if kind == C.CSA:
        return [(2, 0, 777), (0, 130, 1501), (3, 509, 3), (1, 255, 1290)]
    return [(0, 100, 2000), (2, 0, 128), (1, 383, 1), (3, 700, 1333)]


def _chunked(state, kind, slots, pos, proj, prm, size=PLAN_MIN_ROWS - 1, whole_tail=0):
    """The same rows in calls of `size` rows (the serial kernel below 256);
    the last `whole_tail` rows (< 256) in a call of their own, so that a
    request off its positions there sees the expected positions of the
    whole call."""
    head = len(slots) - whole_tail
    cuts = list(range(0, head, size)) + [head] + ([len(slots)] if whole_tail else [])
    for a, b in zip(cuts, cuts[1:]):
        part = tuple(None if x is None else x[a:b] for x in proj)
        state = call_flush(state, kind, slots[a:b], pos[a:b], part, prm, device=_gpu())
    return state


def _check(kind, fmt, slots, pos, *, nan_rows=(), missing=(), seed=0, serial_oracle=True,
           whole_tail=0, R=4):
    st = prefill_state(fmt, R=R, max_context=MAX_CONTEXT, missing=missing, seed=seed,
                       empty_slots=(2,))
    proj = projections(kind, len(slots), seed=seed + 5, nan_rows=nan_rows)
    prm = params(kind, seed=seed + 9)
    cuda = _host(call_flush(st, kind, slots, pos, proj, prm, device=_gpu()))
    cpu = _host(call_flush(st, kind, slots, pos, proj, prm))
    flips = Flips()
    compare_states(cuda, cpu, flips, f"{kind} cuda vs cpu ")
    np.testing.assert_array_equal(cuda.errors, cpu.errors)
    assert flips.fraction < MAX_FLIP_FRACTION, flips
    if serial_oracle:
        serial = _host(_chunked(st, kind, slots, pos, proj, prm, whole_tail=whole_tail))
        assert_trees_bytes_equal(cuda, serial, f"{kind} plan vs serial kernel ")
    return cuda


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
@pytest.mark.parametrize("fmt", ["ds_fp8", "bf16"])
def test_one_request_4096_rows_mid_window(kind, fmt):
    p0 = 130 if kind == C.CSA else 100
    slots, pos = rows((1, p0, 4096))
    out = _check(kind, fmt, slots, pos)
    assert not out.errors.any()


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
@pytest.mark.parametrize("fmt", ["ds_fp8", "bf16"])
def test_several_requests_uneven_chunks(kind, fmt):
    slots, pos = rows(*_runs(kind), pad=3)
    _check(kind, fmt, slots, pos, seed=1)


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_nan_rows_inside_regular_requests(kind):
    """NaN/Inf rows that close no window, then rows at windows' last
    positions (their windows close anyway, docs/design/semantics.md): the plan
    kernel, the CUDA serial kernel and the CPU handler agree."""
    slots, pos = rows(*_runs(kind))
    m = C.CSA_RATIO if kind == C.CSA else C.HCA_RATIO
    rng = np.random.default_rng(3)
    inside = [t for t in range(len(slots)) if pos[t] % m != m - 1]
    closing = [t for t in range(len(slots)) if pos[t] % m == m - 1]
    _check(kind, "ds_fp8", slots, pos, nan_rows=sorted(rng.choice(inside, 40, replace=False)),
           seed=3)
    out = _check(kind, "ds_fp8", slots, pos, nan_rows=closing[::5], seed=4)
    assert out.errors[EK.NONFINITE] == len(closing[::5])


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_missing_block_inside_regular_request(kind):
    slots, pos = rows((0, 130, 1000), (1, 0, 600))
    out = _check(kind, "ds_fp8", slots, pos, missing=[(0, 3)], seed=5)
    assert out.errors[EK.MISSING_BLOCK] == 128   # block 3's positions 384..511


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_irregular_request_beside_regular_ones(kind):
    """Slot 0 in two runs (positions continuing), bad slots and padding
    between runs of regular slots: slot 0 takes WalkRequest in the plan
    kernel. Slot 3 with a jump of positions and one past max_context (its
    expected positions depend on where a call starts): its rows are the
    serial kernel's last call, whole."""
    reg_s, reg_p = rows(*[r for r in _runs(kind) if r[0] in (1, 2)], pad=1)
    s0, p0 = rows((0, 40, 300))
    s0b, p0b = rows((0, 340, 21))
    bad = np.array([7, -1, -3], np.int32), np.array([5, 0, 9], np.int32)
    slots = np.concatenate([s0, reg_s, bad[0], s0b])
    pos = np.concatenate([p0, reg_p, bad[1], p0b])
    _check(kind, "ds_fp8", slots, pos, seed=6)
    s3, p3 = rows((3, 10, 20), (3, 40, 5), (3, MAX_CONTEXT + 4, 1))
    out = _check(kind, "bf16", np.concatenate([slots, s3]), np.concatenate([pos, p3]), seed=7,
                 whole_tail=len(s3))
    assert out.errors[EK.BAD_POSITION] == 6   # slot 3's rows after its jump (expected 30..35)


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
@pytest.mark.parametrize("fmt", ["ds_fp8", "bf16"])
def test_short_requests_in_a_plan_sized_call(kind, fmt):
    """A verify or commit step's shape: many requests of a few rows each (the
    plan kernel walks those of at most kSerialRunRows = 16 rows serially, a
    block each) beside requests of 17 and 300 rows (the plan's entries), at
    positions crossing windows, padding between, NaN rows and a missing
    block inside short requests."""
    rng = np.random.default_rng(13)
    lengths = [4] * 40 + [1, 2, 3, 5, 7, 8, 9, 15, 16, 16, 17, 17, 300, 1, 4, 4]
    runs = [(s, int(rng.integers(0, MAX_CONTEXT - n)), n) for s, n in enumerate(lengths)]
    runs[3] = (3, 127, 4)          # crosses an HCA window and a block
    runs[4] = (4, 2 * 128 - 2, 4)  # into a block that is missing
    slots, pos = rows(*runs[:30], pad=1)
    s2, p2 = rows(*runs[30:])
    slots, pos = np.concatenate([slots, s2]), np.concatenate([pos, p2])
    assert len(slots) >= PLAN_MIN_ROWS
    short = [t for t in range(len(slots)) if 0 <= slots[t] < 40]
    nan_rows = sorted(rng.choice(short, 6, replace=False))
    out = _check(kind, fmt, slots, pos, nan_rows=nan_rows, missing=[(4, 2)], seed=14,
                 R=len(lengths))
    assert out.errors[EK.MISSING_BLOCK] == 2   # slot 4's positions 256, 257
    # a caller's bound on a request's rows of at most 16
    # (StepMeta.max_rows_per_slot) picks the serial kernel for this
    # plan-sized call; a false one (requests of 17 and 300 rows break both)
    # costs time, never bytes
    st = prefill_state(fmt, R=len(lengths), max_context=MAX_CONTEXT, missing=[(4, 2)], seed=14,
                       empty_slots=(2,))
    proj = projections(kind, len(slots), seed=19, nan_rows=nan_rows)
    prm = params(kind, seed=23)
    for bound in (1, 16):
        hinted = _host(call_flush(st, kind, slots, pos, proj, prm, device=_gpu(),
                                  max_rows_per_slot=bound))
        assert_trees_bytes_equal(hinted, out, f"{kind} max_rows_per_slot={bound} vs none ")


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_write_layer_of_a_commit_step(kind):
    """write_layer of 64 requests x 1 .. 4 rows (a commit step's kept rows),
    positions crossing windows: with the step's bound (max_rows_per_slot 4:
    append and the serial flush in one launch) the same bytes as without it
    (append, then the plan kernel), and the CPU handler's up to flips."""
    rng = np.random.default_rng(15)
    runs = [(s, int(rng.integers(0, MAX_CONTEXT - 4)), int(rng.integers(1, 5)))
            for s in range(64)]
    slots, pos = rows(*runs, pad=1)
    tail = PLAN_MIN_ROWS + 44 - len(slots)   # padding rows up to a plan-sized call
    slots = np.concatenate([slots, np.full(tail, -1, np.int32)])
    pos = np.concatenate([pos, np.zeros(tail, np.int32)])
    st = prefill_state("ds_fp8", R=64, max_context=MAX_CONTEXT, seed=16, empty_slots=(2,))
    proj = projections(kind, len(slots), seed=17, nan_rows=[5, 77])
    prm = params(kind, seed=18)
    window_kv = jax.numpy.asarray(np.random.default_rng(19).standard_normal((len(slots), 512)),
                                  jax.numpy.bfloat16)
    run = lambda bound, impl, device: _host(call_write_layer(
        st, kind, slots, pos, window_kv, proj, prm, impl=impl, device=device,
        max_rows_per_slot=bound))
    bounded = run(4, "cuda", _gpu())
    assert_trees_bytes_equal(bounded, run(0, "cuda", _gpu()), "write_layer bound 4 vs none ")
    cpu = run(4, "cpu", jax.devices("cpu")[0])
    flips = Flips()
    compare_states(bounded, cpu, flips, f"write_layer {kind} cuda vs cpu ")
    np.testing.assert_array_equal(bounded.errors, cpu.errors)
    assert flips.fraction < MAX_FLIP_FRACTION, flips


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_decode_sized_call_keeps_the_serial_kernel(kind):
    """Fewer than 256 rows, one a request (a decode step) and a short
    prefill: the serial kernel, against the CPU."""
    slots, pos = rows((0, 515, 1), (1, 127, 1), (2, 0, 1), (3, 4095, 1), (1, 128, 100))
    _check(kind, "ds_fp8", slots, pos, seed=8, serial_oracle=False)


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_write_layer_prefill(kind):
    """write_layer of a 2,000-row prefill call (append role, then the plan
    kernel): its flush part equals flush's plan kernel bit for bit, and the
    whole state the CPU handler's up to one-code flips."""
    slots, pos = rows(*_runs(kind)[:2], pad=2)
    st = prefill_state("ds_fp8", max_context=MAX_CONTEXT, seed=9, empty_slots=(2,))
    proj = projections(kind, len(slots), seed=10)
    prm = params(kind, seed=11)
    window_kv = jax.numpy.asarray(np.random.default_rng(12).standard_normal((len(slots), 512)),
                                  jax.numpy.bfloat16)
    cuda = _host(call_write_layer(st, kind, slots, pos, window_kv, proj, prm, impl="cuda",
                                  device=_gpu()))
    cpu = _host(call_write_layer(st, kind, slots, pos, window_kv, proj, prm, impl="cpu",
                                 device=jax.devices("cpu")[0]))
    flips = Flips()
    compare_states(cuda, cpu, flips, f"write_layer {kind} cuda vs cpu ")
    assert flips.fraction < MAX_FLIP_FRACTION, flips
    flush_only = _host(call_flush(st, kind, slots, pos, proj, prm, device=_gpu()))
    part = (lambda s: s.csa) if kind == C.CSA else (lambda s: s.hca)
    assert_trees_bytes_equal(part(cuda), part(flush_only), "write_layer's flush part ")
