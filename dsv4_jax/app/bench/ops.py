"""Per-op benchmarks, each op at several sizes as rows of a BenchRun (bytes
moved: inputs.py): apply_step, append, flush (CSA, HCA), write_layer, the
three gathers, indexer_topk and attention."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ... import config as C
from ...config import CacheConfig
from ...memory import memory_report
from ...meta import StepMeta
from ...ops.append import append
from ...ops.apply_step import apply_step
from ...ops.attention import attention
from ...ops.flush import flush
from ...ops.gather import gather_all, gather_topk, gather_window
from ...ops.indexer import indexer_topk
from ...ops.write_layer import write_layer
from ...params import yarn_inv_freq
from ...state import init_state
from .filled_state import filled_state
from .inputs import (INDEX_KEY, ROW, entry_bytes, flush_bytes, flush_params,
                     pool_config, random_pools, with_blocks)

SETS = 2    # input sets a case rotates over


def time_writer(b, body, states, inputs, reps=None):
    """{impl: seconds a call} of jitted body(state, inputs, impl) on set i,
    the state donated and put back; the error counts of the states after."""
    f = jax.jit(body, donate_argnums=0, static_argnums=2)
    times = {}
    for impl in b.impls:
        def call(i, impl=impl):
            states[i % SETS] = f(states[i % SETS], inputs[i % SETS], impl)
            return states[i % SETS]
        times[impl] = b.time(call, SETS, reps=reps)
    for st in states:
        b.count_errors(st)
    return times


def time_reader(b, op, layers, states):
    """{impl: seconds a layer} of op(state, layer, impl) over `layers` layers
    in one jit."""
    times = {}
    for impl in b.impls:
        f = jax.jit(lambda s, impl=impl: [op(s, layer, impl) for layer in range(layers)])
        times[impl] = b.time(lambda i, f=f: f(states[i % SETS]), SETS) / layers
    return times


def bench_append(b, rows_list, fmt):
    for T in rows_list:
        R = T if T <= 64 else max(64, T // 128)
        per = -(-T // R)
        L = b.layers(T)
        cfg = pool_config(C.SWA, L, R, 64, kv_format=fmt)
        slot = np.repeat(np.arange(R, dtype=np.int32), per)[:T]
        base = b.rng.integers(0, 4000, R).astype(np.int32)
        pos = (base[slot] + np.tile(np.arange(per, dtype=np.int32), R)[:T]).astype(np.int32)
        meta = StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(R, np.int32))
        kvs = [[jnp.asarray(b.rng.normal(0, 1, (T, C.HEAD_DIM)), jnp.bfloat16) for _ in range(L)]
               for _ in range(SETS)]

        def body(s, kv, impl):
            for layer in range(L):
                s = append(s, layer, meta, kv[layer], impl=impl)
            return s
        states = [init_state(cfg) for _ in range(SETS)]
        for impl, s in time_writer(b, body, states, kvs).items():
            b.op_row("append", T, s / L, T * (ROW + entry_bytes(fmt) + 4 + 8), inner=L,
                     impl=impl, fmt=fmt)


def bench_gather_window(b, rows_list, fmt):
    for rows in rows_list:
        if rows < C.WINDOW and rows != 1:
            continue  # a window is 128 rows: 1 request stands for the small sizes
        B = max(1, rows // C.WINDOW)
        L = b.layers(B * C.WINDOW)
        cfg = pool_config(C.SWA, L, B, 64, kv_format=fmt)
        states = []
        for _ in range(SETS):
            st = random_pools(init_state(cfg), b.rng)
            pos = jnp.asarray(b.rng.integers(0, 4096, (L, B, C.WINDOW)), jnp.int32)
            states.append(dataclasses.replace(st, swa=dataclasses.replace(st.swa, pos=pos)))
        slots = jnp.asarray(b.rng.permutation(B).astype(np.int32))
        n = B * C.WINDOW
        times = time_reader(b, lambda s, l, impl: gather_window(s, l, slots, impl=impl, return_state=False), L, states)
        for impl, s in times.items():
            b.op_row("gather_window", n, s, n * (entry_bytes(fmt) + 4 + ROW + 4), inner=L,
                     impl=impl, fmt=fmt, B=B)


def bench_gather_topk(b, rows_list, fmt):
    for rows in rows_list:
        K = min(rows, 512)
        T = max(1, rows // K)
        L = b.layers(rows)
        ctx = 4096
        MB = ctx // C.BLOCK_TOKENS
        cfg = pool_config(C.CSA, L, T, MB, kv_format=fmt)
        states = [with_blocks(random_pools(init_state(cfg), b.rng), T, MB) for _ in range(SETS)]
        slot = jnp.arange(T, dtype=jnp.int32)
        pos = jnp.full((T,), ctx - 1, jnp.int32)
        idx = jnp.asarray(np.stack([b.rng.choice(ctx // C.CSA_RATIO, K, replace=False)
                                    for _ in range(T)]).astype(np.int32))
        n = T * K
        times = time_reader(b, lambda s, l, impl: gather_topk(s, l, slot, pos, idx, impl=impl, return_state=False),
                            L, states)
        for impl, s in times.items():
            b.op_row("gather_topk", n, s, n * (entry_bytes(fmt) + 4 + ROW + 1), inner=L,
                     impl=impl, fmt=fmt, T=T, k=K)


def bench_gather_all(b, rows_list, fmt):
    for rows in rows_list:
        E = min(rows, 32)
        B = max(1, rows // E)
        L = b.layers(rows)
        cfg = pool_config(C.HCA, L, B, E, kv_format=fmt)
        states = [with_blocks(random_pools(init_state(cfg), b.rng), B, E) for _ in range(SETS)]
        slots = jnp.arange(B, dtype=jnp.int32)
        lengths = jnp.full((B,), E * C.HCA_RATIO, jnp.int32)
        n = B * E
        times = time_reader(b, lambda s, l, impl: gather_all(s, l, slots, lengths, E, impl=impl, return_state=False),
                            L, states)
        for impl, s in times.items():
            b.op_row("gather_all", n, s, n * (entry_bytes(fmt) + 4 + ROW), inner=L, impl=impl,
                     fmt=fmt, B=B, E=E)


def bench_flush(b, kind, cases, fmt):
    """`cases`: (label, B requests, tokens each). Decode: each request's
    token closes a window (position 4095); prefill: positions 0 .. per-1
    (the block table as long as that takes: 65,536 tokens need 512 blocks)."""
    rng = b.rng
    params = flush_params(kind, rng)
    for label, B, per in cases:
        T = B * per
        MB = max(32, -(-per // C.BLOCK_TOKENS))  # 4096 tokens of context, or the prefill's
        L = b.layers(T, 16)
        cfg = pool_config(kind, L, B, MB, kv_format=fmt)
        slot = np.repeat(np.arange(B, dtype=np.int32), per)
        pos = (np.full(T, 4095, np.int32) if per == 1
               else np.tile(np.arange(per, dtype=np.int32), B))
        meta = StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(B, np.int32))
        w = 2 * C.HEAD_DIM if kind == C.CSA else C.HEAD_DIM
        xs = [dict(kv=jnp.asarray(rng.normal(0, 1, (T, w)), jnp.float32),
                   sc=jnp.asarray(rng.normal(0, 1, (T, w)), jnp.float32),
                   ikv=jnp.asarray(rng.normal(0, 1, (T, 2 * C.INDEX_DIM)), jnp.float32),
                   isc=jnp.asarray(rng.normal(0, 1, (T, 2 * C.INDEX_DIM)), jnp.float32))
              for _ in range(SETS)]

        def body(s, x, impl):
            for layer in range(L):
                extra = dict(index_kv=x["ikv"], index_score=x["isc"]) if kind == C.CSA else {}
                s = flush(s, layer, meta, x["kv"], x["sc"], params, impl=impl, **extra)
            return s
        states = [with_blocks(init_state(cfg), B, MB) for _ in range(SETS)]
        times = time_writer(b, body, states, xs, reps=max(3, b.settings.reps // 2))
        for impl, s in times.items():
            b.op_row(f"flush_{kind}", T, s / L, flush_bytes(kind, pos, B, fmt), inner=L,
                     case=label, impl=impl, fmt=fmt)


def bench_write_layer(b, cases, fmt):
    """write_layer on a CSA layer (the costliest write: append, both
    compressors, an entry and an indexer key a closed window) over the
    cases of bench_flush."""
    rng = b.rng
    params = flush_params(C.CSA, rng)
    for label, B, per in cases:
        T = B * per
        MB = max(32, -(-per // C.BLOCK_TOKENS))
        L = b.layers(T, 16)
        cfg = pool_config(C.CSA, L, B, MB, kv_format=fmt)
        slot = np.repeat(np.arange(B, dtype=np.int32), per)
        pos = (np.full(T, 4095, np.int32) if per == 1
               else np.tile(np.arange(per, dtype=np.int32), B))
        meta = StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(B, np.int32))
        f = lambda *shape: jnp.asarray(rng.normal(0, 1, (T,) + shape), jnp.float32)
        xs = [dict(kv=f(C.HEAD_DIM).astype(jnp.bfloat16), ckv=f(2 * C.HEAD_DIM),
                   sc=f(2 * C.HEAD_DIM), ikv=f(2 * C.INDEX_DIM), isc=f(2 * C.INDEX_DIM))
              for _ in range(SETS)]

        def body(s, x, impl):
            for layer in range(L):
                s = write_layer(s, layer, meta, x["kv"], x["ckv"], x["sc"], params,
                                index_kv=x["ikv"], index_score=x["isc"], impl=impl)
            return s
        states = [with_blocks(init_state(cfg), B, MB) for _ in range(SETS)]
        times = time_writer(b, body, states, xs, reps=max(3, b.settings.reps // 2))
        append_bytes = T * (ROW + entry_bytes(fmt) + 4 + 8)
        for impl, s in times.items():
            b.op_row("write_layer", T, s / L, append_bytes + flush_bytes(C.CSA, pos, B, fmt),
                     inner=L, case=f"{label} (CSA)", impl=impl, fmt=fmt)


def bench_apply_step(b, rows_list, fmt):
    """apply_step of V4-Flash handing out `rows` new blocks (at most 1024),
    each scrubbed in every compressed layer, to R = min(rows, 8) requests,
    whose slots it resets (every layer's window and accumulators)."""
    for n in rows_list:
        if n > 1024:
            continue
        R = min(n, 8)
        MB = -(-n // R)
        cfg = CacheConfig.flash(max_requests=R, max_context=MB * C.BLOCK_TOKENS,
                                num_blocks=n, kv_format=fmt)
        i = np.arange(n, dtype=np.int32)
        rows = np.stack([i % R, i // R, b.rng.permutation(n).astype(np.int32)], 1)
        meta = StepMeta.build(token_slot=[-1], token_pos=[0], lengths=np.zeros(R, np.int32),
                              new_blocks=rows, reset_slots=np.arange(R, dtype=np.int32))
        states = [init_state(cfg) for _ in range(SETS)]
        times = time_writer(b, lambda s, m, impl: apply_step(s, m, impl=impl), states,
                            [meta] * SETS, reps=max(3, b.settings.reps // 2))
        rep = memory_report(cfg)
        per_slot = rep.window_per_request + rep.compressor_per_request
        for impl, s in times.items():
            b.op_row("apply_step", n, s, n * (rep.per_block + 12) + R * per_slot, impl=impl,
                     fmt=fmt, R=R)


def _filled_csa(b, layers, B, context, fmt):
    """`layers` CSA layers of B requests holding `context` tokens each,
    filled with valid random entries, windows and indexer keys."""
    MB = -(-context // C.BLOCK_TOKENS)
    cfg = pool_config(C.CSA, layers, B, MB, kv_format=fmt)
    return [filled_state(cfg, context, seed) for seed in range(SETS)]


def bench_indexer_topk(b, batches, context, fmt):
    """indexer_topk (k = 512, the default MXFP4 query) of B decode tokens,
    one a request at its last position, over `context` tokens' keys."""
    k = 512
    for B in batches:
        L = b.layers(B * context // C.CSA_RATIO // 64, 16)
        states = _filled_csa(b, L, B, context, fmt)
        slot = jnp.arange(B, dtype=jnp.int32)
        pos = jnp.full((B,), context - 1, jnp.int32)
        q = jnp.asarray(b.rng.normal(0, 1, (B, C.INDEX_HEADS, C.INDEX_DIM)), jnp.bfloat16)
        w = jnp.asarray(b.rng.normal(0, 1, (B, C.INDEX_HEADS)), jnp.float32)
        times = time_reader(b, lambda s, l, impl: indexer_topk(
            s, l, slot, pos, q, w, k, impl=impl, return_state=False), L, states)
        entries = context // C.CSA_RATIO
        nbytes = B * (entries * INDEX_KEY + C.INDEX_HEADS * (2 * C.INDEX_DIM + 4) + 4 * k)
        for impl, s in times.items():
            b.op_row("indexer_topk", B, s, nbytes, inner=L, impl=impl, fmt=fmt, B=B,
                     ctx=context, k=k)


def bench_attention(b, batches, context, fmt):
    """attention of B decode tokens on a CSA layer as V4-Flash runs it: 64
    heads, the window and 512 picks of `context` tokens' entries, the sink,
    the inverse RoPE of the output."""
    H, k = 64, 512
    inv = jnp.asarray(yarn_inv_freq())
    for B in batches:
        L = b.layers(B * (C.WINDOW + k) * H // 64, 16)   # rows x heads / 64
        states = _filled_csa(b, L, B, context, fmt)
        slot = jnp.arange(B, dtype=jnp.int32)
        pos = jnp.full((B,), context - 1, jnp.int32)
        q = jnp.asarray(0.05 * b.rng.normal(0, 1, (B, H, C.HEAD_DIM)), jnp.bfloat16)
        sink = jnp.asarray(b.rng.normal(0, 1, H), jnp.float32)
        visible = context // C.CSA_RATIO
        picks = jnp.asarray(np.stack([b.rng.choice(visible, min(k, visible), replace=False)
                                      for _ in range(B)]).astype(np.int32))
        times = time_reader(b, lambda s, l, impl: attention(
            s, l, q, slot, pos, sink=sink, topk=picks, rope_inv_freq=inv, impl=impl,
            return_state=False), L, states)
        visited = B * (C.WINDOW + picks.shape[1])
        nbytes = visited * entry_bytes(fmt) + B * H * (2 * 2 * C.HEAD_DIM + 4)
        for impl, s in times.items():
            b.op_row("attention", B, s, nbytes, inner=L, impl=impl, fmt=fmt, B=B, ctx=context,
                     k=picks.shape[1])
