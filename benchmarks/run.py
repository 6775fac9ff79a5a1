"""Benchmarks of the cache ops (DESIGN §11): per-op time, bandwidth and the
share of a device copy of the same byte count; flush at decode and prefill
sizes; the cache work of a V4-Flash decode step, FFI against the jnp
reference.

    python benchmarks/run.py                       # everything for this platform
    python benchmarks/run.py --ops append,gather_window --rows 1,64,65536
    python benchmarks/run.py --json out.json --reps 30
    python benchmarks/run.py --markdown out.json   # a saved run's tables, for RESULTS.md

On a GPU the FFI impl is "cuda", on a CPU "cpu" (small sizes by default).

Method: every timed function is jitted, the state donated where the op
updates it. One timed call runs `inner` back-to-back op calls on different
layers inside one jit (so small ops measure the device, not Python
dispatch), and each batch of `batch` calls rotates over `sets` separate
input sets; a sample is the wall time of a batch over the op calls it made,
closed by jax.block_until_ready; the result is the median of `reps`
samples after warm-up. Bytes moved count each byte the op must read or
write once (pool entries, rows, metadata). The copy reference is a jitted
uint8 XOR over a buffer of half that byte count (read + write = the same
bytes), timed the same way in the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dsv4_jax as dj  # noqa: E402
from dsv4_jax import _ffi  # noqa: E402
from dsv4_jax import config as C  # noqa: E402

ENTRY_BYTES = {"ds_fp8": 448 + 128 + 7, "fp8_token": 448 + 128 + 4, "bf16": 1024}
ROW = C.HEAD_DIM * 2  # one gathered / appended bf16 row


# ---- timing ----------------------------------------------------------------------------------
def time_it(call, n_sets, batch, reps, warm=2):
    """Median seconds per call of call(i) (i rotates over input sets)."""
    out = None
    for i in range(warm * n_sets):
        out = call(i)
    jax.block_until_ready(out)
    samples = []
    k = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            out = call(k)
            k += 1
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


class Bench:
    def __init__(self, args):
        self.args = args
        self.platform = jax.default_backend()
        self.impl = "cuda" if self.platform == "gpu" else "cpu"
        self.rows = []
        self._copy_cache = {}
        self.rng = np.random.default_rng(0)

    def record(self, **row):
        self.rows.append(row)
        cells = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in row.items())
        print(cells, flush=True)

    # -- the copy reference: XOR over bytes/2 (read + write = nbytes), `inner`
    #    separate buffers per jit call, as the op is timed
    def copy_seconds(self, nbytes, inner=1):
        n = max(int(nbytes // 2), 16)
        if (n, inner) in self._copy_cache:
            return self._copy_cache[(n, inner)]
        sets = 2
        bufs = [[jnp.asarray(self.rng.integers(0, 256, n, dtype=np.uint8)) for _ in range(inner)]
                for _ in range(sets)]
        f = jax.jit(lambda xs: [x ^ jnp.uint8(0x5A) for x in xs], donate_argnums=0)

        def call(i):
            bufs[i % sets] = f(bufs[i % sets])
            return bufs[i % sets]
        s = time_it(call, sets, self.args.batch, self.args.reps) / inner
        self._copy_cache[(n, inner)] = s
        return s

    # -- the floor: an FFI call doing nothing (CUDA), else the smallest XLA op
    def empty_call_seconds(self):
        inner = 64
        x = [jnp.zeros((4,), jnp.int32) for _ in range(2)]
        if _ffi.has_target(self.impl, "dsv4_noop"):
            noop = jax.ffi.ffi_call("dsv4_noop", jax.ShapeDtypeStruct((4,), jnp.int32),
                                    input_output_aliases={0: 0})
            what = "empty FFI call"
        else:
            noop = lambda v: v + 1  # noqa: E731
            what = "smallest XLA op"

        def body(v):
            for _ in range(inner):
                v = noop(v)
            return v
        f = jax.jit(body, donate_argnums=0)

        def call(i):
            x[i % 2] = f(x[i % 2])
            return x[i % 2]
        s = time_it(call, 2, self.args.batch, self.args.reps) / inner
        self.record(op="empty", what=what, us=s * 1e6)
        self.empty_us = s * 1e6
        return s

    def op_row(self, op, rows, seconds, nbytes, inner=1, **extra):
        copy = self.copy_seconds(nbytes, inner)
        self.record(op=op, rows=rows, us=seconds * 1e6, GBps=nbytes / seconds / 1e9,
                    copy_pct=100.0 * copy / seconds,
                    vs_empty=seconds * 1e6 / getattr(self, "empty_us", float("nan")), **extra)


def pool_config(kind, layers, R, MB, N=None, kv_format="ds_fp8"):
    ratio = {C.SWA: 0, C.CSA: C.CSA_RATIO, C.HCA: C.HCA_RATIO}[kind]
    return dj.CacheConfig((ratio,) * layers, R, N or R * MB, MB, kv_format)


def with_blocks(state, R, MB):
    """Request r owns physical blocks r*MB ... r*MB + MB - 1."""
    bt = np.arange(R * MB, dtype=np.int32).reshape(R, MB)
    return dataclasses.replace(state, block_table=jnp.asarray(bt))


def random_pools(state, rng):
    """Pools filled on the device with valid random entries (not zeros):
    fp8 codes below NaN, scales near 1, normal bf16."""
    key = [jax.random.PRNGKey(int(rng.integers(1 << 30)))]

    def bits(shape):
        key[0], sub = jax.random.split(key[0])
        return jax.random.bits(sub, shape, jnp.uint8)

    def fill(x):
        if x.size == 0:
            return x
        if x.dtype == jnp.float8_e4m3fn:
            return jax.lax.bitcast_convert_type(bits(x.shape) % jnp.uint8(0x7e), x.dtype)
        if x.dtype == jnp.float8_e8m0fnu:
            return jax.lax.bitcast_convert_type(jnp.uint8(120) + bits(x.shape) % jnp.uint8(10),
                                                x.dtype)
        if x.dtype == jnp.bfloat16:
            key[0], sub = jax.random.split(key[0])
            return jax.random.normal(sub, x.shape, jnp.bfloat16)
        return x
    kv = jax.tree_util.tree_map(fill, state.swa.kv)
    csa = dataclasses.replace(state.csa, kv=jax.tree_util.tree_map(fill, state.csa.kv))
    hca = dataclasses.replace(state.hca, kv=jax.tree_util.tree_map(fill, state.hca.kv))
    return dataclasses.replace(state, swa=dataclasses.replace(state.swa, kv=kv), csa=csa, hca=hca)


def inner_layers(rows):
    """Op calls per timed jit call: many for small ops, one for large ones."""
    return 64 if rows <= 256 else (16 if rows <= 4096 else 4)


# ---- per-op benchmarks ---------------------------------------------------------------------------
def bench_append(b, rows_list, fmt):
    for T in rows_list:
        R = T if T <= 64 else max(64, T // 128)
        per = -(-T // R)
        L = inner_layers(T)
        cfg = pool_config(C.SWA, L, R, 64, kv_format=fmt)
        slot = np.repeat(np.arange(R, dtype=np.int32), per)[:T]
        base = b.rng.integers(0, 4000, R).astype(np.int32)
        pos = (base[slot] + np.tile(np.arange(per, dtype=np.int32), R)[:T]).astype(np.int32)
        meta = dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(R, np.int32))
        sets = 2
        kvs = [[jnp.asarray(b.rng.normal(0, 1, (T, C.HEAD_DIM)), jnp.bfloat16) for _ in range(L)]
               for _ in range(sets)]
        states = [dj.init_state(cfg) for _ in range(sets)]

        def body(s, kv, impl):
            for layer in range(L):
                s = dj.append(s, layer, meta, kv[layer], impl=impl)
            return s
        for impl in (b.impl, "reference") if b.args.with_reference else (b.impl,):
            f = jax.jit(body, donate_argnums=0, static_argnums=2)

            def call(i, f=f, impl=impl):
                states[i % sets] = f(states[i % sets], kvs[i % sets], impl)
                return states[i % sets]
            s = time_it(call, sets, b.args.batch, b.args.reps) / L
            nbytes = T * (ROW + ENTRY_BYTES[fmt] + 4 + 8)
            b.op_row("append", T, s, nbytes, inner=L, impl=impl, fmt=fmt)
        del states


def bench_gather_window(b, rows_list, fmt):
    for rows in rows_list:
        B = max(1, rows // C.WINDOW)
        if rows < C.WINDOW and rows != 1:
            continue  # a window is 128 rows: 1 request stands for the small sizes
        L = inner_layers(B * C.WINDOW)
        R = B
        cfg = pool_config(C.SWA, L, R, 64, kv_format=fmt)
        sets = 2
        states = []
        for _ in range(sets):
            st = random_pools(dj.init_state(cfg), b.rng)
            st = dataclasses.replace(st, swa=dataclasses.replace(
                st.swa, pos=jnp.asarray(b.rng.integers(0, 4096, (L, R, C.WINDOW)), jnp.int32)))
            states.append(st)
        slots = jnp.asarray(b.rng.permutation(R).astype(np.int32))
        for impl in (b.impl, "reference") if b.args.with_reference else (b.impl,):
            f = jax.jit(lambda s, impl=impl: [dj.gather_window(s, l, slots, impl=impl)
                                              for l in range(L)])
            s = time_it(lambda i, f=f: f(states[i % sets]), sets, b.args.batch, b.args.reps) / L
            n = B * C.WINDOW
            nbytes = n * (ENTRY_BYTES[fmt] + 4 + ROW + 4)
            b.op_row("gather_window", n, s, nbytes, inner=L, impl=impl, fmt=fmt, B=B)


def bench_gather_topk(b, rows_list, fmt):
    for rows in rows_list:
        K = min(rows, 512)
        T = max(1, rows // K)
        L = inner_layers(rows)
        ctx = 4096
        MB = ctx // C.BLOCK_TOKENS
        R = T
        cfg = pool_config(C.CSA, L, R, MB, kv_format=fmt)
        sets = 2
        states = [with_blocks(random_pools(dj.init_state(cfg), b.rng), R, MB) for _ in range(sets)]
        slot = jnp.arange(T, dtype=jnp.int32)
        pos = jnp.full((T,), ctx - 1, jnp.int32)
        idx = jnp.asarray(np.stack([b.rng.choice(ctx // C.CSA_RATIO, K, replace=False)
                                    for _ in range(T)]).astype(np.int32))
        for impl in (b.impl, "reference") if b.args.with_reference else (b.impl,):
            f = jax.jit(lambda s, impl=impl: [dj.gather_topk(s, l, slot, pos, idx, impl=impl)
                                              for l in range(L)])
            s = time_it(lambda i, f=f: f(states[i % sets]), sets, b.args.batch, b.args.reps) / L
            n = T * K
            nbytes = n * (ENTRY_BYTES[fmt] + 4 + ROW + 1)
            b.op_row("gather_topk", n, s, nbytes, inner=L, impl=impl, fmt=fmt, T=T, k=K)


def bench_gather_all(b, rows_list, fmt):
    for rows in rows_list:
        E = min(rows, 32)
        B = max(1, rows // E)
        L = inner_layers(rows)
        MB = E
        R = B
        cfg = pool_config(C.HCA, L, R, MB, kv_format=fmt)
        sets = 2
        states = [with_blocks(random_pools(dj.init_state(cfg), b.rng), R, MB) for _ in range(sets)]
        slots = jnp.arange(B, dtype=jnp.int32)
        lengths = jnp.full((B,), E * C.HCA_RATIO, jnp.int32)
        for impl in (b.impl, "reference") if b.args.with_reference else (b.impl,):
            f = jax.jit(lambda s, impl=impl: [dj.gather_all(s, l, slots, lengths, E, impl=impl)
                                              for l in range(L)])
            s = time_it(lambda i, f=f: f(states[i % sets]), sets, b.args.batch, b.args.reps) / L
            n = B * E
            nbytes = n * (ENTRY_BYTES[fmt] + 4 + ROW)
            b.op_row("gather_all", n, s, nbytes, inner=L, impl=impl, fmt=fmt, B=B, E=E)


def flush_params(kind, rng):
    inv = jnp.asarray(dj.yarn_inv_freq())

    def one(m, w, d):
        return dj.CompressorParams(jnp.asarray(rng.normal(0, .5, (m, w)), jnp.float32),
                                   jnp.asarray(rng.uniform(.5, 1.5, d), jnp.float32), inv)
    if kind == C.CSA:
        return dataclasses.replace(one(4, 1024, 512), index=one(4, 256, 128))
    return one(128, 512, 512)


def bench_flush(b, kind, cases, fmt):
    rng = b.rng
    params = flush_params(kind, rng)
    for label, B, per in cases:  # B requests x `per` tokens each
        T = B * per
        MB = 32  # 4096 tokens of context
        L = min(inner_layers(T), 16)
        cfg = pool_config(kind, L, B, MB, kv_format=fmt)
        sets = 2
        states = [with_blocks(dj.init_state(cfg), B, MB) for _ in range(sets)]
        slot = np.repeat(np.arange(B, dtype=np.int32), per)
        # decode: the token that closes a window (position 4095); prefill: 0..T-1
        pos = (np.full(T, 4095, np.int32) if per == 1
               else np.tile(np.arange(per, dtype=np.int32), B))
        meta = dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(B, np.int32))
        w = 2 * C.HEAD_DIM if kind == C.CSA else C.HEAD_DIM
        xs = [dict(kv=jnp.asarray(rng.normal(0, 1, (T, w)), jnp.float32),
                   sc=jnp.asarray(rng.normal(0, 1, (T, w)), jnp.float32),
                   ikv=jnp.asarray(rng.normal(0, 1, (T, 256)), jnp.float32),
                   isc=jnp.asarray(rng.normal(0, 1, (T, 256)), jnp.float32)) for _ in range(sets)]

        def body(s, x, impl):
            for layer in range(L):
                extra = dict(index_kv=x["ikv"], index_score=x["isc"]) if kind == C.CSA else {}
                s = dj.flush(s, layer, meta, x["kv"], x["sc"], params, impl=impl, **extra)
            return s
        for impl in (b.impl, "reference") if b.args.with_reference else (b.impl,):
            f = jax.jit(body, donate_argnums=0, static_argnums=2)

            def call(i, f=f, impl=impl):
                states[i % sets] = f(states[i % sets], xs[i % sets], impl)
                return states[i % sets]
            s = time_it(call, sets, b.args.batch, max(3, b.args.reps // 2)) / L
            b.record(op=f"flush_{kind}", case=label, T=T, us=s * 1e6, impl=impl, fmt=fmt,
                     vs_empty=s * 1e6 / getattr(b, "empty_us", float("nan")))


# ---- the V4-Flash decode step ---------------------------------------------------------------
def bench_flash_step(b, batches, ctx, fmt):
    rng = b.rng
    for B in batches:
        cfg = dj.CacheConfig.flash(max_requests=B, max_context=ctx, kv_format=fmt)
        MB = cfg.max_blocks_per_request
        kinds = cfg.layer_kinds
        pc, ph = flush_params(C.CSA, rng), flush_params(C.HCA, rng)
        slot = np.arange(B, dtype=np.int32)
        pos = np.full(B, ctx - 1, np.int32)  # a decode token at 4k context; closes windows
        meta = dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.full(B, ctx, np.int32))
        x = dict(kv=jnp.asarray(rng.normal(0, 1, (B, 512)), jnp.bfloat16),
                 ckv=jnp.asarray(rng.normal(0, 1, (B, 1024)), jnp.float32),
                 csc=jnp.asarray(rng.normal(0, 1, (B, 1024)), jnp.float32),
                 hkv=jnp.asarray(rng.normal(0, 1, (B, 512)), jnp.float32),
                 hsc=jnp.asarray(rng.normal(0, 1, (B, 512)), jnp.float32),
                 ikv=jnp.asarray(rng.normal(0, 1, (B, 256)), jnp.float32),
                 isc=jnp.asarray(rng.normal(0, 1, (B, 256)), jnp.float32))
        slots = jnp.asarray(slot)
        lengths = jnp.full((B,), ctx, jnp.int32)
        k = min(cfg.index_topk, ctx // C.CSA_RATIO)
        idx = jnp.asarray(np.stack([rng.choice(ctx // C.CSA_RATIO, k, replace=False)
                                    for _ in range(B)]).astype(np.int32))
        tslot, tpos = jnp.asarray(slot), jnp.asarray(pos)

        def layer_work(s, layer, kind, impl):
            s = dj.append(s, layer, meta, x["kv"], impl=impl)
            if kind == C.CSA:
                s = dj.flush(s, layer, meta, x["ckv"], x["csc"], pc, index_kv=x["ikv"],
                             index_score=x["isc"], impl=impl)
            elif kind == C.HCA:
                s = dj.flush(s, layer, meta, x["hkv"], x["hsc"], ph, impl=impl)
            out = [dj.gather_window(s, layer, slots, impl=impl)]
            if kind == C.CSA:
                out.append(dj.gather_topk(s, layer, tslot, tpos, idx, impl=impl))
            elif kind == C.HCA:
                out.append(dj.gather_all(s, layer, slots, lengths, ctx // C.HCA_RATIO, impl=impl))
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
        assert kinds[3:] == (C.HCA, C.CSA) * 20
        sets = 2
        states = [with_blocks(random_pools(dj.init_state(cfg), rng), B, MB) for _ in range(sets)]
        res = {}
        for impl in (b.impl, "reference"):
            f = jax.jit(step, donate_argnums=0, static_argnums=1)

            def call(i, f=f, impl=impl):
                states[i % sets], out = f(states[i % sets], impl)
                return states[i % sets], out
            t0 = time.perf_counter()
            jax.block_until_ready(call(0))
            compile_s = time.perf_counter() - t0
            s = time_it(call, sets, max(2, b.args.batch // 4), max(3, b.args.reps // 3), warm=1)
            res[impl] = s
            b.record(op="flash_decode_step", B=B, ctx=ctx, impl=impl, ms=s * 1e3,
                     first_call_s=compile_s, fmt=fmt)
        b.record(op="flash_decode_step", B=B, ctx=ctx, speedup=res["reference"] / res[b.impl])
        del states


def parse_list(s):
    return [int(v.replace("k", "000")) if not v.endswith("k") else int(v[:-1]) * 1024
            for v in s.split(",") if v]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = jax.default_backend() == "gpu"
    ap.add_argument("--ops", default="append,gather_window,gather_topk,gather_all,flush_csa,"
                                     "flush_hca,flash_step")
    ap.add_argument("--rows", default="1,8,64,256,4k,64k" if gpu else "1,8,64,256")
    ap.add_argument("--formats", default="ds_fp8")
    ap.add_argument("--flush-decode", default="1,8,64")
    ap.add_argument("--flush-prefill", default="4k" if gpu else "256")
    ap.add_argument("--step-batches", default="1,8,64" if gpu else "1,8")
    ap.add_argument("--step-context", type=int, default=4096 if gpu else 512)
    ap.add_argument("--reps", type=int, default=21 if gpu else 5)
    ap.add_argument("--batch", type=int, default=20 if gpu else 3)
    ap.add_argument("--with-reference", action="store_true",
                    help="also time the jnp reference per op (always done for the step)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None, metavar="JSON",
                    help="print a saved run's (--json) tables as markdown and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as fh:
            print_markdown(json.load(fh)["rows"])
        return
    b = Bench(args)
    ops = set(args.ops.split(","))
    print(f"device: {jax.devices()[0].device_kind} ({b.platform}), impl {b.impl}, "
          f"jax {jax.__version__}", flush=True)
    b.empty_call_seconds()
    rows = parse_list(args.rows)
    for fmt in args.formats.split(","):
        if "append" in ops:
            bench_append(b, rows, fmt)
        if "gather_window" in ops:
            bench_gather_window(b, rows, fmt)
        if "gather_topk" in ops:
            bench_gather_topk(b, rows, fmt)
        if "gather_all" in ops:
            bench_gather_all(b, rows, fmt)
        cases = [(f"decode B={n}", n, 1) for n in parse_list(args.flush_decode)]
        cases += [(f"prefill T={n}", 1, n) for n in parse_list(args.flush_prefill)]
        for kind in (C.CSA, C.HCA):
            if f"flush_{kind}" in ops:
                bench_flush(b, kind, cases, fmt)
        if "flash_step" in ops:
            bench_flash_step(b, parse_list(args.step_batches), args.step_context, fmt)
    print_table(b)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "platform": b.platform,
                       "jax": jax.__version__, "rows": b.rows}, fh, indent=1)


def print_table(b):
    print("\n== summary")
    print(f"{'op':<18} {'size':<16} {'impl':<9} {'time':>10} {'GB/s':>8} {'%copy':>6} {'x empty':>8}")
    for r in b.rows:
        if r["op"] == "empty":
            print(f"{'empty':<18} {r['what']:<16} {'':<9} {r['us']:>8.2f}us")
            continue
        size = (r.get("case") or (f"B={r['B']}" if "ms" in r or "speedup" in r else None)
                or f"{r.get('rows')} rows")
        if "speedup" in r:
            print(f"{r['op']:<18} {size:<16} {'speedup':<9} {r['speedup']:>9.1f}x")
            continue
        t = f"{r['ms']:.3f}ms" if "ms" in r else f"{r['us']:.2f}us"
        gb = f"{r['GBps']:.0f}" if "GBps" in r else ""
        cp = f"{r['copy_pct']:.0f}" if "copy_pct" in r else ""
        ve = f"{r['vs_empty']:.2f}" if "vs_empty" in r else ""
        print(f"{r['op']:<18} {size:<16} {r['impl']:<9} {t:>10} {gb:>8} {cp:>6} {ve:>8}")


COPY_TBPS = 3.0   # device-to-device copy rate of the lent H100s (KINDS.md), bytes read + written


def size_label(r):
    """The size column: rows and what made them, or the flush case."""
    if "case" in r:
        return r["case"] if f"T={r['T']}" in r["case"] else f"{r['case']} T={r['T']}"
    made = ", ".join(f"{k}={r[k]}" for k in ("B", "T", "k", "E") if k in r)
    return f"{r['rows']} rows" + (f" ({made})" if made else "")


def print_markdown(rows):
    """The per-op table and the decode-step table of benchmarks/RESULTS.md."""
    print(f"| op | size | µs / call | GB/s | % of in-run XOR | % of {COPY_TBPS:.1f} TB/s "
          "| × empty FFI call |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["op"] == "empty":
            print(f"| empty FFI call | | {r['us']:.2f} | | | | 1.0 |")
        elif "us" in r:
            gb = f"{r['GBps']:.0f}" if "GBps" in r else ""
            cp = f"{r['copy_pct']:.0f}" if "copy_pct" in r else ""
            share = f"{r['GBps'] / (10 * COPY_TBPS):.0f}" if "GBps" in r else ""
            print(f"| {r['op']} | {size_label(r)} | {r['us']:.2f} | {gb} | {cp} | {share} "
                  f"| {r['vs_empty']:.1f} |")
    steps = {}
    for r in rows:
        if r["op"] == "flash_decode_step":
            steps.setdefault(r["B"], {}).update(
                {r["impl"]: r["ms"]} if "impl" in r else {"speedup": r["speedup"]})
    if steps:
        print("\n| B | cuda ms/step | reference ms/step | speedup |")
        print("|---:|---:|---:|---:|")
        for B, v in sorted(steps.items()):
            print(f"| {B} | {v.get('cuda', float('nan')):.3f} | "
                  f"{v.get('reference', float('nan')):.3f} | {v.get('speedup', float('nan')):.1f}× |")


if __name__ == "__main__":
    main()
