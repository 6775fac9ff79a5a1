"""Learned parameters of a layer's compressors, passed to `flush`."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import config as C


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressorParams:
    """One compressor's parameters (docs/design/semantics.md).

    ape:      f32[m, coff*d]  position bias added to the score at pos mod m
    norm:     f32[d]          RMSNorm weight
    inv_freq: f32[32]         RoPE inverse frequencies (`yarn_inv_freq()`)
    index:    the CSA indexer compressor's params (d = 128), None for HCA

    CSA layers: m = 4, coff = 2, d = 512, and `index` with m = 4, coff = 2,
    d = 128. HCA layers: m = 128, coff = 1, d = 512, `index` None.

    From the DeepSeek-V4 checkpoint:

    The official checkpoint (deepseek-ai/DeepSeek-V4-Flash and -Pro) names
    its tensors after the modules of DeepSeek-V4's inference code,
    inference/model.py: `Attention.compressor` (class `Compressor`: `ape`,
    `wkv`, `wgate`, `norm`) on CSA and HCA layers and `Attention.indexer`
    (class `Indexer`: `wq_b`, `weights_proj` and its own `compressor`) on CSA
    layers. For layer i (global index):

        checkpoint tensor                                dsv4_jax
        layers.{i}.attn.compressor.ape                   params.ape
        layers.{i}.attn.compressor.norm.weight           params.norm
        layers.{i}.attn.compressor.wkv.weight    W       flush(kv = x @ W.T)
        layers.{i}.attn.compressor.wgate.weight  W       flush(score = x @ W.T)
        layers.{i}.attn.indexer.compressor.ape           params.index.ape
        layers.{i}.attn.indexer.compressor.norm.weight   params.index.norm
        layers.{i}.attn.indexer.compressor.wkv.weight    flush(index_kv = x @ W.T)
        layers.{i}.attn.indexer.compressor.wgate.weight  flush(index_score = x @ W.T)
        (not stored)                                     inv_freq = yarn_inv_freq()

    Hugging Face transformers (models/deepseek_v4/modeling_deepseek_v4.py,
    `DeepseekV4CSACompressor`, `DeepseekV4HCACompressor`, `DeepseekV4Indexer`)
    loads the same tensors as
    `model.layers.{i}.self_attn.compressor.{position_bias, kv_norm.weight,
    kv_proj.weight, gate_proj.weight}`, the indexer's under
    `model.layers.{i}.self_attn.compressor.indexer.`. Cast `ape` and `norm`
    to float32. `x` is the input of the layer's attention (what the official
    `Attention.forward` receives), in float32, as `Compressor.forward` does.
    The projections go to `flush` as they come: the first d channels (the
    half the official code names "overlapping") are folded into the next
    window's entry, the last d into the token's own window's entry.
    `yarn_inv_freq()` is the compressors' RoPE of the official config
    (compress_rope_theta 160000, YaRN factor 16 over 65536 tokens, beta
    32 / 1), the same for both compressors of a layer.

    The rest of the layer feeds the other ops: `indexer_topk` takes
    `q = wq_b(qr)` (qr, the attention's `q_norm(wq_a(x))`; `wq_b` is
    `layers.{i}.attn.indexer.wq_b.weight`) after RoPE on its last 64 channels
    and the Hadamard rotation, and `weights =
    layers.{i}.attn.indexer.weights_proj(x) * 128**-0.5 * 64**-0.5`; `append`
    takes the window's kv, `layers.{i}.attn.wkv` then `kv_norm` then RoPE;
    the attention adds the sink `layers.{i}.attn.attn_sink` (see "From the
    reads to attention").
    """
    ape: jax.Array
    norm: jax.Array
    inv_freq: jax.Array
    index: Optional["CompressorParams"] = None

    @classmethod
    def neutral(cls, kind: str) -> "CompressorParams":
        """Parameters that change nothing but the RoPE: no position bias, unit
        norm weight, the official frequencies (`kind` "csa" or "hca"). For
        demos and tests; a model passes its learned weights."""
        if kind not in (C.CSA, C.HCA):
            raise ValueError(f"kind: expected 'csa' or 'hca', got {kind!r}")
        freq = jnp.asarray(yarn_inv_freq())

        def one(m, coff, d, index=None):
            return cls(jnp.zeros((m, coff * d), jnp.float32), jnp.ones((d,), jnp.float32),
                       freq, index)
        if kind == C.HCA:
            return one(C.HCA_RATIO, 1, C.HEAD_DIM)
        return one(C.CSA_RATIO, 2, C.HEAD_DIM, one(C.CSA_RATIO, 2, C.INDEX_DIM))


def yarn_inv_freq(rope_dim: int = C.ROPE_DIM, theta: float = C.ROPE_THETA,
                  factor: float = C.ROPE_YARN_FACTOR,
                  original_length: int = C.ROPE_ORIGINAL_LENGTH,
                  beta_fast: float = C.ROPE_BETA_FAST,
                  beta_slow: float = C.ROPE_BETA_SLOW) -> np.ndarray:
    """The official compressor RoPE inverse frequencies, f32[rope_dim // 2].

    YaRN as in the DeepSeek-V3/V4 inference code (`precompute_freqs_cis`): the
    base frequencies theta^(-2k/rope_dim) are blended with the same divided by
    `factor`, through a linear ramp over the pair index k between the
    correction dims of `beta_fast` and `beta_slow` rotations at
    `original_length`. Pairs below the ramp keep the base frequency
    (high frequencies, extrapolated); pairs above it are interpolated
    (divided by `factor`).

    The powers theta^(2k/rope_dim) are computed in float64 and rounded to
    float32 once (what a correctly rounded float32 pow gives); the reciprocal
    and the blend run in float32. This reproduces the Hugging Face
    DeepseekV4 frequencies bit for bit."""
    half = rope_dim // 2

    def correction_dim(rotations: float) -> float:
        # pair index whose wavelength fits `rotations` times in original_length
        return (rope_dim * math.log(original_length / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001   # avoid a zero-width ramp
    powers = (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
              ).astype(np.float32)
    base = np.float32(1) / powers
    ramp = np.clip((np.arange(half, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp   # weight of the unscaled frequency
    out = base / np.float32(factor) * (np.float32(1) - keep) + base * keep
    return out.astype(np.float32)
