"""DeepSeek-V4's attention block on the dsv4_jax cache: pure functions over
one layer's parameters (weights.py), every cache write, the indexer and the
attention through the library's public ops.

Per layer, for the step's token rows x f32[T, hidden] (the layer's input
after its RMSNorm) at positions meta.token_pos:

    qr  = q_a_norm(x @ q_a_proj.T)                     weighted RMSNorm
    q   = rope(rms(qr @ q_b_proj.T per head))          unweighted norm over 512
    kv  = rope(kv_norm(x @ kv_proj.T))                 the window row, bf16
    CSA/HCA: flush / write_layer of x @ compressor.{kv,gate}_proj.T (and
         the indexer's) with CompressorParams(position_bias, kv_norm, YaRN)
    CSA: indexer_topk of the indexer query rope(qr @ q_b_proj.T) times the
         Hadamard matrix, and weights weights_proj(x) * 64^-0.5 * 128^-0.5
    out = attention(q, sink=sinks, topk=picks, rope_inv_freq=the layer's)
    y   = o_b_proj(o_a_proj per group(out))            grouped output projection

RoPE is interleaved (GPT-J pairs) on the trailing 64 channels: plain theta
10000 on sliding-only layers, the compressors' YaRN frequencies on CSA and
HCA layers. A prefill chunk flushes first, attends with its own rows
(`chunk_kv`) and appends after; a decode step writes (write_layer) and then
attends over the ring. Arithmetic is float32 up to the library's inputs:
q and the window row are rounded to bf16 where the ops take them.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj

from .config import BlockConfig

F32 = jnp.float32
# float32 products as float32 (not TF32 or bf16 passes on a GPU): the block
# is held to Hugging Face's float32 within bf16 rounding
HIGHEST = jax.lax.Precision.HIGHEST
HEAD_DIM, ROPE_DIM, INDEX_HEADS, INDEX_DIM = 512, 64, 64, 128


# ---- pieces ---------------------------------------------------------------------------------
def linear(x, weight):
    """x @ weight.T, weight [out, in] as checkpoints store it."""
    return jnp.matmul(x, weight.T, precision=HIGHEST)


def rms_norm(x, weight=None, eps=1e-6):
    """x * rsqrt(mean(x^2) + eps) over the last axis, times `weight` if given."""
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def main_inv_freq(block: BlockConfig) -> np.ndarray:
    """Plain RoPE frequencies theta^(-2k/64) of the sliding-only layers, f32[32]."""
    return (1.0 / block.rope_theta ** (np.arange(0, ROPE_DIM, 2, dtype=np.float64) / ROPE_DIM)
            ).astype(np.float32)


def inv_freq_of(kind: str, block: BlockConfig) -> jax.Array:
    """The layer's RoPE frequencies: plain on SWA layers, the compressors' YaRN
    rope on CSA and HCA layers (what Hugging Face calls "main" and "compress")."""
    return jnp.asarray(main_inv_freq(block) if kind == "swa" else dj.yarn_inv_freq())


def rope(x, pos, inv_freq, inverse=False):
    """Interleaved RoPE on the trailing 64 channels of x [T, ..., D] at
    positions pos i32[T], in float32; `inverse` rotates back."""
    ang = pos.astype(F32).reshape((-1,) + (1,) * (x.ndim - 2) + (1,)) * inv_freq
    c, s = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        s = -s
    pairs = x[..., -ROPE_DIM:].reshape(x.shape[:-1] + (ROPE_DIM // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    r = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape[:-1] + (ROPE_DIM,))
    return jnp.concatenate([x[..., :-ROPE_DIM], r], axis=-1)


@functools.lru_cache(maxsize=None)
def hadamard(n: int = INDEX_DIM) -> np.ndarray:
    """The normalized n x n Sylvester Hadamard matrix (symmetric, orthogonal)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


def query(w, x, pos, inv_freq, block: BlockConfig):
    """(qr f32[T, q_lora], q f32[T, H, 512]): the low-rank query, normed,
    then per head the unweighted RMSNorm and RoPE."""
    eps = block.rms_norm_eps
    qr = rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_norm.weight"], eps)
    q = linear(qr, w["q_b_proj.weight"]).reshape(x.shape[0], block.num_heads, HEAD_DIM)
    return qr, rope(rms_norm(q, None, eps), pos, inv_freq)


def window_kv(w, x, pos, inv_freq, block: BlockConfig):
    """The window row of each token, bf16[T, 512]: normed, roped."""
    kv = rms_norm(linear(x, w["kv_proj.weight"]), w["kv_norm.weight"], block.rms_norm_eps)
    return rope(kv, pos, inv_freq).astype(jnp.bfloat16)


def compressor_params(w, kind: str):
    """The layer's `CompressorParams` (CSA: with its indexer's)."""
    inv = jnp.asarray(dj.yarn_inv_freq())
    index = None
    if kind == "csa":
        index = dj.CompressorParams(w["compressor.indexer.position_bias"],
                                    w["compressor.indexer.kv_norm.weight"], inv)
    return dj.CompressorParams(w["compressor.position_bias"], w["compressor.kv_norm.weight"],
                               inv, index)


def compressor_inputs(w, x, kind: str) -> dict:
    """flush's projections of the step's rows: kv, score (and on CSA layers
    index_kv, index_score), float32."""
    out = dict(kv=linear(x, w["compressor.kv_proj.weight"]),
               score=linear(x, w["compressor.gate_proj.weight"]))
    if kind == "csa":
        out.update(index_kv=linear(x, w["compressor.indexer.kv_proj.weight"]),
                   index_score=linear(x, w["compressor.indexer.gate_proj.weight"]))
    return out


