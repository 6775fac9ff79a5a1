"""The decode step's kernels on the GPU: write_layer at decode sizes (the
append role's per-token scan, flush's walk with its rows found by a bitmask
and its one epilogue for the entry and the indexer key; on CSA layers, up
to 65 rows on 132 multiprocessors, the main entries and the indexer keys in
blocks of their own)
against the CPU handler, equal up to the one-code flips of sin/cos/expf
between libm and CUDA (workload.compare_states), error counts equal;
indexer_topk (the score kernel launched overlapped) against the replayed
ranking.

And the overlapped launch's ordering: in one jitted step, indexer_topk must
see the indexer key that the write_layer before it has just stored."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind as EK
from dsv4_jax.app.workload import Flips, compare_states
from support.flush_plan import (call_flush, call_write_layer, params, prefill_state,
                                projections, rows)
from support.indexer import (expected, make_state, queries, run, with_index_keys,
                             with_random_blocks)
from support.marks import CUDA

pytestmark = CUDA
MAX_FLIP_FRACTION = 1e-3
MAX_CONTEXT = 8192


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _interleaved(rng, *runs):
    """token_slot and token_pos of runs (slot, first position, count), their
    rows interleaved at random, each run's in its own order."""
    left = [list(range(p0, p0 + n)) for _, p0, n in runs]
    slots, pos = [], []
    while any(left):
        i = rng.choice([j for j, rest in enumerate(left) if rest])
        slots.append(runs[i][0])
        pos.append(left[i].pop(0))
    return np.array(slots, np.int32), np.array(pos, np.int32)


