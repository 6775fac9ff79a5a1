"""attention (docs/design/operations.md) on every implementation against the float64
oracle (tests/support/attention_oracle.py) within the contract's bound
2^-6 * M (M = the largest |value| among the rows a token sees): decode and
prefill chunks, every KV format and layer kind, requests that see fewer
entries than k, -1 indices, padding and bad tokens (counted as the oracle
counts them), one and many requests; and a prefill chunk against decoding
its tokens one by one. Random caches are built from raw bytes, so every ring
position, block and entry is chosen here."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK

from support import attention_oracle as AO
from support.marks import CUDA, every_impl, requires_cpu_ffi
from support.tiny_step import errs

FORMATS = ("ds_fp8", "fp8_token", "bf16")
LAYER = {"swa": 0, "csa": 1, "hca": 2}          # CacheConfig.tiny(): SWA, CSA, HCA, CSA
BOUND = AO.BOUND


def CUDA_MARKS(fn):
    for mark in CUDA:
        fn = mark(fn)
    return fn
INV_FREQ = np.asarray(D.yarn_inv_freq(), np.float32)


bf16, queries = AO.bf16, AO.queries


def picks(rng, pos, k, extra=()):
    """Random visible CSA indices of each position, -1 padded (a request that
    sees fewer than k entries ends in -1s)."""
    out = np.full((len(pos), k), -1, np.int32)
    for t, p in enumerate(pos):
        n = max(int(p) + 1, 0) // 4
        take = rng.permutation(n)[:k]
        out[t, :len(take)] = take
    for t, j, v in extra:
        out[t, j] = v
    return out


def check(state, layer, q, slot, pos, sink, topk=None, chunk_kv=None, inv_freq=INV_FREQ,
          **kw):
    """Run the op (impl "auto": the one under test) and hold it to the oracle."""
    fn = jax.jit(lambda st, *a: D.attention(st, layer, *a[:3], sink=a[3], topk=a[4],
                                            chunk_kv=a[5], rope_inv_freq=a[6], **kw))
    args = [jnp.asarray(x) if x is not None else None
            for x in (q, slot, pos, sink, topk, chunk_kv, inv_freq)]
    out, lse, st = fn(state, *args)
    want, want_lse, M, want_err = AO.attention(state, layer, q, slot, pos, sink, topk, chunk_kv,
                                               inv_freq)
    AO.assert_within_bound(out, lse, want, want_lse, M)
    assert errs(st) == want_err
    return np.asarray(out, np.float32).astype(np.float64), np.asarray(lse, np.float64), st


def decode_batch(rng, lengths, k, pads=2):
    """One decode token per request (position = length - 1), padding rows too."""
    slot, pos = [], []
    for s, n in lengths.items():
        slot.append(s)
        pos.append(n - 1)
    slot += [-1] * pads
    pos += [0] * pads
    order = rng.permutation(len(slot))
    return np.int32(slot)[order], np.int32(pos)[order]


# ---- decode -----------------------------------------------------------------------------------
@every_impl
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_decode_matches_oracle(fmt, kind):
    decode_case(fmt, kind)


def decode_case(fmt, kind, **kw):
    """Four requests (fewer entries than k, a partial ring, full ones) and
    padding rows, one decode token each."""
    rng = np.random.default_rng(hash((fmt, kind)) % 2 ** 32)
    lengths = {0: 1, 1: 37, 2: 300, 3: 700}      # fewer entries than k, a partial ring, full ones
    state = AO.random_state(fmt, lengths, seed=1)
    slot, pos = decode_batch(rng, lengths, 16)
    H = 8
    topk = picks(rng, pos, 16) if kind == "csa" else None
    sink = rng.normal(0, 1, H).astype(np.float32)
    check(state, LAYER[kind], queries(rng, len(slot), H), slot, pos, sink, topk, **kw)


@every_impl
def test_decode_single_request_no_rope_and_csa_gaps():
    """B = 1, no inverse RoPE, and -1 indices between real picks."""
    rng = np.random.default_rng(3)
    state = AO.random_state("ds_fp8", {2: 513}, seed=2)
    pos = np.int32([512])
    topk = picks(rng, pos, 24)
    topk[0, ::3] = -1
    check(state, 1, queries(rng, 1, 4), np.int32([2]), pos,
          rng.normal(0, 1, 4).astype(np.float32), topk, inv_freq=None)


@every_impl
def test_bad_input_is_counted_and_dropped():
    rng = np.random.default_rng(4)
    state = AO.random_state("ds_fp8", {0: 400, 1: 260}, seed=3, missing=[(1, 1)])
    slot = np.int32([0, 1, 7, 0, 0, -1, 1, 0])
    pos = np.int32([399, 259, 5, 1024, -3, 2, 200, 398])
    H = 4
    q = queries(rng, len(slot), H)
    q[7, 2, 100] = np.nan                                 # NONFINITE: dropped, counted once
    topk = picks(rng, pos, 8, extra=[(0, 7, 100), (0, 6, -5), (1, 7, 40), (6, 7, 60)])
    # token 0: index 100 not visible (<= 99 are) and -5 -> BAD_INDEX twice; token 1:
    # entry 40 sits in logical block 1, missing -> MISSING_BLOCK (so may others)
    sink = rng.normal(0, 1, H).astype(np.float32)
    out, lse, st = check(state, 1, q, slot, pos, sink, topk)
    e = errs(st)
    assert e[EK.BAD_SLOT] == 1 and e[EK.BAD_POSITION] == 2 and e[EK.NONFINITE] == 1
    assert e[EK.BAD_INDEX] >= 2 and e[EK.MISSING_BLOCK] >= 1
    for t in (2, 3, 4, 5, 7):
        assert not out[t].any() and np.all(lse[t] == -np.inf)
    # HCA: a missing block skips that entry only
    check(state, 2, q[:3], slot[:3], pos[:3], sink)


@every_impl
def test_bad_traced_layer_drops_every_token():
    rng = np.random.default_rng(5)
    state = AO.random_state("bf16", {0: 50}, seed=4)
    q = jnp.asarray(queries(rng, 2, 4))
    f = jax.jit(lambda st, layer: D.attention(st, layer, q, jnp.int32([0, 0]), jnp.int32([49, 48]),
                                              sink=jnp.zeros(4), kind="hca"))
    out, lse, st = f(state, jnp.int32(1))            # layer 1 is CSA, not HCA
    assert errs(st) == {EK.BAD_LAYER: 1}
    assert not np.asarray(out, np.float32).any() and np.all(np.asarray(lse) == -np.inf)
    out, lse, st = f(state, jnp.int32(2))
    assert errs(st) == {} and np.asarray(out, np.float32).any()


def stale_counts(state, slot, pos, chunk_first=None):
    """STALE_WINDOW by hand: per good query (s, p), the window positions
    max(0, p - 127) .. p (below the chunk's first position of s, if any)
    whose ring row does not hold them."""
    ring = np.asarray(state.swa.pos)[0]
    n = 0
    for s, p in zip(slot, pos):
        if s < 0:
            continue
        end = p + 1 if chunk_first is None else min(p + 1, chunk_first[s])
        n += sum(int(ring[s, w % 128]) != w for w in range(max(0, p - 127), end))
    return n


@every_impl
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_stale_window_rows_are_counted_and_not_read(kind):
    """A window row a query needs that holds another position is counted
    (STALE_WINDOW, one per row and query) and not read, the query attending
    over the rest: a gap (position 110 after 100), a rewind (250 in a request
    of 300: rows 123..171 hold 251..299), a chunk appended before its own
    decode-style reads (positions 300..363 after their append: 63 + 62 + ...
    stale rows), and a fresh slot read before its append. What is
    legitimately absent counts nothing: positions before 0, the current
    decode token, and a prefill chunk's own rows (chunk_kv)."""
    rng = np.random.default_rng(11)
    state = AO.random_state("ds_fp8", {0: 300, 1: 100, 3: 364}, seed=12)
    H = 4
    sink = rng.normal(0, 1, H).astype(np.float32)
    # decode-style reads (no chunk_kv)
    slot = np.int32([1, 0, 0, 2, 1, -1] + [3] * 64)
    pos = np.int32([110, 250, 299, 0, 99, 0] + list(range(300, 364)))
    topk = picks(rng, pos, 8) if kind == "csa" else None
    out, lse, st = check(state, LAYER[kind], queries(rng, len(slot), H), slot, pos, sink, topk)
    want = stale_counts(state, slot, pos)
    assert want == 11 + 49 + 1 + 63 * 64 // 2
    assert errs(st).get(EK.STALE_WINDOW) == want
    # the legitimate reads alone count nothing
    ok = slice(2, 3), slice(4, 5)
    for rows in ok:
        _, _, st = check(state, LAYER[kind], queries(rng, 1, H), slot[rows], pos[rows], sink,
                         None if topk is None else topk[rows])
        assert EK.STALE_WINDOW not in errs(st)
    # a prefill chunk read before its append (the chunk recipe): slot 0
    # continues at 300, slot 2 is fresh (its rows all come from chunk_kv)
    slot = np.int32([0] * 40 + [2] * 20 + [-1] * 4)
    pos = np.int32(list(range(300, 340)) + list(range(20)) + [0] * 4)
    topk = picks(rng, pos, 8) if kind == "csa" else None
    chunk = bf16(rng.standard_normal((len(slot), 512)))
    _, _, st = check(state, LAYER[kind], queries(rng, len(slot), H), slot, pos, sink, topk, chunk)
    assert EK.STALE_WINDOW not in errs(st)
    # the same chunk starting at 280 (a rewind: rows 153..171 hold 281..299)
    pos = np.int32(list(range(280, 320)) + list(range(20)) + [0] * 4)
    _, _, st = check(state, LAYER[kind], queries(rng, len(slot), H), slot, pos, sink, topk, chunk)
    want = stale_counts(state, slot, pos, chunk_first={0: 280, 2: 0})
    assert want > 0 and errs(st).get(EK.STALE_WINDOW) == want


# ---- prefill chunks ---------------------------------------------------------------------------
def chunk_rows(rng, before: dict, sizes: dict, interleave=False):
    """Rows of one prefill call: request s continues at position before[s]
    with sizes[s] tokens; plus two padding rows."""
    rows = [(s, before[s] + i) for s, n in sizes.items() for i in range(n)] + [(-1, 0), (-1, 0)]
    if interleave:
        rows = [rows[i] for i in rng.permutation(len(rows))]
    slot = np.int32([r[0] for r in rows])
    pos = np.int32([r[1] for r in rows])
    return slot, pos


@every_impl
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_prefill_chunk_matches_oracle(fmt, kind):
    prefill_case(fmt, kind)


def prefill_case(fmt, kind, **kw):
    """A first chunk, one across a block, one longer than the window, and a
    chunk row append would drop."""
    rng = np.random.default_rng(hash((fmt, kind, "chunk")) % 2 ** 32)
    before = {0: 0, 1: 90, 3: 250}
    sizes = {0: 40, 1: 60, 3: 150}                    # a first chunk, one across a block, one > 128
    state = AO.random_state(fmt, before, seed=5,
                            capacity={s: before[s] + sizes[s] for s in before})
    slot, pos = chunk_rows(rng, before, sizes, interleave=(kind == "swa"))
    H = 4
    chunk = bf16(rng.standard_normal((len(slot), 512)))
    chunk[3, 7] = np.inf                              # a row append would drop: not seen
    topk = picks(rng, pos, 16) if kind == "csa" else None
    check(state, LAYER[kind], queries(rng, len(slot), H), slot, pos,
          rng.normal(0, 1, H).astype(np.float32), topk, chunk, **kw)


@every_impl
@pytest.mark.parametrize("layout", ["one_run", "gap", "two_runs", "padding_inside"])
def test_prefill_chunk_row_layouts(layout):
    """The CUDA kernel takes a prefill query's chunk candidates from rows
    t - 127 .. t alone when its request's rows form one run of consecutive
    positions; every other layout must still see each window row the chunk
    holds: a gap in a request's positions, a request in two runs around
    another's, a padding row inside a run. Queries 128 and more rows into a
    run see rows both near and far before them."""
    rng = np.random.default_rng(hash(("chunk layouts", layout)) % 2 ** 32)
    fmt = "ds_fp8"
    rows0 = [(0, 100 + i) for i in range(200)]
    rows1 = [(1, 30 + i) for i in range(40)]
    if layout == "gap":
        rows0 = rows0[:70] + [(0, p + 5) for _, p in rows0[70:]]
    if layout == "padding_inside":
        rows0 = rows0[:90] + [(-1, 0)] + rows0[90:]
    rows = rows0[:120] + rows1 + rows0[120:] if layout == "two_runs" else rows0 + rows1
    slot = np.int32([r[0] for r in rows])
    pos = np.int32([r[1] for r in rows])
    state = AO.random_state(fmt, {0: 100, 1: 30}, seed=9,
                            capacity={0: int(pos[slot == 0].max()) + 1, 1: 70})
    H = 4
    chunk = bf16(rng.standard_normal((len(slot), 512)))
    check(state, LAYER["csa"], queries(rng, len(slot), H), slot, pos,
          rng.normal(0, 1, H).astype(np.float32), picks(rng, pos, 16), chunk)


@every_impl
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_prefill_chunk_equals_decoding_one_by_one(kind, impl_under_test):
    """Chunk mode before the append gives what appending the tokens one at a
    time and attending after each gives: the same rows with the same values.
    The CPU handler walks the window in position order in both, so its bits
    agree; the others sum in another order (within the bound)."""
    rng = np.random.default_rng(7)
    fmt = "ds_fp8"
    before, sizes = {1: 200, 2: 0}, {1: 70, 2: 20}
    state = AO.random_state(fmt, before, seed=6, capacity={1: 270, 2: 20})
    slot, pos = chunk_rows(rng, before, sizes)
    T, H = len(slot), 4
    q = queries(rng, T, H)
    chunk = bf16(rng.standard_normal((T, 512)))
    sink = rng.normal(0, 1, H).astype(np.float32)
    layer = LAYER[kind]
    topk = jnp.asarray(picks(rng, pos, 8)) if kind == "csa" else None
    freq = jnp.asarray(INV_FREQ)
    attend = jax.jit(lambda st, q_, s_, p_, tk, ck: D.attention(
        st, layer, q_, s_, p_, sink=jnp.asarray(sink), topk=tk, chunk_kv=ck, rope_inv_freq=freq))
    out, lse, _ = attend(state, jnp.asarray(q), jnp.asarray(slot), jnp.asarray(pos), topk,
                         jnp.asarray(chunk))
    append = jax.jit(lambda st, meta, kv: D.append(st, layer, meta, kv))
    step_out = np.zeros((T, H, 512), np.float32)
    step_lse = np.full((T, H), -np.inf, np.float32)
    st = state
    for t in range(T):
        if slot[t] < 0:
            continue
        meta = D.StepMeta.build(token_slot=slot[t:t + 1], token_pos=pos[t:t + 1],
                                lengths=np.zeros(4, np.int32))
        st = append(st, meta, jnp.asarray(chunk[t:t + 1]))
        o, l, _ = attend(st, jnp.asarray(q[t:t + 1]), jnp.asarray(slot[t:t + 1]),
                         jnp.asarray(pos[t:t + 1]), None if topk is None else topk[t:t + 1], None)
        step_out[t], step_lse[t] = np.asarray(o, np.float32)[0], np.asarray(l)[0]
    out = np.asarray(out, np.float32)
    if impl_under_test == "cpu":
        np.testing.assert_array_equal(out, step_out)
        np.testing.assert_array_equal(np.asarray(lse), step_lse)
    else:
        _, _, M, _ = AO.attention(state, layer, q, slot, pos, sink,
                                  None if topk is None else np.asarray(topk), chunk, INV_FREQ)
        assert np.all(np.abs(out - step_out) <= 2 * BOUND * M[:, None, None] + 1e-30)
        np.testing.assert_allclose(np.asarray(lse), step_lse, rtol=1e-5, atol=1e-5)


@every_impl
@pytest.mark.parametrize("kind,H", [("csa", 64), ("hca", 64), ("csa", 96)])
def test_flash_shapes_many_requests(kind, H):
    flash_case(kind, H)


def flash_case(kind, H, **kw):
    """V4-Flash's 64 heads and k = 512 (more items than one pass of the CUDA
    kernels: ten 64-row tiles, which the tensor-core kernel splits over CTAs),
    eight requests up to 4k tokens; 96 heads make one full and one partial
    64-head group."""
    rng = np.random.default_rng(9)
    lengths = {s: int(n) for s, n in enumerate(rng.integers(1, 4096, 8))}
    lengths[0] = 4096
    state = AO.random_state("ds_fp8", lengths, R=8, max_context=4096, seed=10)
    slot, pos = decode_batch(rng, lengths, 512, pads=1)
    topk = picks(rng, pos, 512) if kind == "csa" else None
    check(state, LAYER[kind], queries(rng, len(slot), H), slot, pos,
          rng.normal(0, 1, H).astype(np.float32), topk, **kw)


@CUDA_MARKS
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_mma_sync_kernel_matches_oracle(fmt, kind):
    """The tensor-core kernel on warp-level mma.sync, what a Blackwell GPU runs
    (kernel="mma_sync" runs it on this Hopper): decode and prefill chunks of
    every format and layer kind, and V4-Flash shapes with 96 heads."""
    decode_case(fmt, kind, kernel="mma_sync")
    prefill_case(fmt, kind, kernel="mma_sync")
    if fmt == "ds_fp8" and kind != "swa":
        flash_case(kind, 96, kernel="mma_sync")


@CUDA_MARKS
@pytest.mark.parametrize("kernel", ["auto", "mma_sync"])
@pytest.mark.parametrize("B", [1, 2, 8, 20, 64, 140])
def test_decode_batches_that_split_over_clusters(B, kernel):
    """V4-Flash decode batches whose tokens the tensor-core kernel splits over
    clusters of different sizes (B = 1: up to 16 CTAs a token merging in
    distributed shared memory; B = 64: two; B = 140: none, more tokens than
    one wave), CSA with k = 512 and HCA, against the oracle; on wgmma (this
    Hopper's "auto") and on mma.sync."""
    rng = np.random.default_rng(100 + B)
    lengths = {s: int(n) for s, n in enumerate(rng.integers(1, 4096, B))}
    lengths[0] = 4096
    state = AO.random_state("ds_fp8", lengths, R=B, max_context=4096, seed=B)
    slot, pos = decode_batch(rng, lengths, 512, pads=1)
    H = 64
    sink = rng.normal(0, 1, H).astype(np.float32)
    q = queries(rng, len(slot), H)
    check(state, LAYER["csa"], q, slot, pos, sink, picks(rng, pos, 512), kernel=kernel)
    check(state, LAYER["hca"], q, slot, pos, sink, kernel=kernel)


@pytest.mark.slow(reason="4.3 GB at its peak on the reference; the smaller chunks stay")
@every_impl
def test_prefill_4k_chunk():
    """A 4,096-token first chunk of one request on an HCA layer (32 entries by
    its end) and a CSA layer with k = 64."""
    rng = np.random.default_rng(8)
    n = 4096
    state = AO.random_state("ds_fp8", {0: 0}, R=2, max_context=n, seed=7, capacity={0: n})
    slot, pos = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    H = 2
    q, chunk = queries(rng, n, H), bf16(rng.standard_normal((n, 512)))
    sink = rng.normal(0, 1, H).astype(np.float32)
    check(state, 2, q, slot, pos, sink, None, chunk)
    check(state, 1, q, slot, pos, sink, picks(rng, pos, 64), chunk)


# ---- trace-time checks ------------------------------------------------------------------------
def test_argument_errors():
    state = AO.random_state("bf16", {0: 10}, seed=9)
    q = jnp.zeros((2, 4, 512), jnp.bfloat16)
    s, p, sink = jnp.int32([0, 0]), jnp.int32([9, 8]), jnp.zeros(4)
    with pytest.raises(ValueError, match="topk: a CSA layer needs"):
        D.attention(state, 1, q, s, p, sink=sink)
    with pytest.raises(ValueError, match="topk: only CSA"):
        D.attention(state, 2, q, s, p, sink=sink, topk=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="sink"):
        D.attention(state, 0, q, s, p, sink=jnp.zeros(3))
    with pytest.raises(ValueError, match="chunk_kv"):
        D.attention(state, 0, q, s, p, sink=sink, chunk_kv=jnp.zeros((3, 512), jnp.bfloat16))
    with pytest.raises(ValueError, match="q: expected dtype"):
        D.attention(state, 0, q.astype(jnp.float32), s, p, sink=sink)
    with pytest.raises(ValueError, match="kind"):
        D.attention(state, jnp.int32(0), q, s, p, sink=sink)
    with pytest.raises(ValueError, match="kind"):
        D.attention(state, 0, q, s, p, sink=sink, kind="hca")
    with pytest.raises(ValueError, match="kernel: expected one of"):
        D.attention(state, 0, q, s, p, sink=sink, kernel="wgmma")


# ---- implementations against each other -------------------------------------------------------
def _available():
    impls = [("reference", jax.devices("cpu")[0])]
    from dsv4_jax import _ffi
    if _ffi.has_target("cpu", "dsv4_attention"):
        impls.append(("cpu", jax.devices("cpu")[0]))
    try:
        if jax.devices("cuda") and _ffi.has_target("cuda", "dsv4_attention"):
            impls.append(("cuda", jax.devices("cuda")[0]))
    except RuntimeError:
        pass
    return impls


_CHUNK_SLOW = pytest.mark.slow(
    reason="a window or HCA prefill chunk; the CSA chunk (window and picks) stays")


@pytest.mark.parametrize("kind,mode", [
    pytest.param(kind, mode, marks=_CHUNK_SLOW if mode == "chunk" and kind != "csa" else ())
    for mode in ("decode", "chunk") for kind in ("swa", "csa", "hca")])
def test_implementations_agree(kind, mode):
    _agree(kind, mode)


@pytest.mark.parametrize("mode", ["decode", "chunk"])
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
@CUDA_MARKS
def test_cuda_agrees_with_cpu_handler_and_reference(kind, mode):
    _agree(kind, mode)


def _agree(kind, mode):
    """Every implementation available here on one input: pairwise within
    2^-5 * M (each is within 2^-6 * M of exact); the reference and the CPU
    handler share every rounding point and differ only in fp32 summation
    order, so almost all their outputs are the same bf16 value."""
    rng = np.random.default_rng(21)
    fmt = "ds_fp8"
    if mode == "decode":
        lengths = {0: 3, 1: 129, 2: 640, 3: 1000}
        state = AO.random_state(fmt, lengths, seed=11)
        slot, pos = decode_batch(rng, lengths, 32)
        chunk = None
    else:
        before, sizes = {0: 60, 2: 500}, {0: 100, 2: 40}
        state = AO.random_state(fmt, before, seed=12,
                                capacity={s: before[s] + sizes[s] for s in before})
        slot, pos = chunk_rows(rng, before, sizes, interleave=True)
        chunk = bf16(rng.standard_normal((len(slot), 512)))
    H = 16
    q = queries(rng, len(slot), H)
    sink = rng.normal(0, 1, H).astype(np.float32)
    topk = picks(rng, pos, 32) if kind == "csa" else None
    _, _, M, _ = AO.attention(state, LAYER[kind], q, slot, pos, sink, topk, chunk, INV_FREQ)
    outs = {}
    for impl, dev in _available():
        put = lambda x: None if x is None else jax.device_put(x, dev)
        fn = lambda st, q_, s_, p_, sk, tk, ck, fr: D.attention(
            st, LAYER[kind], q_, s_, p_, sink=sk, topk=tk, chunk_kv=ck, rope_inv_freq=fr,
            impl=impl, return_state=False)
        # under jit the default backend decides the platform (a GPU's where one
        # exists), so the CPU handler runs eagerly on host arrays; the reference
        # is jnp alone, jitted on host arrays it runs on the host, and as one
        # program it compiles in a tenth of the time its ops take one by one
        out, lse = (fn if impl == "cpu" else jax.jit(fn))(jax.device_put(state, dev), *map(
            put, (q, slot, pos, sink, topk, chunk, INV_FREQ)))
        outs[impl] = (np.asarray(out, np.float32), np.asarray(lse))
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diff = np.abs(outs[a][0] - outs[b][0])
            assert np.all(diff <= 2 * BOUND * M[:, None, None] + 1e-30), (a, b, diff.max())
            fin = np.isfinite(outs[a][1])
            np.testing.assert_array_equal(fin, np.isfinite(outs[b][1]))
            np.testing.assert_allclose(outs[a][1][fin], outs[b][1][fin], rtol=1e-5, atol=1e-5)
    if "cpu" in outs:
        same = outs["cpu"][0] == outs["reference"][0]
        assert same.mean() > 0.98, same.mean()


# ---- sharding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["reference", pytest.param("cpu", marks=requires_cpu_ffi)])
def test_sharded_equals_each_shard_alone(impl):
    """Under shard_map over 2 CPU devices each shard attends over its own
    requests and blocks (shard-local slots) exactly as an unsharded state of
    that shard does; errors land in the shard's own counters."""
    from jax.sharding import Mesh
    from dsv4_jax.sharding import shard_config, state_sharding
    from support.sharding import unshard
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(devices[:2]), ("data",))
    local = [AO.random_state("ds_fp8", {0: 300, 1: 140}, R=2, max_context=512, seed=30),
             AO.random_state("ds_fp8", {1: 520 - 8}, R=2, max_context=512, seed=31)]
    cfg = shard_config(D.CacheConfig.tiny(max_requests=4, max_context=512), mesh, "data")
    specs = jax.tree_util.tree_leaves(D.sharding.state_specs(cfg))
    leaves = [np.concatenate([np.asarray(a), np.asarray(b)], axis=0 if spec[0] == "data" else 1)
              for a, b, spec in zip(jax.tree_util.tree_leaves(local[0]),
                                    jax.tree_util.tree_leaves(local[1]), specs)]
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(D.init_state(cfg)), leaves)
    state = jax.device_put(state, state_sharding(cfg, mesh))
    rng = np.random.default_rng(32)
    slot = np.int32([0, 1, -1, 1, 5, 1])                  # 3 rows per shard, local slots
    pos = np.int32([299, 139, 0, 511, 3, 200])
    H = 4
    q, sink = queries(rng, 6, H), rng.normal(0, 1, H).astype(np.float32)
    topk = picks(rng, pos, 8)
    with jax.set_mesh(mesh):
        out, lse, st = jax.jit(lambda st, *a: D.attention(
            st, 1, *a[:3], sink=a[3], topk=a[4], rope_inv_freq=a[5], impl=impl))(
                state, *map(jnp.asarray, (q, slot, pos, sink, topk, INV_FREQ)))
    for k, (alone, got_state) in enumerate(zip(local, unshard(st, cfg))):
        rows = slice(3 * k, 3 * k + 3)
        want, want_lse, want_st = D.attention(
            alone, 1, *map(jnp.asarray, (q[rows], slot[rows], pos[rows])), sink=jnp.asarray(sink),
            topk=jnp.asarray(topk[rows]), rope_inv_freq=jnp.asarray(INV_FREQ), impl=impl)
        np.testing.assert_array_equal(np.asarray(out)[rows], np.asarray(want))
        np.testing.assert_array_equal(np.asarray(lse)[rows], np.asarray(want_lse))
        np.testing.assert_array_equal(np.asarray(got_state.errors), np.asarray(want_st.errors))


