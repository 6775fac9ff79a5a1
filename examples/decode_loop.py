"""A toy DeepSeek-V4 attention block on top of the dsv4_jax cache.

Shows exactly where a model calls the cache: one jitted, donated step per
token batch that does

    apply_step                      once per step (new blocks, reset slots)
    per layer:
      write_layer                   append (the step's KV rows into the sliding
                                    window) and, on CSA / HCA layers, flush
                                    (compressor projections -> compressed entries)
                                    in one call
      gather_window                 the last 128 entries of each request
      indexer_topk   (CSA)          the lightning indexer's top-k entries
      gather_topk    (CSA)          the entries the indexer picked
      gather_all     (HCA)          every compressed entry
      attention                     window + compressed entries + attention sink

Weights are random and small (4 query heads, a 128-wide hidden state, the
tiny 4-layer pattern SWA, CSA, HCA, CSA; the indexer has the real 64 heads
of 128 channels, which indexer_topk expects). To stay short, every layer reads the
same token embeddings instead of a residual stream, so prefill only has to
write the cache (a real model also needs the prompt's attention outputs to
feed the next layer).

    python examples/decode_loop.py
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from dsv4_jax import config as C

D = C.HEAD_DIM          # 512: one KV head, K = V
HIDDEN = 128            # toy hidden size
HEADS = 4               # query heads
INDEX_HEADS = C.INDEX_HEADS   # indexer heads: 64, as in the real model


@dataclasses.dataclass
class Settings:
    prompts: tuple = (150, 61)     # prompt lengths of the requests
    decode_steps: int = 3
    chunk: int = 64                # prefill tokens per request per step
    kv_format: str = "ds_fp8"
    seed: int = 0


# ---- weights --------------------------------------------------------------------------------
def hadamard(n=C.INDEX_DIM):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def make_weights(cfg, seed):
    """Random weights of every layer (numpy float32; the test reuses them)."""
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def mat(*shape):            # unit-variance outputs for unit-variance inputs
        return rng.normal(0, 1 / math.sqrt(shape[0]), shape).astype(f32)

    def compressor(m, width, d):
        return dict(ape=rng.normal(0, 0.5, (m, width)).astype(f32),
                    norm=rng.uniform(0.5, 1.5, d).astype(f32))
    layers = []
    for kind in cfg.layer_kinds:
        w = dict(wq=mat(HIDDEN, HEADS, D), wkv=mat(HIDDEN, D),
                 sink=rng.normal(0, 1, HEADS).astype(f32))
        if kind != C.SWA:
            coff = 2 if kind == C.CSA else 1
            m = C.CSA_RATIO if kind == C.CSA else C.HCA_RATIO
            w.update(wc_kv=mat(HIDDEN, coff * D), wc_score=mat(HIDDEN, coff * D),
                     comp=compressor(m, coff * D, D))
        if kind == C.CSA:
            w.update(wi_kv=mat(HIDDEN, 2 * C.INDEX_DIM), wi_score=mat(HIDDEN, 2 * C.INDEX_DIM),
                     wi_q=mat(HIDDEN, INDEX_HEADS, C.INDEX_DIM), wi_w=mat(HIDDEN, INDEX_HEADS),
                     icomp=compressor(C.CSA_RATIO, 2 * C.INDEX_DIM, C.INDEX_DIM))
        layers.append(w)
    return layers


def compressor_params(w):
    """The `CompressorParams` that `flush` takes, from a layer's weights."""
    inv_freq = jnp.asarray(dj.yarn_inv_freq())
    p = dj.CompressorParams(jnp.asarray(w["comp"]["ape"]), jnp.asarray(w["comp"]["norm"]),
                            inv_freq)
    if "icomp" in w:
        p = dataclasses.replace(p, index=dj.CompressorParams(
            jnp.asarray(w["icomp"]["ape"]), jnp.asarray(w["icomp"]["norm"]), inv_freq))
    return p