def _decode_cases():
    """(name, R, slot, pos, nan_rows, missing): decode-sized calls (fewer than
    256 rows, flush's serial kernel)."""
    rng = np.random.default_rng(5)
    cases = []
    # a decode step of 64 requests, most closing a CSA and an HCA window
    # (position 127 mod 128), some mid-window
    pos = (rng.integers(1, MAX_CONTEXT // 128, 64) * 128 - 1).astype(np.int32)
    pos[::7] -= rng.integers(1, 100, len(pos[::7])).astype(np.int32)
    cases.append(("64 one-token requests", 64, np.arange(64, dtype=np.int32), pos, [], []))
    # several requests of a few rows each, interleaved (each in its own
    # order), with a bad slot, padding, a row off its expected position, NaN
    # rows (one at a window's last position: the window closes anyway) and a
    # missing block (slot 1's first: its rows at 126, 127 dropped)
    s, p = _interleaved(rng, (0, 515, 6), (1, 126, 3), (2, 0, 1), (3, 4094, 9))
    s = np.r_[s, 7, -1, 2].astype(np.int32)
    p = np.r_[p, 5, 0, 40].astype(np.int32)
    nan = [int(np.flatnonzero((s == 0) & (p == 519))[0]),
           int(np.flatnonzero((s == 3) & (p == 4096))[0])]
    cases.append(("interleaved short requests", 4, s, p, nan, [(1, 0)]))
    # more rows than a CSA call splits (its whole-request walk by shape)
    pos = (rng.integers(1, MAX_CONTEXT // 128, 96) * 128 - 1).astype(np.int32)
    pos[::5] -= rng.integers(1, 100, len(pos[::5])).astype(np.int32)
    cases.append(("96 one-token requests", 96, np.arange(96, dtype=np.int32), pos, [7], []))
    # 201 rows (the append role's staged copy over several warps' tokens, its
    # last group of 4 rows partial): longer runs interleaved, a bad slot, padding,
    # a bad position, NaN rows
    s, p = _interleaved(rng, (0, 1000, 70), (1, 126, 60), (2, 5000, 50), (3, 300, 17))
    s = np.r_[s, 9, -1, 2, 1].astype(np.int32)
    p = np.r_[p, 5, 0, -3, 186].astype(np.int32)
    nan = [int(np.flatnonzero((s == 0) & (p == 1069))[0]),
           int(np.flatnonzero((s == 2) & (p == 5010))[0])]
    cases.append(("201 interleaved rows", 4, s, p, nan, []))
    cases.append(many_short_requests(rng))
    return cases


def many_short_requests(rng):
    """A verify or commit step's shape past the grid's one wave: 150 requests
    of 1 to 4 rows (more requests than blocks, so each block walks several,
    dealt by the rank of their first rows), interleaved so that a request's
    rows sit in different warps, with bad slots in several warps, padding,
    NaN rows and a missing block; 460 rows."""
    R = 150
    runs = [(i, int(rng.integers(1, MAX_CONTEXT // 4)) * 4 - int(rng.integers(0, 4)),
             int(rng.integers(1, 5))) for i in range(R)]
    runs[3] = (3, 62, 3)                    # in block 0 of slot 3: missing
    runs[77] = (77, 130, 4)                 # in block 1 of slot 77: missing
    s, p = _interleaved(rng, *runs)
    extra = 460 - len(s)
    at = np.sort(rng.choice(len(s) + extra, extra, replace=False))
    fill_s = np.where(np.arange(extra) % 3 == 0, R + 7, -1).astype(np.int32)
    s = np.insert(s, at - np.arange(extra), fill_s).astype(np.int32)
    p = np.insert(p, at - np.arange(extra), 5).astype(np.int32)
    assert len(s) == 460
    good = np.flatnonzero((s >= 0) & (s < R))
    nan = [int(t) for t in rng.choice(good, 4, replace=False)]
    return ("150 short requests, 460 rows", R, s, p, nan, [(3, 0), (77, 1)])


@pytest.mark.parametrize("case", _decode_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_write_layer_decode(kind, case):
    """write_layer of a decode-sized call: the CPU handler's state up to
    one-code flips, the same error counts."""
    _, R, slots, pos, nan_rows, missing = case
    st = prefill_state("ds_fp8", R=R, max_context=MAX_CONTEXT, missing=missing, seed=1,
                       empty_slots=(2,))
    proj = projections(kind, len(slots), seed=2, nan_rows=nan_rows)
    prm = params(kind, seed=3)
    window_kv = jnp.asarray(np.random.default_rng(4).standard_normal((len(slots), 512)),
                            jnp.bfloat16)
    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    out = _host(call_write_layer(st, kind, slots, pos, window_kv, proj, prm, impl="cuda",
                                 device=gpu))
    host = _host(call_write_layer(st, kind, slots, pos, window_kv, proj, prm, impl="cpu",
                                  device=cpu))
    flips = Flips()
    compare_states(out, host, flips, f"{kind} cuda vs cpu ")
    np.testing.assert_array_equal(out.errors, host.errors)
    assert flips.fraction < MAX_FLIP_FRACTION, flips
    if nan_rows:
        assert host.errors[EK.NONFINITE] >= 1


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_flush_dealt_by_rank(kind):
    """flush's own decode kernel on more rows than its one wave of blocks
    (its requests dealt by rank) against the CPU handler, and with the
    caller's row bound (which keeps this kernel) byte for byte."""
    _, R, slots, pos, nan_rows, missing = many_short_requests(np.random.default_rng(8))
    st = prefill_state("ds_fp8", R=R, max_context=MAX_CONTEXT, missing=missing, seed=6)
    proj = projections(kind, len(slots), seed=7, nan_rows=nan_rows)
    prm = params(kind, seed=9)
    gpu = jax.devices("cuda")[0]
    out = _host(call_flush(st, kind, slots, pos, proj, prm, device=gpu, max_rows_per_slot=4))
    host = _host(call_flush(st, kind, slots, pos, proj, prm))
    flips = Flips()
    compare_states(out, host, flips, f"{kind} cuda vs cpu ")
    np.testing.assert_array_equal(out.errors, host.errors)
    assert flips.fraction < MAX_FLIP_FRACTION, flips
    assert host.errors[EK.BAD_SLOT] > 0 and host.errors[EK.NONFINITE] > 0


@pytest.mark.parametrize("B, context", [(1, 4096), (8, 16384), (64, 4096), (2, 131072)])
def test_indexer_overlapped_score(B, context):
    """indexer_topk (mxfp4), its score kernel launched overlapped: the
    replayed ranking's indices. The shapes take each score grid (pairs of
    warps, 16 columns) and a select cluster."""
    rng = np.random.default_rng(B)
    st = with_random_blocks(rng, make_state(rng, R=B, max_context=context), B)
    slot = np.arange(B, dtype=np.int32)
    pos = np.full(B, context - 1, np.int32)
    pos[B // 2:] -= rng.integers(0, context // 2, B - B // 2).astype(np.int32)
    q, w = queries(rng, B)
    want, _ = expected(st, 1, slot, pos, q, w, 512, "mxfp4")
    got = np.asarray(run(st, 1, slot, pos, q, w, 512, "cuda", return_state=False,
                         q_format="mxfp4"))
    np.testing.assert_array_equal(got, want)


def test_indexer_sees_the_key_written_just_before():
    """One jitted step: write_layer closes a CSA window (its token at a
    window's last position stores the indexer key of the entry it closes),
    then indexer_topk at that token ranks every visible entry (k above
    their count, so the whole order shows), the new one included. The score
    kernel, launched overlapped, must read the keys after the write ends: its
    indices are the replayed ranking of the keys the step leaves, and differ
    from the ranking of the keys before the step."""
    kind = C.CSA
    slots, pos = rows((0, 1023, 1), (1, 515, 1), (3, 255, 1))
    rng = np.random.default_rng(14)
    st = prefill_state("ds_fp8", R=4, max_context=2048, seed=11)
    Lc, N = st.csa.index.packed.shape[:2]
    st = with_index_keys(st, rng.integers(0, 256, (Lc, N, 32, 64), dtype=np.uint8),
                         rng.integers(119, 132, (Lc, N, 32, 4), dtype=np.uint8))
    proj = projections(kind, len(slots), seed=12)
    prm = params(kind, seed=13)
    window_kv = jnp.asarray(rng.standard_normal((len(slots), 512)), jnp.bfloat16)
    q, w = queries(rng, len(slots))
    meta = D.StepMeta.build(token_slot=slots, token_pos=pos, lengths=np.zeros(4, np.int32))
    layer = 1   # the tiny config's first CSA layer (support.flush_plan.LAYER)
    k = 300     # above the 256 visible entries of the first token

    def step(st, meta, x, ckv, csc, ikv, isc, prm, q, w):
        st = D.write_layer(st, layer, meta, x, ckv, csc, prm, index_kv=ikv, index_score=isc)
        idx, st = D.indexer_topk(st, layer, meta.token_slot, meta.token_pos, q, w, k,
                                 return_state=True)
        return idx, st

    args = jax.device_put((st, meta, window_kv, *proj, prm, jnp.asarray(q), jnp.asarray(w)),
                          jax.devices("cuda")[0])
    with D.default_impl("cuda"):
        idx, after = jax.jit(step)(*args)
    idx = np.asarray(idx)
    assert not np.asarray(after.errors).any()
    want, _ = expected(after, layer, slots, pos, q, w, k, "mxfp4")
    np.testing.assert_array_equal(idx, want)
    stale, _ = expected(st, layer, slots, pos, q, w, k, "mxfp4")
    assert (stale != want).any(), "the step's new keys changed no ranking"