def indexer_query(w, x, qr, pos):
    """(q bf16[T, 64, 128], weights f32[T, 64]) for `indexer_topk`: the
    indexer's query roped with the compress rope and rotated by the
    Hadamard matrix (the keys are stored rotated; q . k is unchanged), and
    the head weights with both of the score's scales folded in."""
    T = x.shape[0]
    q = linear(qr, w["compressor.indexer.q_b_proj.weight"]).reshape(T, INDEX_HEADS, INDEX_DIM)
    q = jnp.matmul(rope(q, pos, jnp.asarray(dj.yarn_inv_freq())), jnp.asarray(hadamard()),
                   precision=HIGHEST)
    weights = linear(x, w["compressor.indexer.scorer.weights_proj.weight"]) \
        * (INDEX_HEADS ** -0.5 * INDEX_DIM ** -0.5)
    return q.astype(jnp.bfloat16), weights


def output_projection(w, out, block: BlockConfig):
    """The grouped output projection of out [T, H, 512] -> [T, hidden]:
    each group of H/g consecutive heads through its own slice of o_a_proj,
    then o_b_proj over the concatenated groups."""
    T, g = out.shape[0], block.o_groups
    grouped = out.reshape(T, g, -1)                                       # [T, g, H*512/g]
    wa = w["o_a_proj.weight"].reshape(g, block.o_lora_rank, -1)           # [g, r, H*512/g]
    mid = jnp.einsum("tgc,grc->tgr", grouped, wa, precision=HIGHEST)
    mid = mid.reshape(T, g * block.o_lora_rank)
    return linear(mid, w["o_b_proj.weight"])


# ---- one layer ------------------------------------------------------------------------------
def attention_layer(state, layer: int, meta, x, w, block: BlockConfig, *, prefill: bool,
                    picks=None, impl: str = "auto"):
    """One attention layer on the cache: (state, y f32[T, hidden],
    out bf16[T, H, 512], picks i32[T, k] or None). Call it inside the
    model's jitted step, after `apply_step`, threading the state.

    layer     global layer index (a Python int: its kind picks the path)
    meta      the step's StepMeta (token rows in its order)
    x         f32[T, hidden], the layer's input rows (after its RMSNorm)
    w         the layer's weights: weights.py's dict (HF names), as arrays
    prefill   True for a prompt chunk (flush, attend with the chunk's own
              rows, append), False for a decode step (write_layer, attend)
    picks     CSA layers: the top-k entries to attend (i32[T, k], -1 = none)
              instead of the library's indexer's (a test feeding another
              implementation's picks); None runs indexer_topk"""
    kind = state.config.layer_kinds[layer]
    pos = meta.token_pos
    inv = inv_freq_of(kind, block)
    qr, q = query(w, x, pos, inv, block)
    kv = window_kv(w, x, pos, inv, block)
    comp = compressor_inputs(w, x, kind) if kind != "swa" else {}
    params = compressor_params(w, kind) if kind != "swa" else None
    if prefill:
        if kind != "swa":
            state = dj.flush(state, layer, meta, comp["kv"], comp["score"], params,
                             index_kv=comp.get("index_kv"), index_score=comp.get("index_score"),
                             impl=impl)
    else:
        state = dj.write_layer(state, layer, meta, kv, comp.get("kv"), comp.get("score"), params,
                               index_kv=comp.get("index_kv"), index_score=comp.get("index_score"),
                               impl=impl)
    if kind == "csa" and picks is None:
        iq, iw = indexer_query(w, x, qr, pos)
        picks, state = dj.indexer_topk(state, layer, meta.token_slot, pos, iq, iw,
                                       state.config.index_topk, impl=impl)
    out, _, state = dj.attention(state, layer, q.astype(jnp.bfloat16), meta.token_slot, pos,
                                 sink=w["sinks"], topk=picks if kind == "csa" else None,
                                 chunk_kv=kv if prefill else None, rope_inv_freq=inv, impl=impl)
    if prefill:
        state = dj.append(state, layer, meta, kv, impl=impl)
    y = output_projection(w, out.astype(F32), block)
    return state, y, out, picks if kind == "csa" else None


# ---- the layer stack ------------------------------------------------------------------------
def stack_step(state, meta, xs, weights, block: BlockConfig, *, prefill: bool, picks=None,
               impl: str = "auto"):
    """Every layer of the cache's config over its own input rows xs
    f32[L, T, hidden] (a test or a demo holding each layer's input; a model
    calls `attention_layer` between its other sub-blocks instead):
    (state, y f32[L, T, hidden], out f32[L, T, H, 512], picks {CSA layer:
    i32[T, k]}). `picks` ({CSA layer: i32[T, k]}) replaces the indexer's."""
    state = dj.apply_step(state, meta, impl=impl)
    ys, outs, chosen = [], [], {}
    for layer in range(state.config.num_layers):
        given = None if picks is None else picks.get(layer)
        state, y, out, p = attention_layer(state, layer, meta, xs[layer], weights[layer], block,
                                           prefill=prefill, picks=given, impl=impl)
        ys.append(y)
        outs.append(out.astype(F32))
        if p is not None:
            chosen[layer] = p
    return state, jnp.stack(ys), jnp.stack(outs), chosen


@functools.lru_cache(maxsize=None)
def jitted_step(block: BlockConfig, *, prefill: bool, impl: str = "auto"):
    """`stack_step` under jax.jit with the state donated (the pools updated
    in place): call as step(state, meta, xs, weights, picks). One function
    per (block, prefill, impl), so its compiled programs are reused."""
    def step(state, meta, xs, weights, picks):
        return stack_step(state, meta, xs, weights, block, prefill=prefill, picks=picks,
                          impl=impl)
    return jax.jit(step, donate_argnums=0)
