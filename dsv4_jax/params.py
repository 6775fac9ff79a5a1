"""Learned parameters of a layer's compressors, passed to `flush`."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import config as C


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressorParams:
    """One compressor's parameters (DESIGN §3).

    ape:      f32[m, coff*d]  position bias added to the score at pos mod m
    norm:     f32[d]          RMSNorm weight
    inv_freq: f32[32]         RoPE inverse frequencies (`yarn_inv_freq()`)
    index:    the CSA indexer compressor's params (d = 128), None for HCA
    """
    ape: jax.Array
    norm: jax.Array
    inv_freq: jax.Array
    index: Optional["CompressorParams"] = None


def yarn_inv_freq(rope_dim: int = C.ROPE_DIM, theta: float = C.ROPE_THETA,
                  factor: float = C.ROPE_YARN_FACTOR,
                  original_length: int = C.ROPE_ORIGINAL_LENGTH,
                  beta_fast: float = C.ROPE_BETA_FAST,
                  beta_slow: float = C.ROPE_BETA_SLOW) -> np.ndarray:
    """The official compressor RoPE inverse frequencies, f32[rope_dim // 2]."""
    raise NotImplementedError("yarn_inv_freq: implemented by the reference issue")
