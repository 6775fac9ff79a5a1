"""dsv4_jax: the KV cache of DeepSeek-V4 hybrid attention for JAX.

State is a pytree of device buffers (`CacheState`); ops are functional and
update the buffers in place under `jax.jit(..., donate_argnames=...)`. A
decode step calls `apply_step` once, then per layer `write_layer` (`append`,
and on CSA and HCA layers `flush`, in one call), on CSA layers
`indexer_topk`, and `attention` (the window, the CSA picks or every visible
HCA entry, the sink); a step with prompt chunks reads before it appends,
and a speculative step verifies before it keeps (see "Step recipes"). A
model running its own attention reads with `gather_window`, `gather_topk`
(CSA) and `gather_all` (HCA) instead. docs/api.md is this package's
reference, generated from its docstrings by tools/gen_api.py; the constants
a caller sizes its operands with are on its "Constants" page.

Step recipes:

Every step is one jitted call with the state donated, `meta` from
`CacheManager.prepare_step` (fixed pad sizes, `manager.pad_sizes(n)`, keep
each recipe to one compile), and starts with `state = apply_step(state,
meta)`. Per layer (CSA/HCA: the compressor part; CSA: the indexer):

    decode (1 token a request)   prefill chunk (any rows)     speculative (1 + k a request)
    ---------------------------  ---------------------------  ---------------------------------
                                                              spec = verify_begin(state,
                                                                  meta, drafts=K)
    write_layer(meta, kv,        flush(meta, comp..)          verify_layer(spec, comp..)
        comp..)
    indexer_topk(slot, pos,..)   indexer_topk(slot, pos,..)   indexer_topk(v.slot, v.pos,..)
    attention(slot, pos, q,..)   attention(.., chunk_kv=kv)   attention(v.., chunk_kv=kv)
                                 append(meta, kv)
                                                              after the layers:
                                                              accepted = accepted_counts(
                                                                  spec, draft_ok)
                                                              state, kept = verify_commit(
                                                                  state, spec, accepted)
                                                              write_layer(kept, kv, comp..)
                                                                  on every layer
    host: prepare_step({r: 1})   host: prepare_step({r: n})   host: prepare_step({r: 1 + k},
                                                                  speculative=True); after:
                                                              commit_speculative(
                                                                  accepted_of(accepted))

(`slot, pos` = `meta.token_slot, meta.token_pos`; `v` = `spec.verified`.)
The decode recipe appends a token before its reads, so its window holds
the token itself. A step with more than one row of a request must read
first: appending a chunk overwrites ring rows its earlier queries still
need; attention then skips those rows and counts them
(`ErrorKind.STALE_WINDOW`), as it does for a gap or a rewind of a
request's positions. The chunk recipe serves decode rows too (a chunk of
one), so a step mixing prompt chunks and decode tokens takes it; a step
of decode tokens alone may take either; the decode recipe is the cheaper
one there (it reads no chunk rows: ~10 % less a step at B = 64 on an H200,
docs/perf/serving-engine.md). examples/serving_engine.py runs all three in a
continuous-batching engine, docs/design/speculative.md gives the speculative
step's contract.

Threading the state:

Every op returns the state. The writes (`apply_step`, `append`, `flush`,
`write_layer`) return it alone; the reads (`attention`, `gather_window`,
`gather_topk`, `gather_all`, `indexer_topk`) return `(*outputs, state)` by
default, the state's `errors` counting the rows they dropped. Pass that
state to the next op: the chain of states is what lets XLA run the whole
step in place. With `return_state=False` a read returns its outputs alone,
its counts are not kept, and XLA, with nothing ordering that read before the
next in-place write, may copy buffers to keep it safe.

The layer argument:

`layer` is the layer's global index in the model, `0 <= layer <
config.num_layers` (`config.layer_kinds[layer]` is its kind), never its
index among the layers of one kind: layer 2 of V4-Flash is its first CSA
layer. It is a Python int or a traced integer scalar (cast to int32), for a
model that runs its layers in `lax.scan` or `lax.fori_loop`. A Python int is
checked when the step is traced: `ValueError` if it is out of range or of a
kind the op does not take (`flush`: CSA or HCA; `gather_topk`,
`indexer_topk`: CSA; `gather_all`: HCA; `append`, `write_layer`,
`gather_window`, `attention`: any; a traced layer of `attention` needs its
`kind=`). A
traced layer cannot raise: when it is out of range or of the wrong kind at
run time the op counts `ErrorKind.BAD_LAYER` once in `state.errors`, writes
nothing, and reads back zero rows (gathers) or all -1 (`indexer_topk`);
`check_errors(state)` raises on the host afterwards. `flush` tells a traced
layer's kind from the width of `kv` (1024 CSA, 512 HCA).

Token rows:

Per-token operands (`kv` of `append`; `kv`, `score`, `index_kv`,
`index_score` of `flush`; the same of `write_layer`; `q`, `weights` of
`indexer_topk`; `indices` of `gather_topk`; `q`, `topk`, `chunk_kv` of
`attention`) have one row per token of the step, in the order of
`meta.token_slot` and `meta.token_pos`. `CacheManager.prepare_step({request:
n, ...})` groups the rows by request, in the order of the mapping, each
request's `n` new tokens at consecutive rows in increasing position;
`manager.token_rows(request)` is the `slice` of that request's rows. The
number of rows `T = meta.num_tokens` is the total padded up to a power of two
(at least `min_tokens`) so that a jitted step sees few shapes; padding rows
have slot -1 and every op ignores them, whatever their operand rows hold.
Sharded (`dsv4_jax.sharding`), every per-token operand has `S * T` rows,
shard after shard: rows `[k * T, (k + 1) * T)` are shard k's, with `T =
manager.tokens_per_shard`, and `ShardedCacheManager.token_rows(request)`
gives a request's rows in that axis. Per-request operands (`slots`,
`lengths` of `gather_window` and `gather_all`) likewise have `S * B` rows,
shard after shard, holding shard-local slots (`manager.slot_of(request)`).

From the reads to attention:

`attention(state, layer, q, meta.token_slot, meta.token_pos, sink=...,
topk=..., chunk_kv=..., rope_inv_freq=...)` does everything below in one
call, reading the entries straight from the pools (no dense copy);
docs/design/operations.md gives its rows, rounding points and error bound. By
hand, with the gathers:

DeepSeek-V4 attention has one 512-wide KV head that serves as key and value
(K = V) for every query head; the trailing 64 channels of every entry carry
RoPE at the entry's position. For the query of a token at position `t`
(`q: [H, 512]`, already roped), the keys are:

- its window: `kv, pos, state = gather_window(state, layer, slots)` gives
  `bf16[B, 128, 512]` and `i32[B, 128]` in ring order (not sorted); row j is
  a key iff `pos[j] >= 0` and `t - 128 < pos[j] <= t`. In decode, `append`
  the token first and gather after (`slots` can be `meta.token_slot`: one
  window per token row). In a prefill chunk, gather the window before
  `append` and attend over it and the chunk's own kv rows, causally.
- CSA layers: `idx, state = indexer_topk(state, layer, meta.token_slot,
  meta.token_pos, q_index, w_index, k)`, then `kv, valid, state =
  gather_topk(state, layer, meta.token_slot, meta.token_pos, idx)`:
  `bf16[T, k, 512]` and `bool[T, k]`; entry j is a key iff `valid[j]`
  (visibility, `i < (t + 1) // 4`, is already applied).
- HCA layers: `kv, count, state = gather_all(state, layer, slots, lengths,
  E)`: `bf16[B, E, 512]` and `i32[B]`; entry i is a key iff `i < count` and
  `i < (t + 1) // 128` (in decode, with `lengths` the lengths after the
  step, `count` alone).

Per head h, with every key's mask: `logits = q_h . key / sqrt(512)`
(masked keys -inf); `m = max(max(logits), sink[h])`; `p = exp(logits - m) /
(sum(exp(logits - m)) + exp(sink[h] - m))`; `out_h = sum_j p_j key_j`.
`sink` is the layer's learned attention sink, one logit per head with no
value (`layers.{i}.attn.attn_sink`, f32[H], in the official checkpoint).
Then rotate the trailing 64 channels of `out_h` back by the query's position
(inverse RoPE), as the official code does, since the values carry RoPE too.
examples/decode_loop.py calls `attention` in jitted prefill and decode
steps, and tests/test_example.py checks it against a dense float64
attention.

Batching with vmap:

Every op can be mapped with `jax.vmap`; the compiled handlers then run once
per element of the batch, in a loop (each element exactly the unbatched
call), and the jnp reference is vectorized by JAX as usual; both give the
same results. A batched state is a batch of separate caches: its writes
return a new batch, so mapping an op over a state that is not batched (a
batch of `kv` against one cache) returns a copy of the cache per element
rather than writing it in place. To run several requests through one cache,
put them in one step (`CacheManager.prepare_step`), not in a vmap.
"""
from . import _ffi  # registers the FFI targets of the compiled modules
from . import sharding
from . import multiprocess
from .config import CacheConfig
from .donation import NotDonatedWarning, check_donated
from .error_detail import ErrorOp
from .errors import CacheInputError, ErrorKind, check_errors, reset_errors
from .host.manager import CacheFullError, CacheManager
from .memory import memory_report
from .meta import StepMeta
from .ops.dispatch import default_impl
from .ops.append import append
from .ops.attention import attention
from .ops.apply_step import apply_step
from .ops.flush import flush
from .ops.gather import gather_all, gather_topk, gather_window
from .ops.indexer import indexer_topk
from .ops.write_layer import write_layer
from .params import CompressorParams, yarn_inv_freq
from .requests.moves import (OffloadedRequest, admit_on_prefix, export_request,
                             import_request, offload, preempt, resume, share_prefix)