# ---- the block ------------------------------------------------------------------------------
def rms_norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def write_cache(state, meta, x, weights, params, layer):
    """The cache writes of one layer, in one call: the projections, then
    write_layer (append, and flush on a CSA or HCA layer)."""
    kind = state.config.layer_kinds[layer]
    w = weights[layer]
    kv = rms_norm(x @ w["wkv"]).astype(jnp.bfloat16)      # (a real model also ropes it)
    if kind == C.CSA:
        return dj.write_layer(state, layer, meta, kv, x @ w["wc_kv"], x @ w["wc_score"],
                              params[layer], index_kv=x @ w["wi_kv"],
                              index_score=x @ w["wi_score"])
    if kind == C.HCA:
        return dj.write_layer(state, layer, meta, kv, x @ w["wc_kv"], x @ w["wc_score"],
                              params[layer])
    return dj.write_layer(state, layer, meta, kv)


def indexer_topk(state, layer, meta, x, w, k):
    """The indexer's query (projected, then the Hadamard rotation; a real
    model ropes its last 64 channels first) and head weights, and the k
    visible CSA entries of each token's request with the best scores
    sum_h w_h relu(q_h . key_j), -1 where fewer are visible. indexer_topk
    rounds q to MXFP4 as DeepSeek-V4's inference code does and reads the
    MXFP4 keys through the block table itself."""
    q = jnp.einsum("td,dhc->thc", x, w["wi_q"]) @ jnp.asarray(hadamard(), jnp.float32)
    return dj.indexer_topk(state, layer, meta.token_slot, meta.token_pos,
                           q.astype(jnp.bfloat16), x @ w["wi_w"], k)   # (indices, state)


def attention(q, kv, ok, sink):
    """Softmax attention of q [T, H, 512] over kv [T, S, 512] (K = V) where
    ok [T, S], with a learned per-head sink logit that takes probability mass
    but adds no value."""
    logits = jnp.einsum("thd,tsd->ths", q, kv.astype(jnp.float32)) / math.sqrt(D)
    logits = jnp.where(ok[:, None, :], logits, -jnp.inf)
    m = jnp.maximum(jnp.max(logits, axis=-1), sink[None, :])                 # [T, H]
    p = jnp.exp(logits - m[..., None])
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink[None, :] - m)
    return jnp.einsum("ths,tsd->thd", p, kv.astype(jnp.float32)) / denom[..., None]


def prefill_step(state, meta, x, weights, params):
    """Prompt chunks: cache writes only (see the module docstring)."""
    state = dj.apply_step(state, meta)
    for layer in range(state.config.num_layers):
        state = write_cache(state, meta, x, weights, params, layer)
    return state


def decode_step(state, meta, x, weights, params):
    """One token per request: write, gather, attend. Returns the state, the
    attention output f32[L, T, H, 512] and the top-k picks of CSA layers."""
    cfg = state.config
    slot, pos = meta.token_slot, meta.token_pos
    length = jnp.where(slot >= 0, meta.lengths[jnp.clip(slot, 0, cfg.max_requests - 1)], 0)
    state = dj.apply_step(state, meta)
    outs, picks = [], {}
    for layer, kind in enumerate(cfg.layer_kinds):
        w = weights[layer]
        state = write_cache(state, meta, x, weights, params, layer)
        # sliding window: after this step's append it ends at the token itself
        # each read returns the state too (its error counts): threading it on
        # keeps every cache op in place, with no copies between them
        win, wpos, state = dj.gather_window(state, layer, slot)          # [T, 128, 512]
        win_ok = (wpos >= 0) & (wpos <= pos[:, None]) & (wpos > pos[:, None] - C.WINDOW)
        if kind == C.CSA:
            idx, state = indexer_topk(state, layer, meta, x, w, cfg.index_topk)
            comp, comp_ok, state = dj.gather_topk(state, layer, slot, pos, idx)  # [T, k, 512]
            picks[layer] = idx
        elif kind == C.HCA:
            comp, count, state = dj.gather_all(state, layer, slot, length,
                                               cfg.max_blocks_per_request)
            comp_ok = jnp.arange(comp.shape[1])[None, :] < count[:, None]
        else:
            comp = jnp.zeros((x.shape[0], 1, D), jnp.bfloat16)
            comp_ok = jnp.zeros((x.shape[0], 1), bool)
        q = jnp.einsum("td,dhc->thc", x, w["wq"])                     # (a real model ropes q)
        outs.append(attention(q, jnp.concatenate([win, comp], axis=1),
                              jnp.concatenate([win_ok, comp_ok], axis=1), w["sink"]))
    return state, jnp.stack(outs), picks


