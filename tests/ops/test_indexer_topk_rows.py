"""indexer_topk's rows_per_request (dsv4_jax/ops/indexer.py), a schedule hint
that never changes a result: for every value each implementation returns the
reference's indices and error counts (first rows included) and the handlers'
rank keys equal the float32 replay bit for bit, on batches that hold
verify-step rows (a request's rows in a row, their visible counts differing
across a tile and a CTA span), rows of several slots in one group, a bad row
inside a request's rows, missing blocks some rows of a group need and others
do not, and T not a multiple of the group. On CUDA the groups of q_format
"mxfp4" run ScoreKernelMxfp4Rows (cuda/indexer_topk/score_mxfp4_rows.cuh)
where a CTA a row would give each warp at least 12 tiles on average
(RowsPerCta in cuda/indexer_topk/launch_policy.h), so the CUDA cases of the
small batch take a 256k context (E = 65536 entries a request: its 27 rows
group on any GPU of up to 288 multiprocessors; the rows stay at the same
short positions, so the reference's work does not grow) where the others
take 2k. Bad values are refused alike everywhere."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK
from dsv4_jax.ops.indexer import MAX_ROWS_PER_REQUEST

from support.indexer import (IMPLS, Q_FORMATS, expected, handler_scratch, host_keys, make_state,
                             needs_cpu_target, np_rank_keys, queries, random_blocks,
                             replay_f32, replay_f32_mxfp4, run, visible, with_index_keys,
                             with_random_blocks)
from support.marks import CUDA, requires_cpu_ffi

LAYER, KIND = 3, 1             # the second CSA layer of the tiny preset, its CSA index
R, MAX_CONTEXT = 6, 2048       # E = 512 entries a request
CUDA_CONTEXT = 262144          # E = 65536: 27 x 2048 tiles, >= 12 a warp up to 288 SMs
GROUPS = [1, 2, 3, 4, 8]
HANDLERS = [pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
            pytest.param("cuda", marks=CUDA)]


def context_of(impl):
    return CUDA_CONTEXT if impl == "cuda" else MAX_CONTEXT


def rows_state(rng, detail=False, context=MAX_CONTEXT):
    """Six requests owning random blocks; slot 2 lacks logical blocks 1 and 2
    and maps block 5 past N; scale bytes mixed so that some tiles take the
    fast form, some the per-block form, some bytes past 231."""
    st = make_state(rng, R=R, max_context=context, num_blocks=max(128, R * context // 128))
    blocks = random_blocks(rng, st.config, range(R))
    bt = np.stack([np.r_[b] for b in blocks.values()]).astype(np.int32)
    bt[2, 1] = bt[2, 2] = -1
    bt[2, 5] = 999
    scale = rng.integers(119, 132, np.asarray(st.csa.index.scale).shape, dtype=np.uint8)
    scale[:, 0::2] = rng.integers(125, 129, scale[:, 0::2].shape)
    scale[:, 1::8] = rng.integers(228, 241, scale[:, 1::8].shape)
    st = with_index_keys(dataclasses.replace(st, block_table=jnp.asarray(bt)), scale=scale)
    if detail:
        cfg = st.config.replace(error_detail=True)
        st = dataclasses.replace(st, config=cfg, errors=D.init_state(cfg).errors)
    return st


# (slot, position, what spoils the row); visible count n = (pos + 1) // 4
ROWS = [
    (0, 1024, None), (0, 1025, None), (0, 1026, None), (0, 1027, None),   # n 256 x3, 257: 2nd span
    (1, 129, None), (1, 130, None), (1, 131, None), (1, 132, None),       # n 32, 32, 33, 33: tile 1
    (2, 256, None), (2, 257, None), (2, 258, None), (2, 259, None),       # n 64 x3, 65: blocks 1, 2
    (3, 600, None), (-1, 601, None), (3, 602, "q"), (3, 603, None),       # padding, NaN q
    (4, 700, None), (4, None, None), (9, 702, None), (4, 703, "w"),   # bad pos, slot; Inf w
    (0, 2047, None), (5, 40, None), (1, 1500, None), (5, 2, None),        # four slots; n = 0
    (5, 1500, None), (5, 1501, None), (5, 1502, "head"),                  # T = 27; a slow query
]
# slot 2: block 1 needed by its four rows, block 2 by the last (n = 65)
COUNTS = {EK.MISSING_BLOCK: 5, EK.NONFINITE: 2, EK.BAD_POSITION: 1, EK.BAD_SLOT: 1}
BAD = [13, 14, 17, 18, 19]


def rows_batch(rng, context=MAX_CONTEXT):
    """The ROWS batch; None: the first position past the context."""
    slot = np.array([s for s, _, _ in ROWS], np.int32)
    pos = np.array([context if p is None else p for _, p, _ in ROWS], np.int32)
    q, w = queries(rng, len(ROWS))
    q = np.asarray(q, np.float32)
    for t, (_, _, spoil) in enumerate(ROWS):
        if spoil == "q":
            q[t, rng.integers(64), rng.integers(128)] = np.nan
        elif spoil == "w":
            w[t, rng.integers(64)] = np.inf
        elif spoil == "head":                   # a head's block scales spread by 5
            q[t, 9, 64:96] *= 32.0
    return slot, pos, q.astype(jnp.bfloat16), w


def counts(errors):
    e = np.asarray(errors)[:len(EK)]
    return {EK(k): int(v) for k, v in enumerate(e) if v}


@pytest.mark.parametrize("rows_per_request", GROUPS)
@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_any_rows_per_request_same_indices_and_counts(impl, q_format, rows_per_request):
    rng = np.random.default_rng(61)
    st = rows_state(rng, context=context_of(impl))
    slot, pos, q, w = rows_batch(rng, context_of(impl))
    k = 64
    with np.errstate(over="ignore", invalid="ignore"):
        got, st2 = run(st, LAYER, slot, pos, q, w, k, impl, q_format=q_format,
                       rows_per_request=rows_per_request)
        ref, st_ref = run(st, LAYER, slot, pos, q, w, k, "reference", q_format=q_format)
        want, _ = expected(st, LAYER, slot, pos, q, w, k, q_format)
    got = np.asarray(got)
    np.testing.assert_array_equal(got, np.asarray(ref))
    good = np.setdiff1d(np.arange(len(slot)), BAD)
    np.testing.assert_array_equal(got[good], want[good])
    assert np.all(got[BAD] == -1)
    assert counts(st2.errors) == COUNTS
    np.testing.assert_array_equal(np.asarray(st2.errors), np.asarray(st_ref.errors))
    # the rows of slot 2 see nothing of its missing blocks 1 and 2
    assert not np.isin(got[8:12], np.arange(32, 96)).any() and (got[8:12] >= 0).any()


@pytest.mark.parametrize("rows_per_request", [1, 4])
@pytest.mark.parametrize("impl", IMPLS)
def test_error_detail_equals_the_reference(impl, rows_per_request):
    """With error detail the first row of each kind (its slot and position)
    is the reference's too: a group counts each row as that row."""
    rng = np.random.default_rng(62)
    st = rows_state(rng, detail=True, context=context_of(impl))
    slot, pos, q, w = rows_batch(rng, context_of(impl))
    _, st2 = run(st, LAYER, slot, pos, q, w, 16, impl, q_format="mxfp4",
                 rows_per_request=rows_per_request)
    _, st_ref = run(st, LAYER, slot, pos, q, w, 16, "reference", q_format="mxfp4")
    assert counts(st2.errors) == COUNTS
    np.testing.assert_array_equal(np.asarray(st2.errors), np.asarray(st_ref.errors))


