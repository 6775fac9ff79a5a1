"""The lightning indexer's top-k over the MXFP4 keys of a CSA layer
(docs/design/semantics.md, docs/design/formats.md, docs/design/operations.md).

indexer_topk(state, layer, token_slot[T], token_pos[T], q bf16[T, 64, 128],
             weights f32[T, 64], k) -> (indices i32[T, k], state)

For query token t (slot s, position p) the candidates are the entries
i < (p + 1) // 4 of request s in that CSA layer (at most MB * 32, as p <
max_context), read through the block table (block_table[s, i // 32], row
i % 32). Each gets

    score_i = sum_h w[t, h] * relu(q[t, h] . key_i)

and the result lists the k best candidates by descending score, equal scores
by ascending index, then -1 where fewer than k exist. Every returned index
is visible and in an existing block, so it can be fed to gather_topk as is.

Rules per token, in this order, each counted once and leaving the row all
-1 (gather_topk's, plus one for the inputs): slot -1 -> nothing counted;
slot outside [0, R) -> BAD_SLOT; pos < 0 or >= max_context (= MB * 128, read
off block_table's shape) -> BAD_POSITION; a NaN or Inf anywhere in the
token's q or weights -> NONFINITE. Then a logical block the token needs
(j * 32 < visible count) whose table entry is outside [0, N) ->
MISSING_BLOCK once for that block, its 32 entries are not candidates. A bad
traced layer -> BAD_LAYER once, every row -1. The state comes back after the
indices, its `errors` updated; with `return_state=False` only the indices,
and the call's counts are not kept (the `errors` result is then a scratch
buffer, not aliased, so XLA copies nothing).

Arithmetic (identical in the jnp reference, the C++ handler and the CUDA
kernel, so the three return the same indices in the same order):
  key  k[c] = e2m1(code c) * 2^(scale byte - 127)       exact in fp32
  q    bf16 widened to fp32                             exact
  per head h and block b (channels 32b .. 32b+31):
       blk[b] = k[32b]*q[h,32b]; blk[b] = blk[b] + k[32b+j]*q[h,32b+j], j = 1..31
       (each product is exact: 2 significant bits times 8)
  d[h] = ((blk[0] + blk[1]) + blk[2]) + blk[3]
  r[h] = d[h] > 0 ? d[h] : 0                            (NaN -> 0)
  c[h] = w[h] * r[h]                                    (one fp32 rounding)
  score = c[0]; score = score + c[h], h = 1..63
All fp32, round to nearest even, no FMA contraction of c into the sum, no
flushing of subnormals (a backend that flushes them may differ on keys with
scale byte 0, which the quantizer never writes). For ranking, a NaN score
counts as -inf and -0 as +0.

q_format="mxfp4" (the default) first rounds every (head, 32-channel block)
of q to MXFP4 exactly as a key block is rounded (amax floor 6 * 2^-126,
scale = smallest power of two >= amax / 6, e2m1 codes, ties to even). That
is what DeepSeek-V4's official inference code does to the indexer query
after RoPE and the Hadamard rotation (Indexer.forward: "use fp4 simulation
for q and kv in indexer", fp4_act_quant(q, 32, inplace=True), whose kernel
floors amax at 6 * 2^-126 and rounds the scale up to a power of two), so
pass q as the model has it just before that call. The rounding is
idempotent in value: a q already on the MXFP4 grid (a model that ran the
simulation itself) gives the same indices. q_format="bf16" scores q as
given, for models that skip the simulation. For "mxfp4" (dsv4/indexer.h):
  S[b]  = sum_j q2[h, 32b+j] * k2[32b+j]   integers (twice each e2m1 value),
                                          exact in any order
  u[b]  = fl(S[b] * 2^(key scale byte - 127))
  d     = fl(u[0] * Q[0]); d = fl(d + fl(u[b] * Q[b])), b = 1..3,
          Q[b] = 2^(query scale byte - 129)
  c[h]  = w[h] * (d > 0 ? d : 0)
  score = balanced pairwise tree over c[0..63] in head order
The products u * Q are exact unless they leave the normal fp32 range (block
amaxes of q and k whose product is below ~2^-110, or scale bytes near 254);
one that overflows is +-inf before it is added: no implementation fuses the
product into the add (an FMA would keep it finite). The handlers compute most
scores in an equivalent form (dsv4/indexer.h, "fast form"): when a head's
four query scale bytes and a key's four lie within 3 of their minimum, the
chain above rounds nowhere, so one integer dot product over 128 channels of
codes shifted by their block's excess exponent, times powers of two, gives
the same bits; range guards send every other key and head to the per-block
form. On the GPU the dot products run on the int8 tensor cores.

FFI target "dsv4_indexer_topk" (the same operands on CPU and CUDA):
  args  layer i32[] (CSA index, -1 = bad), token_slot i32[T], token_pos i32[T],
        q bf16[T, 64, 128], weights f32[T, 64], block_table i32[R, MB],
        errors i32[9] (54 with detail), csa.index.packed u8[Lc, N, 32, 64],
        csa.index.scale e8m0[Lc, N, 32, 4]
  rets  indices i32[T, k], scratch u32[T, MB * 32] (per-entry rank keys; the
        handlers' working memory, discarded), qscratch u8[T, 17664] (for
        q_format 1, else u8[T, 0]: the CPU handler's rounded query; unused
        on CUDA, where each CTA rounds q into shared memory; discarded),
        errors (aliased when the state is returned)
  attrs q_format 0 ("bf16") or 1 ("mxfp4"), rows_per_request 1 .. 8 (the
        schedule hint below; validated by both handlers, used by CUDA's
        mxfp4 score kernel only)

rows_per_request (a speculative verify step's 1 + drafts): a static hint of
how the rows are laid out, never of what they mean. The CUDA mxfp4 score
kernel takes consecutive rows in groups of that many (the last may be
shorter); where a group's rows share a slot, one CTA reads and decodes each
key tile of that request once and scores every row of the group against it
(rows of other slots in a group are scored after them, their slot's tiles
read once more). Each row keeps its own visible count, its own bad-input
handling and counts, and the same score bits, so every value returns the same
indices and errors; the bf16 kernel, the CPU handler and the reference only
check it. 8 at most: the CUDA kernel holds that many rounded queries in
shared memory beside its key rings.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import config as C
from .. import reference
from ..error_detail import ErrorOp, query_rows, records_detail
from ..state import CacheState, check_state
from .dispatch import check_array, errors_alias, ffi_call, resolve_impl
from ._layer import layer_operand
from .shards import per_shard

_I32 = jnp.int32
MAX_K = 4096   # the CUDA kernel sorts the selection in shared memory
MAX_ROWS_PER_REQUEST = 8   # kMaxRowsPerRequest of dsv4/indexer_topk.h
Q_FORMATS = {"bf16": 0, "mxfp4": 1}      # the FFI attribute q_format
# per token (kQueryScratchBytes of dsv4/indexer.h): int8 codes [64, 128],
# f32 factors [4, 64], the shifted codes [64, 128] and f32 wq [64] of the fast form
QUERY_SCRATCH_BYTES = (2 * C.INDEX_HEADS * C.INDEX_DIM + 4 * C.INDEX_HEADS * C.INDEX_SCALES
                       + 4 * C.INDEX_HEADS)


@records_detail(ErrorOp.INDEXER_TOPK, query_rows, state_at=1)
def indexer_topk(state: CacheState, layer, token_slot: jax.Array, token_pos: jax.Array,
                 q: jax.Array, weights: jax.Array, k: int, *, q_format: str = "mxfp4",
                 rows_per_request: int = 1, impl: str = "auto", return_state: bool = True):
    """Top-k CSA entries per query token by indexer score: indices i32[T, k]
    (-1 padded), best first.

    layer                 global index of a CSA layer
    token_slot, token_pos i32[T], the query rows' slots and positions
                          (usually meta.token_slot, meta.token_pos)
    q                     bf16[T, 64, 128]: the indexer query (64 heads of 128)
                          as the model has it after RoPE and the Hadamard
                          rotation
    weights               f32 or bf16 [T, 64]: the per-head weights
    k                     a Python int in [1, 4096]
    q_format              "mxfp4" (default) rounds q to MXFP4 first, as
                          DeepSeek-V4's inference code does (exact block sums;
                          the fast path on the GPU); "bf16" scores q as given
    rows_per_request      a Python int in [1, 8], a schedule hint: runs of
                          this many consecutive rows (from row 0; the last
                          run may be shorter) that share a slot are scored
                          together, each key tile read and decoded once for
                          all of them. A verify step passes 1 + drafts (its
                          rows are each request's 1 + drafts rows in a row).
                          Any value returns the same indices and counts; a
                          value that does not match the layout only costs
                          time (1: a CTA a row, plain decode)
    returns               (indices, state): indices i32[T, k] of visible
                          entries (i < (t + 1) // 4) in existing blocks, best
                          first, equal scores by ascending index, -1 where
                          fewer exist: ready for gather_topk. With
                          return_state=False, indices alone.

    Entry i scores sum_h weights[h] * relu(q[h] . key_i) in one fixed fp32
    order (the module docstring gives it), so every implementation returns
    the same indices. A row with slot -1 is all -1, nothing counted. Counted:
    BAD_SLOT and BAD_POSITION (the row all -1), MISSING_BLOCK (once per
    missing block the row needs; its entries are not candidates), BAD_LAYER."""
    check_state(state)
    cfg = state.config
    check_array("token_slot", token_slot, (None,), _I32)
    T = token_slot.shape[0]
    check_array("token_pos", token_pos, (T,), _I32)
    check_array("q", q, (T, C.INDEX_HEADS, C.INDEX_DIM), jnp.bfloat16)
    check_array("weights", weights, (T, C.INDEX_HEADS), (jnp.float32, jnp.bfloat16))
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k: expected an int in [1, {MAX_K}], got {k!r}")
    if q_format not in Q_FORMATS:
        raise ValueError(f"q_format: expected one of {sorted(Q_FORMATS)}, got {q_format!r}")
    if (isinstance(rows_per_request, bool) or not isinstance(rows_per_request, int)
            or not 1 <= rows_per_request <= MAX_ROWS_PER_REQUEST):
        raise ValueError(f"rows_per_request: expected an int in [1, {MAX_ROWS_PER_REQUEST}], "
                         f"got {rows_per_request!r}")
    weights = weights.astype(jnp.float32)
    if cfg.sharded:
        outs = ("rows", "state") if return_state else "rows"
        return per_shard(indexer_topk, state, outs, layer=layer,
                         rows=dict(token_slot=token_slot, token_pos=token_pos, q=q,
                                   weights=weights),
                         k=k, q_format=q_format, rows_per_request=rows_per_request, impl=impl,
                         return_state=return_state)
    layer_idx = layer_operand(cfg, layer, C.CSA)
    target = "dsv4_indexer_topk"
    impl = resolve_impl(impl, target, [state.block_table])
    if impl == "reference":
        indices, errors = reference.indexer_topk(state, layer_idx, token_slot, token_pos, q,
                                                 weights, k, q_format=q_format)
    else:
        E = cfg.max_blocks_per_request * (C.BLOCK_TOKENS // C.CSA_RATIO)
        qbytes = QUERY_SCRATCH_BYTES if q_format == "mxfp4" else 0
        indices, _, _, errors = ffi_call(
            target, [layer_idx, token_slot, token_pos, q, weights, state.block_table,
                     state.errors, state.csa.index.packed, state.csa.index.scale],
            [jax.ShapeDtypeStruct((T, k), _I32),
             jax.ShapeDtypeStruct((T, E), jnp.uint32),
             jax.ShapeDtypeStruct((T, qbytes), jnp.uint8),
             jax.ShapeDtypeStruct(state.errors.shape, _I32)],
            errors_alias(target, return_state), q_format=Q_FORMATS[q_format],
            rows_per_request=rows_per_request)
    if not return_state:
        return indices
    return indices, dataclasses.replace(state, errors=errors)