from .requests.transfer import (read_blocks, read_request, request_ids, restore, snapshot,
                                write_blocks, write_request)
from .requests.types import RequestBlocks, RequestIds, RequestSnapshot
from .speculative import VerifyStep, accepted_counts, verify_begin, verify_commit, verify_layer
from .state import CacheState, HCAState, CSAState, IndexerKeys, KVEntries, WindowState, init_state

__all__ = [
    "CacheConfig", "CacheState", "KVEntries", "IndexerKeys", "WindowState", "CSAState",
    "HCAState", "init_state", "StepMeta", "CacheManager", "CacheFullError", "CacheInputError",
    "ErrorKind", "ErrorOp", "check_errors", "reset_errors", "check_donated", "NotDonatedWarning",
    "memory_report", "CompressorParams", "yarn_inv_freq",
    "default_impl", "apply_step", "append", "flush", "gather_window", "gather_topk", "gather_all",
    "indexer_topk", "write_layer", "attention",
    "RequestSnapshot", "RequestBlocks", "RequestIds", "request_ids", "snapshot", "restore",
    "read_blocks", "write_blocks", "read_request", "write_request",
    "OffloadedRequest", "share_prefix", "admit_on_prefix", "offload", "preempt", "resume",
    "export_request", "import_request",
    "VerifyStep", "verify_begin", "verify_layer", "verify_commit", "accepted_counts",
]
__version__ = "0.1.0"
