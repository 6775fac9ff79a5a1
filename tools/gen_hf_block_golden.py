"""Writes the golden set of DeepSeek-V4's attention block from Hugging Face's
implementation: tests/data/hf_dsv4_block.safetensors (the attention weights,
named as a DeepseekV4ForCausalLM checkpoint names them) and
tests/data/hf_dsv4_block.npz (the run: inputs, HF's outputs, its indexer
picks, the queries and KV it attended).

A tiny random DeepseekV4Config (3 layers: sliding, CSA, HCA; 4 heads of the
real 512 channels, hidden size 32, the real indexer of 64 x 128 and top-k 16,
the real ropes) built by transformers' DeepseekV4ForCausalLM in float32,
eager attention. Each layer's `DeepseekV4Attention` runs on its own random
input rows (the decoder's hyper-connections and MoE are left out: the block
is what is tested), one request, over HF's own cache (`DynamicCache`) in
the chunk pattern CHUNKS: prefill chunks of 130 (longer than the window) and
40 tokens between single-token decode steps, 200 tokens in all. The model's
own mask and rotary embeddings are built as `DeepseekV4Model.forward` builds
them. The attention function is the module's eager one, called through a
wrapper that records its query and keys.

torch, transformers (5.23.0) and safetensors are this script's needs only:

    python3 -m venv /work/venv-hf && . /work/venv-hf/bin/activate
    pip install torch transformers==5.23.0 safetensors numpy
    python tools/gen_hf_block_golden.py          # rewrites both files

Arrays of the .npz (S = 200 tokens, layer i of L = 3; bf16 values are
stored as their uint16 bit patterns):

  config_json            the DeepseekV4Config, JSON
  chunks                 i32[n]      tokens per HF forward call, in order
  checked                i32[C]      positions whose q and core output are kept
  inv_freq_main, inv_freq_compress   f32[32]  HF's rope frequencies
  x{i}                   f32[S, 32]  the layer's input rows
  y{i}                   f32[S, 32]  HF's block output (after o_b_proj)
  core{i}                f32[C, 4, 512]  attention output after the inverse
                         RoPE, before o_a_proj, at the checked positions
  q{i}                   u16[C, 4, 512]  bf16 of HF's query (normed, roped)
  kv{i}                  u16[S, 512] bf16 of HF's window row of each token
  entries{i}             f32[E, 512] HF's compressed entries (CSA, HCA)
  picks{i}               i32[S, 16]  HF's indexer picks (CSA), -1 padded
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import AttentionInterface, DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import (AttentionMaskInterface, create_sliding_window_causal_mask,
                                        eager_mask)
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "hf_dsv4_block"
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
CHUNKS = [130, 1, 1, 1, 40] + [1] * 27
TOPK = 16


def config() -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, head_dim=512, q_lora_rank=16, o_groups=2, o_lora_rank=8,
        layer_types=LAYER_TYPES, index_n_heads=64, index_head_dim=128, index_topk=TOPK,
        sliding_window=128, moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1,
        num_nextn_predict_layers=0, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 65536,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        max_position_embeddings=1 << 20, torch_dtype="float32")
    cfg._attn_implementation = "recording_eager"
    return cfg


def randomize(model, gen):
    """Random attention weights: projections for unit-variance outputs, norm
    weights in [0.5, 2.5] (logits of a few units, so positions matter),
    position biases of unit scale, sinks around 4 (comparable to a row's
    mass, so the sink matters)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." not in name:
                continue
            if name.endswith("norm.weight"):
                p.copy_(0.5 + 2.0 * torch.rand(p.shape, generator=gen))
            elif name.endswith("proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif name.endswith("sinks"):
                p.copy_(4.0 + torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen))


RECORD = {}