def replayed_rank_keys(st, slot, pos, q, w, q_format):
    """Per good row: the replayed rank keys of its visible entries, 0 for an
    entry of a missing block (the handlers' mark of a non-candidate)."""
    out = {}
    for t in range(len(slot)):
        if t in BAD or not 0 <= slot[t] < R:
            continue
        n = visible(int(pos[t]), st.config.max_blocks_per_request)
        keys, ok, codes, sbytes = host_keys(st, KIND, slot[t], n, with_codes=True)
        with np.errstate(over="ignore", invalid="ignore"):
            s = (replay_f32_mxfp4(codes, sbytes, q[t], w[t]) if q_format == "mxfp4"
                 else replay_f32(keys, q[t], w[t]))
        out[t] = np.where(ok, np_rank_keys(s), np.uint32(0))
    return out


@pytest.mark.parametrize("rows_per_request", [2, 4, 8])
@pytest.mark.parametrize("impl", HANDLERS)
def test_handler_rank_keys_bit_exact(impl, rows_per_request):
    """The handlers' rank key of every visible entry of every good row equals
    the float32 replay (fast and per-block tiles, a slow query among fast
    ones of its request, entries of missing blocks 0)."""
    rng = np.random.default_rng(63)
    st = rows_state(rng, context=context_of(impl))
    slot, pos, q, w = rows_batch(rng, context_of(impl))
    scratch = handler_scratch(impl, st, slot, pos, q, w, "mxfp4", rows_per_request)
    wants = replayed_rank_keys(st, slot, pos, q, w, "mxfp4")
    assert len(wants) == 22 and any(len(v) == 0 for v in wants.values())
    for t, want in wants.items():
        np.testing.assert_array_equal(scratch[t, :len(want)], want, err_msg=f"row {t}")


