"""Benchmark of indexer_topk on the GPU: B decode tokens (one per request, each
at the last position of its context) over the MXFP4 keys of one CSA layer.

For each case: microseconds per call on the device, the bytes-moved floor
(every visible key read once, 68 B each, plus q and the output) over the
measured copy bandwidth, and the fp32 arithmetic floor (8192 multiplies +
8192 adds per entry and token, 128 lanes per SM).

Per-call time: one jitted, unrolled loop of `--calls` calls (the state
carried from call to call, as a decode loop carries it) runs under the
profiler, and a call's time is the median time from one score kernel's start
to the next on the GPU's own timeline (CUPTI, device_timeline.py):
everything the op does on the device, gaps included, none of the host's
dispatch (host-timed loops carry a share of the dispatch that varies with
the loop's length). From the same timeline, medians over the calls: `score`
(the score kernel's duration), `tail` (the select's end less the score
kernel's end: the select overlaps the score's last CTAs) and `span` (score
start to select end: one call alone). `w/ disp` is one loop's host time over its calls, the
median of `--repeats` runs. The copy bandwidth behind the floor is device
time too: one kernel reading and writing 1 GiB. With `--impl cpu` (a smoke
run) host times stand in.

    python benchmarks/bench_indexer.py [--json PATH] [--contexts 8192 65536 1048576]
    python benchmarks/bench_indexer.py --rows-per-request 4 --rows-hint 1 4   # verify rows

With `--rows-per-request G` a request holds G rows (a verify step's 1 +
drafts), timed with indexer_topk's rows_per_request at each `--rows-hint`
(default G; 1 asks for a CTA a row): whether grouping a request's rows in one
CTA pays at each size (launch_policy.h's RowsPerCta).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import CacheConfig, IndexerKeys, indexer_topk, init_state
from dsv4_jax.app.bench.device_timeline import kernel_events, two_kernel_phases
from dsv4_jax.app.arguments import output_path
from device import copy_bandwidth

KEY_BYTES = 68


KEY_KINDS = ("quantized", "random-scales")


def key_scales(key, shape, kind):
    """Scale bytes [..., 4] of the keys. "quantized": those MXFP4 rounding
    gives Gaussian keys (as after the Hadamard rotation) whose size varies by
    2^-2 .. 2^2 from entry to entry: a block's byte is 127 + ceil(log2(amax /
    6)) of its 32 values, so the four blocks of a key land within a byte or
    two of each other. "random-scales": every byte drawn from 120..131 on its
    own, which real keys do not do; it puts most tiles on the per-block path
    of the CUDA kernel (dsv4/indexer.h, the fast form's guards)."""
    k1, k2 = jax.random.split(key)
    if kind == "random-scales":
        return jax.random.randint(k1, shape, 120, 132, jnp.int32).astype(jnp.uint8)
    size = jnp.exp2(jax.random.uniform(k1, shape[:-1] + (1,), jnp.float32, -2.0, 2.0))
    amax = jnp.zeros(shape, jnp.float32)
    for _ in range(32):    # a running max keeps the temporaries at the pool's size
        k2, k = jax.random.split(k2)
        amax = jnp.maximum(amax, jnp.abs(jax.random.normal(k, shape, jnp.float32)))
    return (127 + jnp.ceil(jnp.log2(amax * size / 6))).astype(jnp.uint8)


def make_state(B, ctx, seed=0, keys="quantized"):
    cfg = CacheConfig.tiny(max_requests=B, max_context=ctx)
    st = init_state(cfg)
    Lc, N = st.csa.index.packed.shape[:2]
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    packed = jax.random.bits(k1, (Lc, N, 32, 64), jnp.uint8)
    scale = jax.jit(key_scales, static_argnums=(1, 2))(k2, (Lc, N, 32, 4), keys)
    scale = jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu)
    MB = cfg.max_blocks_per_request
    bt = jax.random.permutation(k3, N)[:B * MB].reshape(B, MB).astype(jnp.int32)
    csa = dataclasses.replace(st.csa, index=IndexerKeys(packed, scale))
    return dataclasses.replace(st, block_table=bt, csa=csa)


def decode_loop(slot, pos, k, calls, impl="cuda", q_format="mxfp4", rows_per_request=1):
    """jitted (state, q, w) -> scalar: `calls` indexer_topk calls as a decode
    loop makes them, the state carried from call to call (its error counts
    updated in place, which also keeps every call alive), one q and w
    (slicing a stack of them would add a copy a call). Unrolled: a rolled
    scan adds a device-to-host loop test per call."""
    T = slot.shape[0]

    @jax.jit
    def run(st, q, w):
        def body(c, _):
            s, _ = c
            idx, s = indexer_topk(s, 1, slot, pos, q, w, k, impl=impl, q_format=q_format,
                                    rows_per_request=rows_per_request, return_state=True)
            return (s, idx), None
        s, idx = jax.lax.scan(body, (st, jnp.zeros((T, k), jnp.int32)), None, length=calls,
                              unroll=True)[0]
        return idx[:, 0].sum() + s.errors.sum()
    return run


