"""The sizes of DeepSeek-V4's attention block beyond the cache's: what the
query path and the output projection need. The cache's sizes (layer kinds,
entry width, window, indexer heads and top-k) stay in `dsv4_jax.CacheConfig`.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """The attention block's own sizes, named as Hugging Face's
    `DeepseekV4Config` names them.

    hidden_size   width of the block's input and output
    num_heads     query heads H (`num_attention_heads`)
    q_lora_rank   rank of the low-rank query (`q_a_proj` -> `q_b_proj`); its
                  normed value is also the indexer's input
    o_groups      groups of H / o_groups consecutive heads in the grouped
                  output projection
    o_lora_rank   each group's width after `o_a_proj`
    rope_theta    RoPE base of the sliding-only layers (plain, no YaRN); CSA
                  and HCA layers use the compressors' YaRN rope,
                  `dsv4_jax.yarn_inv_freq()`
    rms_norm_eps  every RMSNorm's epsilon
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "q_lora_rank", "o_groups", "o_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of o_groups "
                             f"({self.o_groups})")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")

    @classmethod
    def flash(cls) -> "BlockConfig":
        """DeepSeek-V4-Flash (with `CacheConfig.flash()`)."""
        return cls(hidden_size=4096, num_heads=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024)

    @classmethod
    def pro(cls) -> "BlockConfig":
        """DeepSeek-V4-Pro (with `CacheConfig.pro()`)."""
        return cls(hidden_size=7168, num_heads=128, q_lora_rank=1536, o_groups=16,
                   o_lora_rank=1024)

    @classmethod
    def from_hf(cls, hf: dict) -> "BlockConfig":
        """From a Hugging Face `config.json` of a DeepseekV4 checkpoint (a dict)."""
        rope = hf.get("rope_parameters") or {}
        theta = (rope.get("main") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
        return cls(hidden_size=int(hf["hidden_size"]), num_heads=int(hf["num_attention_heads"]),
                   q_lora_rank=int(hf["q_lora_rank"]), o_groups=int(hf["o_groups"]),
                   o_lora_rank=int(hf["o_lora_rank"]), rope_theta=float(theta),
                   rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