# ---- the loop -------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    weights: list
    tokens: list          # per request: embeddings f32[length, HIDDEN] of every token
    out: np.ndarray       # last decode step: f32[L, requests, H, 512]
    picks: dict           # CSA layer -> i32[requests, k] of the last decode step
    config: dj.CacheConfig


def run(settings: Settings = Settings(), verbose: bool = True) -> Result:
    B = len(settings.prompts)
    total = [p + settings.decode_steps for p in settings.prompts]
    cfg = dj.CacheConfig.tiny(max_requests=B, max_context=-(-max(total) // 128) * 128,
                              kv_format=settings.kv_format)
    rng = np.random.default_rng(settings.seed)
    weights_np = make_weights(cfg, settings.seed)
    weights = jax.tree_util.tree_map(jnp.asarray, weights_np)
    params = {i: compressor_params(w) for i, w in enumerate(weights_np) if "comp" in w}
    tokens = [rng.normal(0, 1, (n, HIDDEN)).astype(np.float32) for n in total]

    state = dj.init_state(cfg)
    manager = dj.CacheManager(cfg)
    reqs = [manager.admit() for _ in range(B)]
    prefill = jax.jit(prefill_step, donate_argnums=0)      # donated: pools updated in place
    decode = jax.jit(decode_step, donate_argnums=0)

    def rows(meta):
        """The step's embeddings in the row order of the metadata."""
        x = np.zeros((meta.num_tokens, HIDDEN), np.float32)
        for r in reqs:
            sl = manager.token_rows(r)
            start = manager.length_of(r) - (sl.stop - sl.start)
            x[sl] = tokens[r][start:manager.length_of(r)]
        return jnp.asarray(x)

    # chunked prefill; fixed padded sizes keep it to one compilation
    pads = dict(min_tokens=B * settings.chunk, min_new_blocks=4 * B, min_resets=B)
    while any(manager.length_of(r) < p for r, p in zip(reqs, settings.prompts)):
        take = {r: min(settings.chunk, p - manager.length_of(r))
                for r, p in zip(reqs, settings.prompts)}
        meta = manager.prepare_step(take, **pads)
        state = prefill(state, meta, rows(meta), weights, params)

    # decode: one token per request per step
    for _ in range(settings.decode_steps):
        meta = manager.prepare_step({r: 1 for r in reqs}, min_new_blocks=4 * B, min_resets=B)
        state, out, picks = decode(state, meta, rows(meta), weights, params)
    dj.check_errors(state)                 # no op dropped any input
    order = [manager.token_rows(r).start for r in reqs]
    out = np.asarray(out)[:, order]
    picks = {k: np.asarray(v)[order] for k, v in picks.items()}
    if verbose:
        print(f"{B} requests, prompts {list(settings.prompts)}, {settings.decode_steps} decode "
              f"steps, layers {'/'.join(k.upper() for k in cfg.layer_kinds)}")
        for layer, kind in enumerate(cfg.layer_kinds):
            o = out[layer]
            print(f"layer {layer} ({kind.upper()}): attention output {o.shape}, "
                  f"rms {np.sqrt(np.mean(o ** 2)):.4f}, head 0 of request 0 starts "
                  f"{np.array2string(o[0, 0, :4], precision=4)}")
    return Result(weights_np, tokens, out, picks, cfg)


if __name__ == "__main__":
    run()