def bench(B, ctx, k, calls, repeats, bw, lane_rate, impl="cuda", q_format="bf16",
          keys="quantized", rows=1, rows_hint=None):
    """`rows` rows a request (a verify step's 1 + k: positions ctx - rows ..
    ctx - 1, kept together), passed as rows_per_request `rows_hint` (default
    `rows`; 1 asks for a CTA a row)."""
    st = make_state(B, ctx, keys=keys)
    rng = np.random.default_rng(1)
    T = B * rows
    slot = jnp.repeat(jnp.arange(B, dtype=jnp.int32), rows)
    pos = jnp.tile(jnp.arange(ctx - rows, ctx, dtype=jnp.int32), B)
    q = jnp.asarray(rng.standard_normal((T, 64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((T, 64)), jnp.float32)
    hint = rows if rows_hint is None else rows_hint

    run = decode_loop(slot, pos, k, calls, impl=impl, q_format=q_format, rows_per_request=hint)
    run(st, q, w).block_until_ready()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(st, q, w).block_until_ready()
        ts.append(time.perf_counter() - t0)
    us_per_exec = statistics.median(ts) / calls * 1e6
    phases = (two_kernel_phases(kernel_events(run, st, q, w), "ScoreKernel", "SelectKernel")
              if impl == "cuda" else {})
    period = phases.get("period_us")
    us = period if period is not None else us_per_exec
    entries = ctx // 4
    # every visible key once a request (its rows can share the read)
    nbytes = B * entries * KEY_BYTES + T * (64 * 128 * 2 + 64 * 4 + k * 4)
    floor_bytes_us = nbytes / bw * 1e6
    floor_ops_us = T * entries * 8192 * 2 / lane_rate * 1e6
    del st
    return dict(B=B, context=ctx, k=k, q_format=q_format, keys=keys, rows=rows,
                rows_hint=hint, us=us,
                score_us=phases.get("first_us"), select_tail_us=phases.get("tail_us"),
                span_us=phases.get("span_us"),
                timing="host" if period is None else "device",
                us_per_exec=us_per_exec, bytes=nbytes, floor_bytes_us=floor_bytes_us,
                ratio_bytes=us / floor_bytes_us, floor_fp32_us=floor_ops_us,
                ratio_fp32=us / floor_ops_us)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=output_path, help="write the rows here")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536, 1048576])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--impl", default="cuda", help="cuda (default) or cpu for a smoke run")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--q-formats", nargs="+", default=["mxfp4", "bf16"],
                    help="indexer_topk q_format values to time")
    ap.add_argument("--keys", nargs="+", default=["quantized"], choices=KEY_KINDS,
                    help="key scale bytes: as MXFP4 rounding of Gaussian keys gives them "
                         "(default), or each drawn on its own")
    ap.add_argument("--max-work", type=float, default=3e3,
                    help="skip cases with more than this many thousand entry-token scores "
                         "(B=64 at 1M context: 22 GB of tiny-preset pools, over an H100's memory "
                         "with the benchmark's temporaries)")
    ap.add_argument("--rows-per-request", type=int, default=1,
                    help="rows a request (a verify step: 1 + drafts), scored with "
                         "rows_per_request set to it")
    ap.add_argument("--rows-hint", type=int, nargs="+", default=None,
                    help="rows_per_request values to time instead (1: a CTA a row)")
    ap.add_argument("--sm-count", type=int, default=132)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    bw = copy_bandwidth(1 << 30 if args.impl == "cuda" else 1 << 26)
    lane_rate = args.sm_count * 128 * args.clock_ghz * 1e9
    print(f"device {dev.device_kind}; copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"fp32 lane rate {lane_rate / 1e12:.1f} T op/s (nominal)", flush=True)
    rows = []
    for ctx in args.contexts:
        for B in args.batches:
            if B * args.rows_per_request * ctx // 4 > args.max_work * 1e3:
                print(f"skip B={B} ctx={ctx}", flush=True)
                continue
            for fmt in args.q_formats:
                for keys in args.keys:
                    for hint in args.rows_hint or [args.rows_per_request]:
                        r = bench(B, ctx, args.k, args.calls, args.repeats, bw, lane_rate,
                                  args.impl, fmt, keys, args.rows_per_request, hint)
                        rows.append(r)
                        print(f"B={B:3d} ctx={ctx:8d} q={fmt:5s} keys={keys} "
                              f"rows={r['rows']}/{hint}: {r['us']:10.1f} us "
                              f"({r['us_per_exec']:.1f} us with dispatch)", flush=True)
    print()
    print(f"{'B':>4} {'rows':>5} {'context':>8} {'k':>5} {'q':>5} {'keys':>13} {'us/call':>10} "
          f"{'score':>7} "
          f"{'tail':>6} {'span':>7} {'w/ disp':>8} "
          f"{'keys MB':>8} {'floor us':>9} {'x floor':>8} {'fp32 us':>9} {'x fp32':>7}")
    num = lambda v, w: f"{v:{w}.1f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    for r in rows:
        print(f"{r['B']:4d} {r['rows']:2d}/{r['rows_hint']:<2d} {r['context']:8d} {r['k']:5d} "
              f"{r['q_format']:>5} {r['keys']:>13} "
              f"{r['us']:10.1f} {num(r['score_us'], 7)} {num(r['select_tail_us'], 6)} "
              f"{num(r['span_us'], 7)} {r['us_per_exec']:8.1f} {r['bytes'] / 1e6:8.2f} "
              f"{r['floor_bytes_us']:9.2f} {r['ratio_bytes']:8.1f} {r['floor_fp32_us']:9.1f} "
              f"{r['ratio_fp32']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev.device_kind, copy_bandwidth=bw, lane_rate=lane_rate, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
