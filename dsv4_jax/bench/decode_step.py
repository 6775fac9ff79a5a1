"""The cache work of one V4-Flash decode step (43 layers: append, flush,
gathers as a model calls them), the FFI impl against the jnp reference."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..config import CacheConfig
from ..meta import StepMeta
from ..ops.append import append
from ..ops.flush import flush
from ..ops.gather import gather_all, gather_topk, gather_window
from ..state import init_state
from .inputs import flush_params, random_pools, with_blocks

SETS = 2


def bench_flash_step(b, batches, ctx, fmt):
    """B decode tokens, one a request at position ctx - 1 (so every CSA and
    HCA window closes), through every layer of the V4-Flash pattern."""
    rng = b.rng
    for B in batches:
        cfg = CacheConfig.flash(max_requests=B, max_context=ctx, kv_format=fmt)
        MB = cfg.max_blocks_per_request
        kinds = cfg.layer_kinds
        assert kinds[3:] == (C.HCA, C.CSA) * 20, "the step below scans V4-Flash's layer pattern"
        pc, ph = flush_params(C.CSA, rng), flush_params(C.HCA, rng)
        slot = np.arange(B, dtype=np.int32)
        pos = np.full(B, ctx - 1, np.int32)
        meta = StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.full(B, ctx, np.int32))
        f32 = lambda w: jnp.asarray(rng.normal(0, 1, (B, w)), jnp.float32)  # noqa: E731
        x = dict(kv=f32(C.HEAD_DIM).astype(jnp.bfloat16),
                 ckv=f32(2 * C.HEAD_DIM), csc=f32(2 * C.HEAD_DIM),
                 hkv=f32(C.HEAD_DIM), hsc=f32(C.HEAD_DIM),
                 ikv=f32(2 * C.INDEX_DIM), isc=f32(2 * C.INDEX_DIM))
        slots = jnp.asarray(slot)
        lengths = jnp.full((B,), ctx, jnp.int32)
        k = min(cfg.index_topk, ctx // C.CSA_RATIO)
        idx = jnp.asarray(np.stack([rng.choice(ctx // C.CSA_RATIO, k, replace=False)
                                    for _ in range(B)]).astype(np.int32))
        tpos = jnp.asarray(pos)

        def layer_work(s, layer, kind, impl):
            s = append(s, layer, meta, x["kv"], impl=impl)
            if kind == C.CSA:
                s = flush(s, layer, meta, x["ckv"], x["csc"], pc, index_kv=x["ikv"],
                          index_score=x["isc"], impl=impl)
            elif kind == C.HCA:
                s = flush(s, layer, meta, x["hkv"], x["hsc"], ph, impl=impl)
            out = [gather_window(s, layer, slots, impl=impl, return_state=False)]
            if kind == C.CSA:
                out.append(gather_topk(s, layer, slots, tpos, idx, impl=impl, return_state=False))
            elif kind == C.HCA:
                out.append(gather_all(s, layer, slots, lengths, ctx // C.HCA_RATIO, impl=impl, return_state=False))
            return s, out

        def step(s, impl):
            outs = []
            for layer in range(3):  # SWA, SWA, CSA
                s, o = layer_work(s, layer, kinds[layer], impl)
                outs.append(o)

            def pair(s, i):  # (HCA, CSA) layers 3 + 2i, 4 + 2i, traced layer index
                s, oh = layer_work(s, 3 + 2 * i, C.HCA, impl)
                s, oc = layer_work(s, 4 + 2 * i, C.CSA, impl)
                return s, (oh, oc)
            s, ys = jax.lax.scan(pair, s, jnp.arange(20, dtype=jnp.int32))
            return s, (outs, ys)
        states = [with_blocks(random_pools(init_state(cfg), rng), B, MB) for _ in range(SETS)]
        res = {}
        for impl in (b.impl, "reference"):
            f = jax.jit(step, donate_argnums=0, static_argnums=1)

            def call(i, f=f, impl=impl):
                states[i % SETS], out = f(states[i % SETS], impl)
                return states[i % SETS], out
            t0 = time.perf_counter()
            jax.block_until_ready(call(0))
            compile_s = time.perf_counter() - t0
            s = b.time(call, SETS, reps=max(3, b.settings.reps // 3),
                       batch=max(2, b.settings.batch // 4), warm=1)
            res[impl] = s
            b.record(op="flash_decode_step", B=B, ctx=ctx, impl=impl, ms=s * 1e3,
                     first_call_s=compile_s, fmt=fmt)
        for st in states:
            b.count_errors(st)
        b.record(op="flash_decode_step", B=B, ctx=ctx, speedup=res["reference"] / res[b.impl])
