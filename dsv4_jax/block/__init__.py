"""DeepSeek-V4's attention block on this cache: the query path, the window
KV, the compressors, the lightning indexer, `attention` and the grouped
output projection, as pure functions over a parameter pytree loaded from a
checkpoint named as Hugging Face's DeepseekV4 checkpoints name it.

It lives in the package (not only in examples/) because it is what a model
author imports and adapts, the `demo --model hf-tiny` command runs it
against Hugging Face's outputs, and it uses nothing but the package's public
names (`import dsv4_jax as dj`), so it doubles as their worked example.

    import dsv4_jax as dj
    from dsv4_jax import block as B
    cache = dj.CacheConfig.flash(max_requests=8, max_context=65536)
    weights = B.load_safetensors(shards, cache, B.BlockConfig.flash())
    state, y, out, picks = B.attention_layer(state, layer, meta, x, weights[layer],
                                             B.BlockConfig.flash(), prefill=False)
"""
from .attention import (attention_layer, compressor_inputs, compressor_params, hadamard,
                        indexer_query, inv_freq_of, jitted_step, output_projection, query, rope,
                        stack_step, window_kv)
from .config import BlockConfig
from .weights import HF_PREFIX, from_tensors, layer_shapes, load_safetensors

__all__ = ["BlockConfig", "attention_layer", "stack_step", "jitted_step", "query", "window_kv",
           "compressor_inputs", "compressor_params", "indexer_query", "output_projection",
           "rope", "hadamard", "inv_freq_of", "HF_PREFIX", "layer_shapes", "from_tensors",
           "load_safetensors"]