def recording_eager(module, query, key, value, attention_mask, **kwargs):
    """The module's own eager attention, its query and keys kept."""
    RECORD[module.layer_idx] = (query.detach().clone(), key.detach().clone())
    return hf.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help="path without extension")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    AttentionInterface.register("recording_eager", recording_eager)
    # the eager function's mask for it (an unknown name gets no mask at all)
    AttentionMaskInterface.register("recording_eager", eager_mask)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = config()
    model = DeepseekV4ForCausalLM(cfg).eval()
    randomize(model, gen)
    inner = model.model
    L, S, D = len(LAYER_TYPES), sum(CHUNKS), cfg.hidden_size
    H = cfg.num_attention_heads
    xs = [torch.randn(1, S, D, generator=gen) for _ in range(L)]

    cache = DynamicCache(config=cfg)
    y = [np.zeros((S, D), np.float32) for _ in range(L)]
    q_all = [np.zeros((S, H, 512), np.float32) for _ in range(L)]
    core_all = [np.zeros((S, H, 512), np.float32) for _ in range(L)]
    kv = [np.zeros((S, 512), np.float32) for _ in range(L)]
    picks = {i: np.full((S, TOPK), -1, np.int32) for i, t in enumerate(LAYER_TYPES)
             if t == "compressed_sparse_attention"}
    hooks, seen = [], {}
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        hooks.append(attn.o_a_proj.register_forward_pre_hook(
            lambda mod, inp, i=i: seen.__setitem__(("core", i), inp[0].detach().clone())))
        if i in picks:
            hooks.append(attn.compressor.indexer.register_forward_hook(
                lambda mod, inp, out, i=i: seen.__setitem__(("picks", i), out.detach().clone())))

    past = 0
    with torch.no_grad():
        for n in CHUNKS:
            pos = torch.arange(past, past + n).unsqueeze(0)
            rows = slice(past, past + n)
            embeds = xs[0][:, rows]
            mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=embeds,
                                                     attention_mask=None, past_key_values=cache,
                                                     position_ids=pos)
            pe = {kind: inner.rotary_emb(embeds, position_ids=pos, layer_type=kind)
                  for kind in ("main", "compress")}
            for i, layer in enumerate(inner.layers):
                out, _ = layer.self_attn(xs[i][:, rows], position_embeddings=pe, position_ids=pos,
                                         attention_mask=mask, past_key_values=cache)
                y[i][rows] = out[0].numpy()
                query, key = RECORD.pop(i)
                q_all[i][rows] = query[0].transpose(0, 1).numpy()          # [n, H, 512]
                core_all[i][rows] = seen.pop(("core", i))[0].reshape(n, H, 512).numpy()
                layer_cache = cache.layers[i]
                entries = getattr(layer_cache, "entry_count", {}).get("compressor", 0)
                window = key.shape[2] - entries      # the window rows come first
                kv[i][rows] = key[0, 0, window - n:window].numpy()
                if i in picks:
                    p = seen.pop(("picks", i))[0].numpy()
                    picks[i][rows, :p.shape[1]] = p
            past += n
    for h in hooks:
        h.remove()

    checked = sorted({p for p in range(S) if p % 5 == 4}
                     | set(np.cumsum(CHUNKS) - 1) | set(range(S - 27, S)))
    data = {"config_json": np.array(cfg.to_json_string()), "chunks": np.array(CHUNKS, np.int32),
            "checked": np.array(checked, np.int32),
            "inv_freq_main": inner.rotary_emb.main_inv_freq.numpy().astype(np.float32),
            "inv_freq_compress": inner.rotary_emb.compress_inv_freq.numpy().astype(np.float32),
            "transformers_version": np.array(transformers.__version__)}
    for i in range(L):
        data[f"x{i}"] = xs[i][0].numpy()
        data[f"y{i}"] = y[i]
        data[f"core{i}"] = core_all[i][checked]
        data[f"q{i}"] = bf16_bits(torch.from_numpy(q_all[i][checked]))
        data[f"kv{i}"] = bf16_bits(torch.from_numpy(kv[i]))
        comp = getattr(cache.layers[i], "compressed_kv", {}).get("compressor")
        if comp is not None:
            data[f"entries{i}"] = comp[0].numpy().astype(np.float32)
        if i in picks:
            data[f"picks{i}"] = picks[i]
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if ".self_attn." in k
               and "rotary" not in k}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(args.out.with_suffix(".safetensors")),
              metadata={"transformers": transformers.__version__})
    np.savez(args.out.with_suffix(".npz"), **data)
    sizes = [args.out.with_suffix(e).stat().st_size for e in (".safetensors", ".npz")]
    print(f"transformers {transformers.__version__}: {S} tokens in {len(CHUNKS)} calls, "
          f"{len(weights)} weight tensors; wrote {args.out}.safetensors ({sizes[0]:,} B) and "
          f".npz ({sizes[1]:,} B)")


if __name__ == "__main__":
    main()
