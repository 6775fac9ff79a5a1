"""flush's rule for dropped and out-of-order tokens (docs/design/semantics.md, "Order
of a request's tokens"), on every implementation, against the serial numpy
model of support/flush_rule.py: each call's counts, accumulators, closed
entries and untouched bytes. Cases: a dropped closing token in the middle of
a call, as its last and as its first row; a window holding only carried data
closed by a dropped token; rows off their expected position (a jump, a
repeat, a step back) in interleaved requests; a request starting before
position 0 or running past max_context; regular requests of hundreds of rows
with dropped closing rows and a missing block (the window plan's middle
entries); and chunkings of one stream with dropped tokens agreeing byte for
byte.

Every call is padded to T = 640 rows, so the CUDA flush runs its window-plan
kernel (cuda/flush/flush_windows.cuh, 256 rows or more): regular requests (one
contiguous run of consecutive positions) by the plan, the others by its
serial walk; the CPU handler splits requests the same way at any size. The
CUDA serial kernel of smaller calls is held to the CPU handler in
test_cuda_matches_cpu_under_the_rule."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as K
from dsv4_jax.app.workload import Flips, compare_states, layer_params

from support.flush_rule import check_flush
from support.harness import (FlipStats, assert_accumulators_close, compare_index, compare_kv,
                             raw)
from support.marks import CUDA, every_impl
from support.trees import assert_trees_bytes_equal, poison


CFG = D.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16)
MAXCTX = CFG.max_context
T = 640                                   # rows of every call (padded): one compile per kind
# slot 1 has no block for positions 128..255
TABLE = np.array([[3, 7, 1, 12], [5, -1, 9, 2], [4, 6, 8, 10], [11, 13, 14, 15]], np.int32)
PARAMS = layer_params(CFG, seed=3)
KINDS = {"csa": (1, 0, 4), "hca": (2, 0, 128)}     # layer, index among its kind, m
WIDTHS = {"csa": (1024, 1024, 256, 256), "hca": (512, 512)}


def start_state(seed=0, carried=True):
    """Random pool bytes; random accumulators (finite max, positive sums) in
    every slot, or empty ones."""
    rng = np.random.default_rng(seed)
    st = D.init_state(CFG)
    st = dataclasses.replace(st, block_table=jnp.asarray(TABLE),
                             csa=dataclasses.replace(st.csa, kv=poison(st.csa.kv, seed),
                                                     index=poison(st.csa.index, seed + 1)),
                             hca=dataclasses.replace(st.hca, kv=poison(st.hca.kv, seed + 2)))

    def acc(x):
        if not carried:
            return x
        shape = x.shape[:-2] + x.shape[-1:]
        mx = rng.normal(0, 1, shape)
        s = rng.uniform(0.5, 3.0, shape)
        kv = rng.normal(0, 1, shape) * s
        return jnp.asarray(np.stack([mx, s, kv], axis=-2), jnp.float32)
    return dataclasses.replace(
        st, csa=dataclasses.replace(st.csa, comp=acc(st.csa.comp), icomp=acc(st.csa.icomp)),
        hca=dataclasses.replace(st.hca, comp=acc(st.hca.comp)))


def stream_inputs(kind, seed=1):
    """Inputs per (slot, position): [R, MAXCTX, width] for each operand."""
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1.5, (CFG.max_requests, MAXCTX, w)).astype(np.float32)
            for w in WIDTHS[kind]]


def call_rows(rows, kind, data, padded_to=T):
    """rows: (slot, pos, dropped) -> slot, pos and inputs of one call padded
    to `padded_to` rows; a dropped row gets NaN, +Inf or -Inf in one channel
    of one operand."""
    n = len(rows)
    assert n <= padded_to
    slot = np.full(padded_to, -1, np.int32)
    pos = np.full(padded_to, 7, np.int32)
    arrays = [np.zeros((padded_to, a.shape[-1]), np.float32) for a in data]
    rng = np.random.default_rng(n)
    for i, (s, p, bad) in enumerate(rows):
        slot[i], pos[i] = s, p
        for a, src in zip(arrays, data):
            a[i] = src[s % CFG.max_requests, int(np.clip(p, 0, MAXCTX - 1))]
        if bad:
            a = arrays[(s + p) % len(arrays)]
            a[i, (7 * p) % a.shape[1]] = [np.nan, np.inf, -np.inf][p % 3]
    for a in arrays:             # padding rows carry garbage, NaN included
        a[n:] = rng.normal(0, 1, a[n:].shape)
        a[n:, 0] = np.nan
    return slot, pos, arrays


def _flush(kind):
    layer = KINDS[kind][0]
    p = PARAMS[layer]
    if kind == "csa":
        return jax.jit(lambda st, m, x, z, ix, iz: D.flush(st, layer, m, x, z, p, index_kv=ix,
                                                              index_score=iz))
    return jax.jit(lambda st, m, x, z: D.flush(st, layer, m, x, z, p))


def run_checked(st, kind, rows, data, stats):
    """One call, checked against the model; returns (state, model outcome)."""
    slot, pos, arrays = call_rows(rows, kind, data)
    meta = D.StepMeta.build(token_slot=slot, token_pos=pos,
                            lengths=np.zeros(CFG.max_requests, np.int32))
    new = _flush(kind)(st, meta, *map(jnp.asarray, arrays))
    out = check_flush(st, new, KINDS[kind][1], kind == "csa", slot, pos, arrays,
                      PARAMS[KINDS[kind][0]], stats)
    return new, out


def closed_windows(out, s):
    return [w for slot, w, _, _ in out.closed if slot == s]


@every_impl
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_dropped_closing_token_in_the_middle_of_a_call(kind):
    _, _, m = KINDS[kind]
    data = stream_inputs(kind)
    n = 2 * m + 3
    bad = {m - 1, 2 * m - 2}
    rows = [(0, p, p in bad) for p in range(n)]
    other = [(2, p, p == m - 1) for p in range(m + 1)]       # interleaved, closing NaN too
    rows = [r for pair in zip(rows, other) for r in pair] + rows[len(other):]
    st, out = run_checked(start_state(carried=False), kind, rows, data, FlipStats())
    assert out.counts == {K.NONFINITE: 3}
    assert closed_windows(out, 0) == [0, 1] and closed_windows(out, 2) == [0]


@every_impl
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_dropped_closing_token_as_last_then_first_row(kind):
    """Call 1 ends on a dropped closing token, call 2 starts on a dropped
    token and ends on a good closing one, call 3 goes on."""
    _, _, m = KINDS[kind]
    data = stream_inputs(kind)
    stats = FlipStats()
    st = start_state(carried=False)
    st, out = run_checked(st, kind, [(0, p, p == m - 1) for p in range(m)], data, stats)
    assert closed_windows(out, 0) == [0] and out.counts == {K.NONFINITE: 1}
    st, out = run_checked(st, kind, [(0, p, p == m) for p in range(m, 2 * m)], data, stats)
    assert closed_windows(out, 0) == [1] and out.counts == {K.NONFINITE: 1}
    st, out = run_checked(st, kind, [(0, p, False) for p in range(2 * m, 2 * m + 3)], data,
                          stats)
    assert closed_windows(out, 0) == [] and out.counts == {}


@every_impl
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_window_of_carried_data_closed_by_a_dropped_token(kind):
    """A lone dropped row at a window's last position closes that window
    from its carried accumulator alone (and, for CSA, moves next up)."""
    _, _, m = KINDS[kind]
    data = stream_inputs(kind)
    rows = [(0, m - 1, True), (2, 3 * m - 1, True), (3, 2 * m - 2, True)]
    st, out = run_checked(start_state(carried=True), kind, rows, data, FlipStats())
    assert out.counts == {K.NONFINITE: 3}
    assert closed_windows(out, 0) == [0] and closed_windows(out, 2) == [2]
    assert closed_windows(out, 3) == []
    # the carried data made the entry: not the empty accumulator's zero
    assert all(np.abs(v[0]).max() > 0 for _, _, _, v in out.closed)


@every_impl
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_rows_off_their_expected_position(kind):
    """A jump, a repeat and a step back, each BAD_POSITION, in interleaved
    requests; the rows after them at their expected positions are good."""
    _, _, m = KINDS[kind]
    data = stream_inputs(kind)
    seqs = {0: [0, 1, 2, 3, 9, 5, 6, 7, 8],                  # jump
            2: [m - 2, m - 1, m - 1, m + 1, m + 2],           # repeat of a closing position
            3: [2 * m + 1, 2 * m + 2, 2 * m, 2 * m + 4]}      # step back
    queues = {s: [(s, p, False) for p in ps] for s, ps in seqs.items()}
    order = np.random.default_rng(5).permutation(sum(len(q) for q in queues.values()))
    tags = np.concatenate([[s] * len(q) for s, q in queues.items()])[order]
    rows = [queues[s].pop(0) for s in tags]
    st, out = run_checked(start_state(carried=True), kind, rows, data, FlipStats())
    assert out.counts == {K.BAD_POSITION: 3}
    if kind == "csa":   # slot 3's expected positions 9..12 close window 2
        assert closed_windows(out, 0) == [0, 1] and closed_windows(out, 2) == [0]
        assert closed_windows(out, 3) == [2]
    else:
        assert closed_windows(out, 0) == [] and closed_windows(out, 2) == [0]
        assert closed_windows(out, 3) == []


@every_impl
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_positions_before_zero_and_past_max_context(kind):
    _, _, m = KINDS[kind]
    data = stream_inputs(kind)
    rows = ([(0, p, False) for p in range(-3, m + 2)]            # starts before 0
            + [(3, p, False) for p in range(MAXCTX - m - 2, MAXCTX + 2)]   # runs past the end
            + [(2, MAXCTX + p, False) for p in range(3)]         # all past the end
            + [(2, 5, False)]                                    # off its expected position
            + [(1, -(2 ** 31) + p, False) for p in range(2)])    # far before 0
    st, out = run_checked(start_state(carried=True), kind, rows, data, FlipStats())
    assert out.counts == {K.BAD_POSITION: 3 + 2 + 4 + 2}
    assert closed_windows(out, 0) == [0]
    assert closed_windows(out, 3) == list(range((MAXCTX - m - 2) // m, MAXCTX // m))
    assert set(out.after) == {0, 3}


@every_impl
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_regular_requests_with_dropped_rows(kind):
    """Two regular requests (each one run of consecutive positions): slot 1
    at 5..504 across its missing block (positions 128..255), starting and
    ending on dropped rows, with dropped closing rows; slot 0 at 0..99. Their
    windows are the window plan's (edge entries on the carried accumulators,
    middle entries from the rows alone), dropped closing rows or not."""
    _, _, m = KINDS[kind]
    data = stream_inputs(kind)
    closing = {"csa": {7, 11, 303, 407}, "hca": {127, 383}}[kind]
    bad1 = {5, 9, 300, 450, 504} | closing
    bad0 = {3, 50}
    rows = ([(1, p, p in bad1) for p in range(5, 505)]
            + [(0, p, p in bad0) for p in range(100)])
    st, out = run_checked(start_state(carried=True), kind, rows, data, FlipStats())
    assert out.counts == {K.MISSING_BLOCK: 128, K.NONFINITE: len(bad1) + len(bad0)}
    # windows whose last position is in [f, L]: slot 1 [5, 504], slot 0 [0, 99]
    assert closed_windows(out, 1) == (list(range(1, 126)) if kind == "csa" else [0, 1, 2])
    assert closed_windows(out, 0) == (list(range(25)) if kind == "csa" else [])
    # the missing block's windows close but are not stored
    unstored = [w for s, w, b, _ in out.closed if b is None]
    assert unstored == list(range(128 // m, 256 // m))


def assert_states_agree_to_rounding(a, b, what):
    """The jnp reference pools each call's contributions by a two-pass
    softmax, so its chunkings agree up to fp32 rounding: accumulators close,
    pool codes at most one apart (scales exact), everything else exact."""
    for field in ("comp", "icomp"):
        x, y = np.asarray(getattr(a.csa, field)), np.asarray(getattr(b.csa, field))
        for idx in np.ndindex(x.shape[:2]):
            assert_accumulators_close(x[idx], y[idx].astype(np.float64), f"{what} csa.{field}")
    x, y = np.asarray(a.hca.comp), np.asarray(b.hca.comp)
    for idx in np.ndindex(x.shape[:2]):
        assert_accumulators_close(x[idx], y[idx].astype(np.float64), f"{what} hca.comp")
    stats = FlipStats()
    for pa, pb in ((a.csa.kv, b.csa.kv), (a.hca.kv, b.hca.kv)):
        compare_kv(stats, CFG.kv_format, {k: raw(v) for k, v in pa.__dict__.items()},
                   {k: raw(v) for k, v in pb.__dict__.items()}, what)
    compare_index(stats, {k: raw(v) for k, v in a.csa.index.__dict__.items()},
                  {k: raw(v) for k, v in b.csa.index.__dict__.items()}, what)
    assert_trees_bytes_equal((a.swa, a.block_table, a.errors), (b.swa, b.block_table, b.errors),
                             what)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_chunkings_agree_with_dropped_tokens(kind, impl_under_test):
    """One stream per request with dropped tokens (NaN, a missing block for
    slot 1) flushed whole and in chunks cut at and next to dropped rows: the
    same state bytes (the handlers; the reference up to fp32 rounding), each
    call as the model says."""
    _, _, m = KINDS[kind]
    data = stream_inputs(kind)
    n = {"csa": 37, "hca": 300}[kind]
    rng = np.random.default_rng(11)
    bad = {s: set(rng.choice(n, n // 6, replace=False).tolist()) | {m - 1, 2 * m - 1}
           for s in (0, 1)}
    streams = {s: [(s, p, p in bad[s]) for p in range(n)] for s in (0, 1)}
    cuts = {"whole": [n], "at drops": sorted({m - 1, m, 2 * m - 1, 2 * m, n}),
            "random": sorted(set(rng.integers(1, n, 5).tolist()) | {n})}
    states = {}
    for name, ends in cuts.items():
        st, stats, start = start_state(carried=False), FlipStats(), 0
        for end in ends:
            rows = [r for pair in zip(streams[0][start:end], streams[1][start:end]) for r in pair]
            st, _ = run_checked(st, kind, rows, data, stats)
            start = end
        states[name] = st
    for name in ("at drops", "random"):
        if impl_under_test == "reference":
            assert_states_agree_to_rounding(states[name], states["whole"], name)
        else:
            assert_trees_bytes_equal(states[name], states["whole"], name)


# ---- CUDA against the CPU handler, byte for byte ------------------------------------------
def _rule_calls(kind):
    """Calls that exercise every part of the rule at once: interleaved
    requests with dropped closing tokens, a request off its expected
    positions, one starting before 0, one running past max_context."""
    _, _, m = KINDS[kind]
    rng = np.random.default_rng(17)
    calls = []
    for c in range(3):
        base = c * (m + 3)
        queues = [[(0, base + p, (base + p) % m == m - 1 and p % 2 == 0) for p in range(m + 3)],
                  [(1, base + p + (2 if p == 3 else 0), False) for p in range(m + 3)],
                  [(2, base - 2 + p, p == 0) for p in range(m + 3)],
                  [(3, MAXCTX - 2 * m + base + p, p == m - 1) for p in range(m + 3)]]
        tags = rng.permutation(np.repeat(np.arange(4), m + 3))
        calls.append([queues[s].pop(0) for s in tags])
    return calls


SERIAL_KERNEL_ROWS = 255     # calls below 256 rows run the CUDA serial kernel (kPlanMinRows)


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=CUDA)])
@pytest.mark.parametrize("entry", ["flush", "write_layer"])
@pytest.mark.parametrize("kernel", ["plan", "serial"])
def test_cuda_matches_cpu_under_the_rule(kind, mark, entry, kernel):
    """The CUDA flush (flush's kernel and write_layer's flush role) and the
    CPU handler leave the same state, call after call: in calls of T rows
    (the window-plan kernel, its serial walk for these interleaved
    requests) and in the same rows cut into calls of at most 255 rows (the
    serial kernel; the cuts change what the calls mean, the same for both)."""
    layer = KINDS[kind][0]
    data = stream_inputs(kind)
    size = T if kernel == "plan" else SERIAL_KERNEL_ROWS
    calls = [rows[a:a + size] for rows in _rule_calls(kind) for a in range(0, len(rows), size)]
    outs = {}
    for impl in ("cuda", "cpu"):
        dev = jax.devices(impl)[0]
        p = jax.device_put(PARAMS[layer], dev)
        st = jax.device_put(start_state(carried=True), dev)
        for rows in calls:
            slot, pos, arrays = call_rows(rows, kind, data, padded_to=size)
            meta = jax.device_put(D.StepMeta.build(
                token_slot=slot, token_pos=pos, lengths=np.zeros(CFG.max_requests, np.int32)), dev)
            x = [jax.device_put(jnp.asarray(a), dev) for a in arrays]
            extra = dict(index_kv=x[2], index_score=x[3]) if kind == "csa" else {}
            if entry == "flush":
                st = D.flush(st, layer, meta, x[0], x[1], p, impl=impl, **extra)
            else:
                win = jax.device_put(jnp.zeros((size, 512), jnp.bfloat16), dev)
                st = D.write_layer(st, layer, meta, win, x[0], x[1], p, impl=impl, **extra)
        outs[impl] = jax.device_get(st)
    # libm's and CUDA's expf/sinf/cosf may differ in the last bit: accumulators
    # agree to 1e-6, entries to one code (workload.compare_states, as every
    # CUDA-vs-CPU test); the counts exactly. Plan and serial kernel are
    # compared byte for byte on the GPU alone (test_flush_windows_gpu.py).
    flips = Flips()
    compare_states(outs["cuda"], outs["cpu"], flips, f"{kind} {entry} {kernel}: ")
    np.testing.assert_array_equal(outs["cuda"].errors, outs["cpu"].errors)
    assert flips.fraction < 1e-3, flips
