"""`python -m dsv4_jax demo --model hf-tiny`: the attention block on the
cache against Hugging Face's DeepseekV4 attention (the golden set in the
checkout's tests/data), PASS or FAIL with the worst difference.

bf16 pools and HF's indexer picks, so what is compared is the block's
arithmetic on the cache against HF's float32 (golden.py states the bound);
tests/block/test_hf_attention_block.py also checks ds_fp8 pools and the
library's own indexer.
"""
from __future__ import annotations

import json
import time

import numpy as np

from . import golden as G

KIND_NAMES = {"swa": "SWA", "csa": "CSA", "hca": "HCA"}


def run_demo(impl: str = "auto", stem=G.DEFAULT_STEM, out=print) -> int:
    """Runs and prints; 0 on PASS, 1 on FAIL, 2 when the golden set or the
    safetensors package is missing."""
    try:
        g = G.load(stem, kv_format="bf16")
    except (FileNotFoundError, ImportError) as e:
        out(f"dsv4_jax demo --model hf-tiny: {e}")
        return 2
    import jax
    from ..ops.dispatch import resolve_impl
    ops = resolve_impl(impl, "dsv4_attention")
    hf = json.loads(str(g.data["config_json"]))
    kinds = ", ".join(KIND_NAMES[k] for k in g.cache.layer_kinds)
    out(f"dsv4_jax demo: model hf-tiny (Hugging Face DeepseekV4Attention, transformers "
        f"{g.data['transformers_version']}: {g.cache.num_layers} layers {kinds}, "
        f"{hf['num_attention_heads']} heads, hidden {hf['hidden_size']}), kv_format bf16, "
        f"backend {jax.default_backend()}, ops: {ops}")
    chunks = [int(c) for c in g.data["chunks"]]
    out(f"1 request of {g.tokens} tokens in HF's {len(chunks)} calls: prefill chunks "
        f"{[c for c in chunks if c > 1]}, {chunks.count(1)} decode steps; HF's indexer picks")
    t0 = time.perf_counter()
    r = G.run(g, impl=impl)
    out(f"block run: {time.perf_counter() - t0:.2f} s (compilation included)")
    worst, ok = 0.0, True
    checked = g.data["checked"]
    y_ratios = G.worst_ratio(g, r)
    for layer, kind in enumerate(g.cache.layer_kinds):
        M = G.seen_max(g, layer)
        core_err = np.abs(r.core[layer][checked] - g.data[f"core{layer}"]).max(axis=(1, 2))
        core_ratio = float((core_err / (G.BOUND * M[checked])).max())
        y_ratio = y_ratios[layer]
        y_err = float(np.abs(r.y[layer] - g.data[f"y{layer}"]).max())
        out(f"layer {layer} ({KIND_NAMES[kind]}): attention core within "
            f"{core_ratio * G.BOUND:.2e} M of HF's ({core_ratio:.2f} of the 2^-6 M bound, "
            f"{len(checked)} tokens); block output |y - y_HF| <= {y_err:.2e} "
            f"(max |y_HF| {np.abs(g.data[f'y{layer}']).max():.2f}; {y_ratio:.3f} of its bound)")
        worst = max(worst, core_ratio, y_ratio)
        ok = ok and core_ratio <= 1 and y_ratio <= 1
    verdict = "PASS" if ok else "FAIL"
    out(f"check against Hugging Face: {verdict} (worst difference {worst:.2f} of its bound)")
    return 0 if ok else 1
