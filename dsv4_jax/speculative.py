"""Speculative steps (docs/design/speculative.md): verify a request's next token and
its drafts as one prefill chunk, then keep a prefix of them, leaving the
cache byte for byte what a cache fed only the kept tokens holds.

    meta = manager.prepare_step({r: 1 + k, ...}, speculative=True)   # blocks for every position
    state = apply_step(state, meta)
    spec = verify_begin(state, meta, drafts=k)              # copy what verify may change
    for layer in layers:                                    # a prefill chunk, never appended
        state = verify_layer(state, layer, spec, comp_kv, comp_score, params, index_kv=...,
                             index_score=...)
        idx, state = indexer_topk(state, layer, spec.verified.token_slot, ...,
                                  rows_per_request=min(1 + k, 8))   # a key tile read once a request
        out, lse, state = attention(state, layer, q, spec.verified.token_slot, ...,
                                    topk=idx, chunk_kv=kv)
    accepted = accepted_counts(spec, draft_ok)              # i32[R] on the device
    state, kept = verify_commit(state, spec, accepted)      # copy back; kept rows' metadata
    for layer in layers:
        state = write_layer(state, layer, kept, kv, comp_kv, comp_score, params, ...)
    manager.commit_speculative(manager.accepted_of(accepted))   # host, before the next step

`verify_layer` is `flush` of the verified rows (each slot's first 1 + k
rows) with its counts thrown away; the ring is never written during
verification, so nothing a rejected draft did survives in it. What the
flushes can change — every compressed layer's accumulators of the step's
slots and the pool entries of the windows their rows close, which lie in at
most two blocks a slot — `verify_begin` copies out with one `take_rows` and
`verify_commit` copies back with one `put_rows` (with the block-table rows
that drop the blocks holding no kept token); `write_layer` of the kept rows
then writes exactly what a step of those rows alone writes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import config as C
from .error_detail import ErrorOp, records_detail
from .errors import ErrorKind, add_counts
from .meta import StepMeta
from .ops import copy_rows
from .ops.dispatch import check_array
from .ops.shards import per_shard
from .ops.flush import flush
from .ops.write_layer import compressor_operands_given
from .params import CompressorParams
from .state import CacheState, check_state

__all__ = ["VerifyStep", "verify_begin", "verify_layer", "verify_commit", "accepted_counts",
           "MAX_DRAFTS"]

# A slot's verified rows span at most two blocks (1 + drafts <= 128
# positions), so two block copies a slot hold every entry they can close.
MAX_DRAFTS = C.BLOCK_TOKENS - 1
BLOCKS_PER_SLOT = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyStep:
    """What `verify_begin` hands to `verify_layer` and `verify_commit`.

    meta      the step's StepMeta, as given to verify_begin
    verified  the same step with only the verified rows (each slot's first
              1 + drafts rows; every other row padding, slot -1): the
              metadata of the verify pass's writes and reads
    ids       i32[S * M]: per shard, the slots copied (U = min(R, T) of
              them, in increasing order, -1 padded), then two blocks a slot
              (-1 where none), then 0 .. P-1 (the packed metadata's words,
              copied with them), M = 3U + P
    rows      the copies: the accumulators of the copied slots (csa.comp,
              csa.icomp, hca.comp), then the copied blocks' rows of every
              pool leaf, each with a leading shard axis
    drafts    the most drafts a request has in the step (static)"""
    meta: StepMeta
    verified: StepMeta
    ids: jax.Array
    rows: tuple
    drafts: int = dataclasses.field(metadata=dict(static=True))


# ---- rows and slots (one shard's arrays) -------------------------------------------------
def _runs(token_slot, token_pos, R: int):
    """(rank i32[T]: a row's place among its slot's rows in row order, -1 for
    rows without a slot in [0, R); count i32[R]: rows of each slot; first
    i32[R]: position of each slot's first row, 0 where it has none)."""
    T = token_slot.shape[0]
    ok = (token_slot >= 0) & (token_slot < R)
    key = jnp.where(ok, token_slot, R)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    i = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    run_start = jax.lax.cummax(jnp.where(starts, i, 0))
    rank = jnp.zeros((T,), jnp.int32).at[order].set(i - run_start)
    count = jnp.zeros((R + 1,), jnp.int32).at[key].add(1)[:R]
    first_row = jnp.full((R + 1,), T, jnp.int32).at[key].min(i)[:R]
    first = jnp.where(count > 0, token_pos[jnp.clip(first_row, 0, max(T - 1, 0))], 0)
    return jnp.where(ok, rank, -1), count, first


def _covered(count, U: int):
    """i32[U]: the slots with rows, ascending, then -1."""
    R = count.shape[0]
    present = count > 0
    place = jnp.where(present, jnp.cumsum(present.astype(jnp.int32)) - 1, U)
    return jnp.full((U,), -1, jnp.int32).at[place].set(jnp.arange(R, dtype=jnp.int32),
                                                       mode="drop")


def _blocks(cfg, block_table, slots, count, first, drafts: int):
    """i32[2U]: per copied slot the blocks of the first and the last position
    its verified rows gate (flush's [f, L], docs/design/semantics.md), -1 where there
    is none, the second -1 where it is the first's; ids outside [0, N) -1."""
    N, MB = cfg.num_blocks, cfg.max_blocks_per_request
    s = jnp.clip(slots, 0, cfg.max_requests - 1)
    n = jnp.minimum(count[s], 1 + drafts)
    f = jnp.maximum(first[s], 0)
    last = jnp.minimum(first[s] + n - 1, cfg.max_context - 1)
    gated = (slots >= 0) & (n > 0) & (f <= last)

    def block(pos):
        b = block_table[s, jnp.clip(pos // C.BLOCK_TOKENS, 0, MB - 1)]
        return jnp.where(gated & (b >= 0) & (b < N), b, -1)
    b0, b1 = block(f), block(last)
    b1 = jnp.where(b1 == b0, -1, b1)
    return jnp.concatenate([b0, b1])


# ---- what is copied ---------------------------------------------------------------------------
def _slot_leaves(st: CacheState):
    """Per-slot leaves verify writes (slot on axis 1): the accumulators."""
    return [st.csa.comp, st.csa.icomp, st.hca.comp]


def _block_leaves(st: CacheState):
    """Per-block leaves verify writes (block on axis 1): entries and keys."""
    return (jax.tree_util.tree_leaves(st.csa.kv) + jax.tree_util.tree_leaves(st.csa.index)
            + jax.tree_util.tree_leaves(st.hca.kv))


def _with_leaves(st: CacheState, slot, table, block) -> CacheState:
    comp, icomp, hcomp = slot
    n_csa = len(jax.tree_util.tree_leaves(st.csa.kv))
    n_idx = len(jax.tree_util.tree_leaves(st.csa.index))
    unflat = lambda tree, leaves: jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(tree), leaves)
    csa = dataclasses.replace(st.csa, comp=comp, icomp=icomp, kv=unflat(st.csa.kv, block[:n_csa]),
                              index=unflat(st.csa.index, block[n_csa:n_csa + n_idx]))
    hca = dataclasses.replace(st.hca, comp=hcomp, kv=unflat(st.hca.kv, block[n_csa + n_idx:]))
    return dataclasses.replace(st, block_table=table, csa=csa, hca=hca)


def _ids(cfg, meta: StepMeta):
    """(U, M): copied slots and the length of one shard's ids: U slots, 2U
    blocks, then every word of the packed metadata."""
    U = min(cfg.max_requests, meta.num_tokens)
    return U, (1 + BLOCKS_PER_SLOT) * U + meta.packed_size


# ---- per-shard bodies ---------------------------------------------------------------------------
def _begin_body(st: CacheState, meta: StepMeta, drafts: int, impl: str):
    cfg = st.config
    U, M = _ids(cfg, meta)
    rank, count, first = _runs(meta.token_slot, meta.token_pos, cfg.max_requests)
    slots = _covered(count, U)
    words = jnp.arange(meta.packed_size, dtype=jnp.int32)
    ids = jnp.concatenate([slots, _blocks(cfg, st.block_table, slots, count, first, drafts),
                           words])
    slot_leaves, block_leaves = _slot_leaves(st), _block_leaves(st)
    leaves = slot_leaves + block_leaves + [meta.data]
    spans = ([(0, U)] * len(slot_leaves) + [(U, BLOCKS_PER_SLOT * U)] * len(block_leaves)
             + [((1 + BLOCKS_PER_SLOT) * U, meta.packed_size)])
    out = copy_rows.take_rows(leaves, [1] * (len(leaves) - 1) + [0], ids, spans=spans, impl=impl)
    # The verified metadata is read from the copy's output, so every write of
    # the verify pass comes after the copy in the program: without that data
    # path XLA would copy every pool the copy reads to keep the read safe.
    data = out[-1]
    verified = _with_span(data, 0, jnp.where((rank >= 0) & (rank <= drafts), meta.token_slot, -1))
    return ids, tuple(x[None] for x in out[:-1]), verified


def _with_span(data, start: int, values):
    """`data` with `values` at [start, start + len(values)), as a select: an
    update slice into an FFI call's result (as `data` is in verify_begin) is
    what XLA's GPU dynamic-slice fusion fails to compile."""
    n = data.shape[0]
    padded = jnp.pad(values, (start, n - start - values.shape[0]))
    at = jnp.arange(n)
    return jnp.where((at >= start) & (at < start + values.shape[0]), padded, data)


def _commit_body(st: CacheState, meta: StepMeta, ids, rows, accepted, drafts: int, impl: str):
    cfg = st.config
    R, MB = cfg.max_requests, cfg.max_blocks_per_request
    U, _ = _ids(cfg, meta)
    rank, count, first = _runs(meta.token_slot, meta.token_pos, R)
    has = count > 0
    verified = jnp.minimum(count, 1 + drafts)
    bad = has & ((accepted < 0) | (accepted > verified) | (count > 1 + drafts))
    keep = jnp.where(has & ~bad, accepted, 0)
    slot = meta.token_slot
    in_range = (slot >= 0) & (slot < R)
    s = jnp.clip(slot, 0, R - 1)
    kept_slot = jnp.where(in_range & (rank >= keep[s]), -1, slot)
    # blocks this step handed out that hold no kept token
    nb = meta.new_blocks
    nb_slot, nb_logical = nb[:, 0], nb[:, 1]
    nb_ok = (nb_slot >= 0) & (nb_slot < R) & (nb_logical >= 0) & (nb_logical < MB)
    ns = jnp.clip(nb_slot, 0, R - 1)
    drop = nb_ok & has[ns] & (nb_logical * C.BLOCK_TOKENS >= first[ns] + keep[ns])
    table = st.block_table.at[jnp.where(drop, nb_slot, R), nb_logical].set(-1, mode="drop")
    slots = ids[:U]
    table_rows = table[jnp.clip(slots, 0, R - 1)]
    errors = add_counts(st.errors, {ErrorKind.BAD_LENGTH: bad})          # row s: slot s
    slot_leaves, block_leaves = _slot_leaves(st), _block_leaves(st)
    leaves = slot_leaves + [st.block_table] + block_leaves
    spans = ([(0, U)] * (len(slot_leaves) + 1) + [(U, BLOCKS_PER_SLOT * U)] * len(block_leaves))
    taken = [x[0] for x in rows]
    flat = taken[:len(slot_leaves)] + [table_rows] + taken[len(slot_leaves):]
    axes = [1] * len(slot_leaves) + [0] + [1] * len(block_leaves)
    new = copy_rows.put_rows(leaves, axes, ids[:(1 + BLOCKS_PER_SLOT) * U], flat, spans=spans,
                             impl=impl)
    n = len(slot_leaves)
    st = _with_leaves(st, new[:n], new[n], new[n + 1:])
    st = dataclasses.replace(st, errors=errors)
    kept_nb = jnp.where(drop[:, None], -1, nb).reshape(-1)
    lengths = jnp.where(has, meta.lengths - count + keep, meta.lengths)
    data = meta.data
    T, start_len, start_nb = meta.num_tokens, 2 * meta.num_tokens, 2 * meta.num_tokens + R
    data = _with_span(_with_span(data, 0, kept_slot), start_len, lengths)
    data = _with_span(data, start_nb, kept_nb)
    return st, data


# ---- public functions -----------------------------------------------------------------------------
def _check_drafts(drafts) -> int:
    if not isinstance(drafts, (int, np.integer)) or isinstance(drafts, bool) \
            or not 0 <= drafts <= MAX_DRAFTS:
        raise ValueError(f"drafts: expected an int in [0, {MAX_DRAFTS}] (1 + drafts rows a "
                         f"request, within two blocks), got {drafts!r}")
    return int(drafts)


def _check_step(state: CacheState, spec) -> None:
    """Trace-time check that `spec` is a VerifyStep of this state's layout."""
    from .state import state_shapes
    if not isinstance(spec, VerifyStep):
        raise ValueError(f"spec: expected the VerifyStep of verify_begin, got "
                         f"{type(spec).__name__}")
    cfg = state.config
    spec.meta.check(cfg)
    local, S = cfg.local(), cfg.num_shards
    U, M = _ids(local, spec.meta)
    check_array("spec.ids", spec.ids, (S * M,), jnp.int32)
    shapes = state_shapes(local)
    want = ([(x, U) for x in _slot_leaves(shapes)]
            + [(x, BLOCKS_PER_SLOT * U) for x in _block_leaves(shapes)])
    if len(spec.rows) != len(want):
        raise ValueError(f"spec.rows: expected {len(want)} arrays, got {len(spec.rows)}")
    for k, (x, (w, n)) in enumerate(zip(spec.rows, want)):
        check_array(f"spec.rows[{k}]", x, (S, w.shape[0], n) + tuple(w.shape[2:]), w.dtype)


def verify_begin(state: CacheState, meta: StepMeta, *, drafts: int,
                 impl: str = "auto") -> VerifyStep:
    """Start the verify pass of a speculative step: copy out what the pass
    may change, after `apply_step(state, meta)`.

    meta     the step's StepMeta (each request's next token and its drafts:
             1 + k rows at consecutive positions, k <= drafts)
    drafts   a Python int in [0, 127]: the most drafts any request has; each
             slot's rows past its first 1 + drafts are not verified (and a
             slot with more rows keeps none, verify_commit)

    Copies, per slot with rows in the step, its accumulators of every
    compressed layer and the two blocks its verified rows can write in
    (every layer), in one `take_rows` call. Reads only; pass the state on
    unchanged. The returned `VerifyStep.verified` is the metadata of the
    verify pass's writes and reads."""
    check_state(state)
    cfg = state.config
    meta.check(cfg)
    drafts = _check_drafts(drafts)
    if cfg.sharded:
        ids, rows, data = per_shard(_begin_body, state, ("rows", "rows", "rows"),
                                    rows={"meta": meta}, drafts=drafts, impl=impl)
    else:
        ids, rows, data = _begin_body(state, meta, drafts, impl)
    # each slot has at most 1 + drafts verified rows: the CUDA flush of
    # verify_layer walks them as at decode (StepMeta.max_rows_per_slot)
    verified = dataclasses.replace(meta, data=data, max_rows_per_slot=1 + drafts)
    return VerifyStep(meta, verified, ids, tuple(rows), drafts)


def verify_layer(state: CacheState, layer, spec: VerifyStep, comp_kv: jax.Array | None = None,
                 comp_score: jax.Array | None = None, params: CompressorParams | None = None, *,
                 index_kv: jax.Array | None = None, index_score: jax.Array | None = None,
                 impl: str = "auto") -> CacheState:
    """The verify pass's write of one layer: `flush` of the verified rows
    (`spec.verified`), so the entries the drafts close exist for
    `indexer_topk` and `attention` of the later drafts, as in a prefill
    chunk. Nothing is appended: call `attention` with `chunk_kv` (the rows'
    window kv), which sees them as a chunk does. Counts nothing: the rows
    kept are counted when `write_layer` writes them after `verify_commit`.
    An SWA layer has nothing to flush (pass no compressor operands): the
    state comes back as it was. Operands as `write_layer`'s compressor
    part."""
    if not isinstance(spec, VerifyStep):
        raise ValueError(f"spec: expected the VerifyStep of verify_begin, got "
                         f"{type(spec).__name__}")
    if not compressor_operands_given(state.config, layer, comp_kv, comp_score, params, index_kv,
                                     index_score):
        return state
    # flush counts into a scratch row: the counts of rows later rejected must
    # leave no trace, and write_layer counts the kept ones when it writes them
    scratch = dataclasses.replace(state, errors=jnp.zeros_like(state.errors))
    out = flush(scratch, layer, spec.verified, comp_kv, comp_score, params, index_kv=index_kv,
                index_score=index_score, impl=impl)
    return dataclasses.replace(out, errors=state.errors)


def _slot_rows(args):
    """verify_commit's error rows: one a slot, no position."""
    local = args["state"].config.local().max_requests
    return jnp.arange(args["accepted"].shape[0], dtype=jnp.int32) % local, None


@records_detail(ErrorOp.VERIFY_COMMIT, _slot_rows, layer_arg=False, state_at=0)
def verify_commit(state: CacheState, spec: VerifyStep, accepted: jax.Array, *,
                  impl: str = "auto") -> tuple[CacheState, StepMeta]:
    """End the verify pass: copy back what `verify_begin` copied, so the
    cache is as `apply_step` left it, and return the metadata of the rows to
    keep, for `write_layer` on every layer.

    accepted  i32[R] (sharded: S * R, shard after shard, by local slot): the
              rows of each slot the cache keeps, its first `accepted[s]`
              verified rows (the step's first token and the drafts that
              passed: 1 + j when j drafts pass). Read for slots with rows in
              the step only.

    A count below 0 or above the slot's verified rows, or a slot with more
    than 1 + drafts rows, is BAD_LENGTH once per slot, which then keeps no
    row. The returned StepMeta has every other row of a slot as padding
    (slot -1), lengths of the kept rows, and the new-block rows of blocks
    holding no kept token as padding; those blocks' block-table entries
    become -1 here (their pool bytes are unspecified: apply_step scrubs a
    block when it hands it out again). Rows whose slot is outside [0, R)
    stay as they were, for write_layer to count. The state is donated."""
    check_state(state)
    cfg = state.config
    _check_step(state, spec)
    check_array("accepted", accepted, (cfg.max_requests,), jnp.int32)
    drafts = spec.drafts
    if cfg.sharded:
        state, data = per_shard(_commit_body, state, ("state", "rows"),
                                rows={"meta": spec.meta, "ids": spec.ids, "rows": spec.rows,
                                      "accepted": accepted}, drafts=drafts, impl=impl)
    else:
        state, data = _commit_body(state, spec.meta, spec.ids, spec.rows, accepted, drafts, impl)
    # kept rows: at most 1 + drafts a slot, as verified
    return state, dataclasses.replace(spec.meta, data=data, max_rows_per_slot=1 + drafts)


def accepted_counts(spec: VerifyStep, draft_ok: jax.Array) -> jax.Array:
    """`accepted` for `verify_commit`, on the device, from per-row draft
    matches: i32[R] by slot (sharded: S * R, shard after shard, by local
    slot), 0 for slots without verified rows.

    draft_ok  bool[T] (sharded: S * T) in the step's row order: whether the
              draft a row holds is the token the model chose after the row
              before it (in the usual verify, row j's token equals the one
              sampled from row j - 1's output). Read for verified rows that
              are not their slot's first; a slot's first row, the token
              sampled after the previous step, is always kept.

    A slot keeps its first row and every draft up to its first mismatch:
    1 + the number of leading matches among its drafts, at most its
    verified rows (`spec.verified`, 1 + drafts at most). Inside a jitted
    step; `CacheManager.accepted_of` turns the result into the request ids
    `commit_speculative` takes."""
    if not isinstance(spec, VerifyStep):
        raise ValueError(f"spec: expected the VerifyStep of verify_begin, got "
                         f"{type(spec).__name__}")
    meta = spec.verified
    T, R = meta.num_tokens, meta.num_requests
    S = meta.num_shards
    check_array("draft_ok", draft_ok, (S * T,), jnp.bool_)
    big = jnp.iinfo(jnp.int32).max

    def one_shard(slot, pos, ok):
        at = jnp.where((slot >= 0) & (slot < R), slot, R)      # R: a dropped row
        first = jnp.full((R + 1,), big, jnp.int32).at[at].min(pos)
        rank = pos - first[at]                                  # 0 for the slot's first row
        rows = jnp.zeros((R + 1,), jnp.int32).at[at].add(1)
        miss = jnp.where((at < R) & (rank > 0) & ~ok, rank, big)
        first_miss = jnp.full((R + 1,), big, jnp.int32).at[at].min(miss)
        return jnp.minimum(rows, first_miss)[:R]

    out = jax.vmap(one_shard)(meta.token_slot.reshape(S, T), meta.token_pos.reshape(S, T),
                              draft_ok.reshape(S, T))
    return out.reshape(S * R)
