"""Pure-jnp implementations of every cache op: the oracle the FFI kernels are
tested against and the portable path (any backend, under jit, donated).

The public ops (dsv4_jax.ops) check arguments and call these with:
  append(state, layer_idx, token_slot, token_pos, kv) -> state
  flush(state, kind, kind_idx, token_slot, token_pos, kv, score, params,
        index_kv, index_score) -> state            (kv/score already f32)
  gather_window(state, layer_idx, slots) -> (kv, pos, errors)
  gather_topk(state, kind_idx, token_slot, token_pos, indices) -> (kv, valid, errors)
  gather_all(state, kind_idx, slots, lengths, max_entries) -> (kv, count, errors)
  indexer_topk(state, kind_idx, token_slot, token_pos, q, weights, k) -> (indices, errors)
  attention(state, kind, layer_idx, kind_idx, q, token_slot, token_pos, sink,
            topk, chunk_kv, inv_freq) -> (out, lse, errors)
`layer_idx` / `kind_idx` are int32 scalars, -1 for a bad traced layer
(count BAD_LAYER once, change nothing else). Semantics and error rules are in
the docstrings of dsv4_jax/ops/*.py.
"""
from .apply_step import apply_step
from .attention import attention
from .compressor import flush
from .gather import gather_all, gather_topk
from .indexer import indexer_topk
from .window import append, gather_window

__all__ = ["apply_step", "append", "flush",
           "gather_window", "gather_topk", "gather_all", "indexer_topk", "attention"]
