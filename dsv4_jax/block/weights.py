"""The attention block's parameters: one dict a layer, keyed by the tensor
names Hugging Face's DeepseekV4 checkpoints use under
`model.layers.{i}.self_attn.`, and read from safetensors files with the
`safetensors` package's numpy API (no torch).

    HF tensor (under model.layers.{i}.self_attn.)   shape                  layers
    q_a_proj.weight                                 [q_lora, hidden]       all
    q_a_norm.weight                                 [q_lora]               all
    q_b_proj.weight                                 [H * 512, q_lora]      all
    kv_proj.weight                                  [512, hidden]          all
    kv_norm.weight                                  [512]                  all
    o_a_proj.weight                                 [g * o_lora, H*512/g]  all
    o_b_proj.weight                                 [hidden, g * o_lora]   all
    sinks                                           [H]                    all
    compressor.kv_proj.weight                       [coff * 512, hidden]   CSA, HCA
    compressor.gate_proj.weight                     [coff * 512, hidden]   CSA, HCA
    compressor.position_bias                        [m, coff * 512]        CSA, HCA
    compressor.kv_norm.weight                       [512]                  CSA, HCA
    compressor.indexer.kv_proj.weight               [256, hidden]          CSA
    compressor.indexer.gate_proj.weight             [256, hidden]          CSA
    compressor.indexer.position_bias                [4, 256]               CSA
    compressor.indexer.kv_norm.weight               [128]                  CSA
    compressor.indexer.q_b_proj.weight              [64 * 128, q_lora]     CSA
    compressor.indexer.scorer.weights_proj.weight   [64, hidden]           CSA

(coff = 2, m = 4 on CSA layers; coff = 1, m = 128 on HCA layers; g = o_groups.)
DeepSeek's own checkpoint names the same tensors after its inference code
(`layers.{i}.attn.wq_a`, ..., `attn_sink`); `CompressorParams`' docstring
maps its compressor names. Every tensor is kept as float32; float32, float16
and bfloat16 files read as they are. FP8 block-quantized weights (an e4m3
`weight` with its `weight_scale_inv`, as DeepSeek's released checkpoints
store most projections) are not read: numpy has no FP8 type for safetensors
to hand back, so dequantize them to bf16 first.
"""
from __future__ import annotations

import ml_dtypes   # bfloat16 for numpy: safetensors' numpy API then reads BF16 tensors
import numpy as np

import dsv4_jax as dj

from .config import BlockConfig

HEAD_DIM, INDEX_HEADS, INDEX_DIM = 512, 64, 128
HF_PREFIX = "model.layers.{layer}.self_attn."


def layer_shapes(block: BlockConfig, kind: str) -> dict:
    """{HF name under self_attn.: shape} of one layer of `kind` ("swa", "csa", "hca")."""
    H, g = block.num_heads, block.o_groups
    shapes = {
        "q_a_proj.weight": (block.q_lora_rank, block.hidden_size),
        "q_a_norm.weight": (block.q_lora_rank,),
        "q_b_proj.weight": (H * HEAD_DIM, block.q_lora_rank),
        "kv_proj.weight": (HEAD_DIM, block.hidden_size),
        "kv_norm.weight": (HEAD_DIM,),
        "o_a_proj.weight": (g * block.o_lora_rank, H * HEAD_DIM // g),
        "o_b_proj.weight": (block.hidden_size, g * block.o_lora_rank),
        "sinks": (H,),
    }
    if kind in ("csa", "hca"):
        coff, m = (2, 4) if kind == "csa" else (1, 128)
        shapes.update({
            "compressor.kv_proj.weight": (coff * HEAD_DIM, block.hidden_size),
            "compressor.gate_proj.weight": (coff * HEAD_DIM, block.hidden_size),
            "compressor.position_bias": (m, coff * HEAD_DIM),
            "compressor.kv_norm.weight": (HEAD_DIM,),
        })
    if kind == "csa":
        shapes.update({
            "compressor.indexer.kv_proj.weight": (2 * INDEX_DIM, block.hidden_size),
            "compressor.indexer.gate_proj.weight": (2 * INDEX_DIM, block.hidden_size),
            "compressor.indexer.position_bias": (4, 2 * INDEX_DIM),
            "compressor.indexer.kv_norm.weight": (INDEX_DIM,),
            "compressor.indexer.q_b_proj.weight": (INDEX_HEADS * INDEX_DIM, block.q_lora_rank),
            "compressor.indexer.scorer.weights_proj.weight": (INDEX_HEADS, block.hidden_size),
        })
    return shapes


def from_tensors(tensors, cache: dj.CacheConfig, block: BlockConfig,
                 prefix: str = HF_PREFIX) -> list:
    """The block's parameters, a list of one dict a layer (HF names under
    `self_attn.` -> float32 numpy arrays), from a mapping of full tensor
    names to arrays. `prefix` is formatted with `layer=i`. Raises KeyError
    with the count of missing tensors and the first three, ValueError
    naming a tensor of the wrong shape or dtype; tensors of other modules
    (MLP, norms) are ignored."""
    layers, missing = [], []
    for i, kind in enumerate(cache.layer_kinds):
        head = prefix.format(layer=i)
        w = {}
        for name, shape in layer_shapes(block, kind).items():
            full = head + name
            if full not in tensors:
                missing.append(full)
                continue
            a = np.asarray(tensors[full])
            if a.dtype.kind != "f" and a.dtype != ml_dtypes.bfloat16:
                raise ValueError(f"{full}: expected a float tensor, got {a.dtype}")
            if a.shape != shape:
                raise ValueError(f"{full}: expected shape {list(shape)}, got {list(a.shape)}")
            w[name] = a.astype(np.float32)
        layers.append(w)
    if missing:
        raise KeyError(f"{len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    return layers


def load_safetensors(paths, cache: dj.CacheConfig, block: BlockConfig,
                     prefix: str = HF_PREFIX) -> list:
    """`from_tensors` over the tensors of one or more .safetensors files
    (a checkpoint's shards), read with `safetensors.numpy`: only the tensors
    the block needs are read."""
    try:
        from safetensors import safe_open
    except ImportError as e:   # an optional need: only this loader reads files
        raise ImportError("load_safetensors needs the safetensors package "
                          "(pip install safetensors)") from e
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    wanted = {prefix.format(layer=i) + name
              for i, kind in enumerate(cache.layer_kinds) for name in layer_shapes(block, kind)}
    tensors = {}
    for path in paths:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                if key not in wanted:
                    continue
                try:
                    tensors[key] = f.get_tensor(key)
                except (TypeError, AttributeError) as e:   # a dtype numpy lacks (FP8)
                    raise ValueError(f"{key} in {path}: safetensors' numpy API cannot read its "
                                     f"dtype ({e}); FP8 weights need dequantizing to bf16 "
                                     f"first") from None
    return from_tensors(tensors, cache, block, prefix)