@pytest.mark.parametrize("impl", [pytest.param("cuda", marks=CUDA)])
def test_verify_rows_on_a_large_grid(impl):
    """16 requests of 1 + 3 rows at positions up to 16k in a 64k context (E
    = 16384: 67 x 512 tiles, 16 a warp on 132 multiprocessors, which groups),
    then three rows of other slots (T = 67); request 3 lacks a block its rows
    need, one row has a NaN in q. On 132 multiprocessors (an H100 or H200)
    groups of 2, 4 and 8 run ScoreKernelMxfp4Rows in single warps with 11, 5
    and 3 tiles a warp. Indices and error counts equal the reference's on the host CPU;
    the rank keys of every visible entry of the good rows those of groups of
    1 (ScoreKernelMxfp4)."""
    rng = np.random.default_rng(64)
    B, rows, context, max_context = 16, 4, 16384, 65536
    st = with_random_blocks(rng, make_state(rng, R=B + 2, max_context=max_context,
                                             num_blocks=(B + 2) * max_context // 128), B + 2)
    bt = np.array(st.block_table)
    bt[3, 40] = -1                                           # entries 1280 .. 1311
    st = dataclasses.replace(st, block_table=jnp.asarray(bt))
    slot = np.r_[np.repeat(np.arange(B), rows), [B, B + 1, 0]].astype(np.int32)
    ends = rng.integers(context // 2, context - rows, B)
    ends[:4] = [4096, 8192, 12285, context - rows]           # n 1024 | 1025, 2048 | 2049, ...
    pos = np.r_[(ends[:, None] + np.arange(rows)).ravel(), [100, context - 1, 5000]]
    pos = pos.astype(np.int32)
    q, w = queries(rng, len(slot))
    q = np.asarray(q, np.float32)
    q[5, 7, 3] = np.nan
    q = q.astype(jnp.bfloat16)
    k = 128
    cpu = jax.devices("cpu")[0]
    host = jax.device_put((st, slot, pos, q, w), cpu)
    with jax.default_device(cpu):
        ref, st_ref = run(host[0], LAYER, *host[1:], k, "reference", q_format="mxfp4")
    assert counts(st_ref.errors) == {EK.MISSING_BLOCK: 4, EK.NONFINITE: 1}
    one = handler_scratch(impl, st, slot, pos, q, w, "mxfp4", 1)
    n = [visible(int(p), st.config.max_blocks_per_request) for p in pos]
    for group in (2, 4, 8):
        got, st2 = run(st, LAYER, slot, pos, q, w, k, impl, q_format="mxfp4",
                       rows_per_request=group)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref),
                                      err_msg=f"groups of {group}")
        np.testing.assert_array_equal(np.asarray(st2.errors), np.asarray(st_ref.errors))
        scratch = handler_scratch(impl, st, slot, pos, q, w, "mxfp4", group)
        for t in np.setdiff1d(np.arange(len(slot)), [5]):
            np.testing.assert_array_equal(scratch[t, :n[t]], one[t, :n[t]],
                                          err_msg=f"groups of {group}, row {t}")


BAD_VALUES = [0, MAX_ROWS_PER_REQUEST + 1, -1, True, 2.0, "4", None]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_rows_per_request_refused(impl):
    rng = np.random.default_rng(65)
    st = make_state(rng, blocks={0: [0, 1]})
    q, w = queries(rng, 2)
    s = jnp.zeros(2, jnp.int32)
    for value in BAD_VALUES:
        with pytest.raises(ValueError, match=r"rows_per_request: expected an int in \[1, 8\], "
                                             f"got {value!r}"):
            D.indexer_topk(st, LAYER, s, s, jnp.asarray(q), jnp.asarray(w), 4, impl=impl,
                           rows_per_request=value)


@pytest.mark.parametrize("impl", HANDLERS)
def test_handlers_refuse_bad_rows_per_request(impl):
    """A raw call of the FFI target gets the op's message from either handler."""
    rng = np.random.default_rng(66)
    st = make_state(rng, blocks={0: [0, 1]})
    q, w = queries(rng, 2)
    slot, pos = np.zeros(2, np.int32), np.array([100, 200], np.int32)
    assert handler_scratch(impl, st, slot, pos, q, w, "mxfp4", MAX_ROWS_PER_REQUEST).shape[0] == 2
    for value in (0, MAX_ROWS_PER_REQUEST + 1, -3):
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"rows_per_request: expected an int in \[1, 8\], "
                                            f"got {value}"):
            handler_scratch(impl, st, slot, pos, q, w, "mxfp4", value)