@every_impl
@pytest.mark.parametrize("mode", ["decode", "chunk"])
def test_bad_rows_act_as_padding(mode):
    """Rows with a bad slot or a bad position give what the same call with
    those rows as padding gives, bit for bit, for every other row (in a chunk
    too: such a row is no window row of anyone); a row with a non-finite q
    drops only its own query (its kv is still a chunk row others see, as
    append stores it). Each counts once."""
    rng = np.random.default_rng(40)
    before = {0: 200, 1: 0}
    state = AO.random_state("ds_fp8", before, seed=41, capacity={0: 260, 1: 60})
    slot, pos = chunk_rows(rng, before, {0: 60, 1: 50}, interleave=True)
    T, H = len(slot), 4
    q = queries(rng, T, H)
    chunk = bf16(rng.standard_normal((T, 512))) if mode == "chunk" else None
    sink = rng.normal(0, 1, H).astype(np.float32)
    topk = picks(rng, pos, 8)
    bad = rng.choice(np.flatnonzero(slot >= 0), 9, replace=False)
    bslot, bpos, bq = slot.copy(), pos.copy(), q.copy()
    bslot[bad[:3]] = [4, 99, -7]                        # BAD_SLOT
    bpos[bad[3:6]] = [-1, 1024, 2 ** 31 - 1]            # BAD_POSITION
    bq[bad[6:], 1, 5] = [np.nan, np.inf, -np.inf]       # NONFINITE
    pslot = slot.copy()
    pslot[bad[:6]] = -1
    f = jax.jit(lambda st, q_, s_, p_: D.attention(
        st, 1, q_, s_, p_, sink=jnp.asarray(sink), topk=jnp.asarray(topk),
        chunk_kv=None if chunk is None else jnp.asarray(chunk),
        rope_inv_freq=jnp.asarray(INV_FREQ)))
    out, lse, st = f(state, *map(jnp.asarray, (bq, bslot, bpos)))
    pout, plse, pst = f(state, *map(jnp.asarray, (q, pslot, pos)))
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    others = np.setdiff1d(np.arange(T), bad[6:])
    np.testing.assert_array_equal(out[others], np.asarray(pout, np.float32)[others])
    np.testing.assert_array_equal(lse[others], np.asarray(plse)[others])
    assert not out[bad].any() and np.all(lse[bad] == -np.inf)
    got, want = errs(st), errs(pst)
    for kind, n in ((EK.BAD_SLOT, 3), (EK.BAD_POSITION, 3), (EK.NONFINITE, 3)):
        assert got.pop(kind) == n
    # the padded call's stale window rows of the NaN queries, which the bad
    # call drops before reading (in decode mode the chunk's queries read a
    # ring the chunk is not in: their earlier positions' rows are stale; in
    # a chunk, rows below a first position that was a padded row's)
    first = None if chunk is None else {s: int(pos[pslot == s].min()) for s in (0, 1)}
    nan_rows = stale_counts(state, slot[bad[6:]], pos[bad[6:]], first)
    assert nan_rows > 0 or mode == "chunk"
    if nan_rows:
        want[EK.STALE_WINDOW] -= nan_rows
    assert got == {k: v for k, v in want.items() if v}
