"""A toy DeepSeek-V4 attention block on top of the dsv4_jax cache.

Shows exactly where a model calls the cache: one jitted, donated step per
token batch. A decode step (one token per request) does

    apply_step                      once per step (new blocks, reset slots)
    per layer:
      write_layer                   append (the step's KV rows into the sliding
                                    window) and, on CSA / HCA layers, flush
                                    (compressor projections -> compressed entries)
                                    in one call
      indexer_topk   (CSA)          the lightning indexer's top-k entries
      attention                     window + the picked (CSA) or all (HCA)
                                    entries + the attention sink, read straight
                                    from the cache

and a prefill step (a chunk of each prompt) the same, except that the
window rows of the chunk are attended before they are appended:

      flush          (CSA / HCA)    the entries the chunk closes
      indexer_topk   (CSA)
      attention(chunk_kv=kv)        the ring before the chunk + the chunk's own
                                    rows, as append will store them
      append                        the chunk's rows into the window

Weights are random and small (4 query heads, a 128-wide hidden state, the
tiny 4-layer pattern SWA, CSA, HCA, CSA; the indexer has the real 64 heads
of 128 channels, which indexer_topk expects). q and the window rows are
roped as the model does (plain RoPE on SWA layers, the YaRN compress rope on
CSA / HCA layers), and attention rotates its output back. To stay short,
every layer reads the same token embeddings instead of a residual stream;
the prefill steps still compute every prompt token's attention output, as a
model needs them for its next layer.

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


def rope_inv_freq(kind):
    """The layer's RoPE frequencies: plain theta 10000 on SWA layers, the
    YaRN compress rope (the compressors' too) on CSA and HCA layers."""
    if kind == C.SWA:
        return jnp.asarray(1.0 / 10000.0 ** (np.arange(0, C.ROPE_DIM, 2) / C.ROPE_DIM),
                           jnp.float32)
    return jnp.asarray(dj.yarn_inv_freq())


def rope(x, pos, inv_freq):
    """Interleaved RoPE on the trailing 64 channels of x [T, ..., 512] at
    positions pos [T], in f32, rounded to bf16."""
    ang = pos.astype(jnp.float32).reshape((-1,) + (1,) * (x.ndim - 1)) * inv_freq
    c, s = jnp.cos(ang), jnp.sin(ang)
    r = x[..., C.NOPE_DIM:].astype(jnp.float32).reshape(x.shape[:-1] + (C.ROPE_DIM // 2, 2))
    a, b = r[..., 0], r[..., 1]
    r = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape[:-1] + (C.ROPE_DIM,))
    return jnp.concatenate([x[..., :C.NOPE_DIM], r.astype(x.dtype)], axis=-1).astype(jnp.bfloat16)


def window_kv(x, pos, w, kind):
    """The window row of each token: normed, roped, bf16."""
    return rope(rms_norm(x @ w["wkv"]).astype(jnp.bfloat16), pos, rope_inv_freq(kind))


def query(x, pos, w, kind):
    """q [T, H, 512]: projected, RMS-normed per head (unweighted, as the
    model's q_b_norm), roped."""
    return rope(rms_norm(jnp.einsum("td,dhc->thc", x, w["wq"])).astype(jnp.bfloat16), pos,
                rope_inv_freq(kind))


def write_cache(state, meta, x, weights, params, layer):
    """The cache writes of one layer, in one call: the projections, then
    write_layer (append, and flush on a CSA or HCA layer)."""
    kind = state.config.layer_kinds[layer]
    w = weights[layer]
    kv = window_kv(x, meta.token_pos, w, kind)
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


def attend(state, layer, meta, x, w, chunk_kv=None):
    """The layer's attention straight from the cache: out bf16[T, H, 512]
    with the RoPE channels rotated back, and the CSA picks (or None)."""
    cfg = state.config
    kind = cfg.layer_kinds[layer]
    picks = None
    if kind == C.CSA:
        picks, state = indexer_topk(state, layer, meta, x, w, cfg.index_topk)
    out, _, state = dj.attention(state, layer, query(x, meta.token_pos, w, kind), meta.token_slot,
                                 meta.token_pos, sink=w["sink"], topk=picks, chunk_kv=chunk_kv,
                                 rope_inv_freq=rope_inv_freq(kind))
    return state, out, picks


def prefill_step(state, meta, x, weights, params):
    """Prompt chunks: per layer the entries the chunk closes, attention over
    the ring before the chunk plus the chunk itself, then the append.
    Returns the state, the attention output f32[L, T, H, 512] of every chunk
    token and the CSA picks."""
    state = dj.apply_step(state, meta)
    outs, picks = [], {}
    for layer, kind in enumerate(state.config.layer_kinds):
        w = weights[layer]
        if kind == C.CSA:
            state = dj.flush(state, layer, meta, x @ w["wc_kv"], x @ w["wc_score"], params[layer],
                             index_kv=x @ w["wi_kv"], index_score=x @ w["wi_score"])
        elif kind == C.HCA:
            state = dj.flush(state, layer, meta, x @ w["wc_kv"], x @ w["wc_score"], params[layer])
        kv = window_kv(x, meta.token_pos, w, kind)
        state, out, idx = attend(state, layer, meta, x, w, chunk_kv=kv)
        state = dj.append(state, layer, meta, kv)
        outs.append(out.astype(jnp.float32))
        if idx is not None:
            picks[layer] = idx
    return state, jnp.stack(outs), picks


def decode_step(state, meta, x, weights, params):
    """One token per request: write, attend. Returns the state, the
    attention output f32[L, T, H, 512] and the top-k picks of CSA layers."""
    state = dj.apply_step(state, meta)
    outs, picks = [], {}
    for layer in range(state.config.num_layers):
        state = write_cache(state, meta, x, weights, params, layer)
        # each op returns the state too (its error counts): threading it on
        # keeps every cache op in place, with no copies between them
        state, out, idx = attend(state, layer, meta, x, weights[layer])
        outs.append(out.astype(jnp.float32))
        if idx is not None:
            picks[layer] = idx
    return state, jnp.stack(outs), picks


# ---- the loop -------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    weights: list
    tokens: list          # per request: embeddings f32[length, HIDDEN] of every token
    out: np.ndarray       # last decode step: f32[L, requests, H, 512]
    picks: dict           # CSA layer -> i32[requests, k] of the last decode step
    config: dj.CacheConfig
    prompt_out: np.ndarray   # each request's last prompt token (prefill): f32[L, requests, H, 512]
    prompt_picks: dict       # CSA layer -> i32[requests, k] of those tokens


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
    prompt_out = np.zeros((cfg.num_layers, B, HEADS, D), np.float32)
    prompt_picks = {}
    while any(manager.length_of(r) < p for r, p in zip(reqs, settings.prompts)):
        take = {r: min(settings.chunk, p - manager.length_of(r))
                for r, p in zip(reqs, settings.prompts)}
        meta = manager.prepare_step(take, **pads)
        state, out, picks = prefill(state, meta, rows(meta), weights, params)
        for i, (r, p) in enumerate(zip(reqs, settings.prompts)):
            if take[r] and manager.length_of(r) == p:     # this chunk ends the prompt
                last = manager.token_rows(r).stop - 1
                prompt_out[:, i] = np.asarray(out)[:, last]
                for layer, idx in picks.items():
                    prompt_picks.setdefault(layer, np.zeros((B, idx.shape[1]), np.int32))
                    prompt_picks[layer][i] = np.asarray(idx)[last]

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
    return Result(weights_np, tokens, out, picks, cfg, prompt_out, prompt_picks)


if __name__ == "__main__":
    run()
