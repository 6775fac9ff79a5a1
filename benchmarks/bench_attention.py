"""Benchmark of `attention`: V4-Flash decode shapes (H = 64, top-k
512, window 128) on a CSA and an HCA layer at B requests x context, and a
prefill chunk, each against the same work done as today's path in the same
run: gather_window + gather_topk / gather_all + jax.nn.dot_product_attention
(decode), the jnp reference (prefill: gathers + dense attention).
`--kv-format bf16` times bf16 pools, which hold nothing to dequantize.

Per case: microseconds per call, on a GPU from its own timeline (`dev_us`:
the span of one call's kernels, dispatch left out; `us`, host-timed, beside
it), elsewhere host-timed; bytes read (entries visited x 583 + q + out)
against the device copy rate (on a GPU one `x + 1` kernel's rate on the
timeline, elsewhere BenchRun's host-timed copy of the same bytes); FLOPs
(4 * H * 512 per entry visited: QK and PV) against the tensor-core peak
given (--peak-tflops, an H100 SXM's dense bf16 by default).

    python benchmarks/bench_attention.py --json attention.json
    python benchmarks/bench_attention.py --quick          # CPU-sized smoke run
"""
from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import config as C
from dsv4_jax.app.arguments import output_path
from dsv4_jax.app.bench.device_timeline import device_time
from dsv4_jax.app.bench.filled_state import filled_state
from dsv4_jax.app.bench.inputs import entry_bytes
from dsv4_jax.app.bench.timing import BenchRun, Settings
from dsv4_jax.config import CacheConfig
from dsv4_jax.ops.attention import attention
from dsv4_jax.ops.gather import gather_all, gather_topk, gather_window
from dsv4_jax.params import yarn_inv_freq

from device import copy_bandwidth

H100_BF16_TFLOPS = 989.0                  # dense bf16 tensor-core peak, H100 SXM
LAYER = {"csa": 1, "hca": 2}              # in the (SWA, CSA, HCA, CSA) test pattern


def _inputs(rng, T, H, k, pos):
    q = rng.standard_normal((T, H, C.HEAD_DIM)).astype(np.float32)
    q /= np.sqrt(np.mean(q * q, axis=-1, keepdims=True))
    picks = np.full((T, k), -1, np.int32)
    for t, p in enumerate(pos):
        n = (int(p) + 1) // C.CSA_RATIO
        take = rng.choice(n, size=min(k, n), replace=False)
        picks[t, :len(take)] = take
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(picks),
            jnp.asarray(rng.normal(0, 1, H), jnp.float32))


def baseline(state, layer, kind, q, slot, pos, sink, topk, inv_freq, max_entries):
    """Today's path: dense gathers, then jax.nn.dot_product_attention over
    window + entries + one zero row whose bias is the sink (K = V, one KV
    head), then the inverse RoPE of the output."""
    win, wpos = gather_window(state, layer, slot, return_state=False)
    ok = (wpos >= 0) & (wpos <= pos[:, None]) & (wpos > pos[:, None] - C.WINDOW)
    if kind == "csa":
        comp, comp_ok = gather_topk(state, layer, slot, pos, topk, return_state=False)
    else:
        length = jnp.where(slot >= 0, pos + 1, 0)
        comp, count = gather_all(state, layer, slot, length, max_entries, return_state=False)
        comp_ok = jnp.arange(comp.shape[1])[None, :] < count[:, None]
    T, H = q.shape[:2]
    zero = jnp.zeros((T, 1, C.HEAD_DIM), jnp.bfloat16)
    kv = jnp.concatenate([win, comp, zero], axis=1)[:, :, None, :]          # [T, S, 1, 512]
    seen = jnp.concatenate([ok, comp_ok, jnp.ones((T, 1), bool)], axis=1)
    S = kv.shape[1]
    bias = jnp.zeros((T, H, 1, S), jnp.float32).at[:, :, 0, -1].set(sink[None, :])
    out = jax.nn.dot_product_attention(q[:, None], kv, kv, bias=bias.astype(jnp.bfloat16),
                                       mask=seen[:, None, None, :])[:, 0]
    o = out[..., C.NOPE_DIM:].astype(jnp.float32).reshape(T, H, C.ROPE_DIM // 2, 2)
    ang = pos.astype(jnp.float32)[:, None, None] * inv_freq[None, None, :]
    c, s = jnp.cos(ang), jnp.sin(ang)
    a, b = o[..., 0], o[..., 1]
    rope = jnp.stack([a * c + b * s, b * c - a * s], -1).reshape(T, H, C.ROPE_DIM)
    return jnp.concatenate([out[..., :C.NOPE_DIM], rope.astype(jnp.bfloat16)], axis=-1)


def _rel_diff(got, want):
    """Largest |got - want| over the largest |want|: the two paths computed
    the same thing (bf16 outputs: a few 2^-9 at most)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _timed(b, call):
    """(µs the rates use, host µs, device µs or None): one call's span on
    the GPU's timeline where there is one (dispatch is not the op's cost),
    else the host time."""
    host = b.time(lambda i: call(), 1) * 1e6
    dev = device_time(call, b.settings.reps)
    dev_us = dev["us"] if dev else None
    return (dev_us if dev_us else host), host, dev_us


def _copy_rate(b):
    """Bytes read + written a second: one kernel's on the GPU's timeline,
    measured once a run; None elsewhere (BenchRun's host-timed copy then)."""
    if b.platform != "gpu":
        return None
    if not hasattr(b, "timeline_copy_Bps"):
        b.timeline_copy_Bps = copy_bandwidth()
    return b.timeline_copy_Bps


def _row(b, case, us, visited, T, H, nbytes):
    """Rates of a case timed at `us`; `nbytes` is what the copy reference moves."""
    read = visited * entry_bytes(case["kv_format"]) + 2 * T * H * C.HEAD_DIM * 2
    flops = 4.0 * H * C.HEAD_DIM * visited
    rate = _copy_rate(b)
    copy_us = 2 * nbytes / rate * 1e6 if rate else b.copy_seconds(nbytes) * 1e6
    return dict(case, us=us, bytes_read=read, gbps=read / us / 1e3,
                copy_frac=copy_us / us, tflops=flops / us / 1e6)


def bench_decode(b, batches, contexts, kinds, H, k, peak, with_baseline=True, kernel="auto",
                 kv_format="ds_fp8"):
    rng = np.random.default_rng(0)
    inv = jnp.asarray(yarn_inv_freq())
    for ctx in contexts:
        for B in batches:
            cfg = CacheConfig.tiny(max_requests=B, max_context=ctx, kv_format=kv_format)
            state = filled_state(cfg, ctx)
            slot = jnp.arange(B, dtype=jnp.int32)
            pos = jnp.full((B,), ctx - 1, jnp.int32)
            q, topk, sink = _inputs(rng, B, H, k, np.full(B, ctx - 1))
            for kind in kinds:
                layer = LAYER[kind]
                tk = topk if kind == "csa" else None
                # slot, pos and sink are arguments: captured, XLA would rebuild
                # them as iota / broadcast kernels inside the timed span
                fused = jax.jit(lambda st, q_, tk_, sl, ps, sk: attention(
                    st, layer, q_, sl, ps, sink=sk, topk=tk_, rope_inv_freq=inv,
                    kernel=kernel, return_state=False))
                base = jax.jit(lambda st, q_, tk_, sl, ps, sk: baseline(
                    st, layer, kind, q_, sl, ps, sk, tk_, inv, cfg.max_blocks_per_request))
                args = (state, q, tk, slot, pos, sink)
                visited = B * (C.WINDOW + (k if kind == "csa" else ctx // C.HCA_RATIO))
                us, host_us, dev_us = _timed(b, lambda: fused(*args))
                nbytes = visited * entry_bytes(kv_format) + 2 * B * H * C.HEAD_DIM * 2
                row = _row(b, dict(op="attention", mode="decode", kind=kind, B=B, context=ctx,
                                   kernel=kernel, kv_format=kv_format), us, visited, B, H,
                           nbytes)
                row.update(peak_frac=row["tflops"] / peak, host_us=host_us, dev_us=dev_us)
                if with_baseline:
                    base_us, base_host_us, base_dev_us = _timed(b, lambda: base(*args))
                    row.update(baseline_us=base_us, speedup=base_us / us,
                               baseline_host_us=base_host_us, baseline_dev_us=base_dev_us,
                               rel_diff=_rel_diff(fused(*args)[0], base(*args)))
                b.record(**row)
            del state


def bench_prefill(b, n, kinds, H, k, peak, with_baseline=True, kernel="auto", kv_format="ds_fp8"):
    """One request's first chunk of n tokens (flushed entries for all of it)."""
    rng = np.random.default_rng(1)
    inv = jnp.asarray(yarn_inv_freq())
    cfg = CacheConfig.tiny(max_requests=1, max_context=n, kv_format=kv_format)
    state = filled_state(cfg, n)
    state = state.__class__(state.block_table, state.swa.__class__(
        state.swa.kv, jnp.full_like(state.swa.pos, -1)), state.csa, state.hca, state.errors,
        state.config)                                 # the ring before a first chunk is empty
    slot = jnp.zeros((n,), jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    q, topk, sink = _inputs(rng, n, H, k, np.arange(n))
    chunk = jnp.asarray(rng.standard_normal((n, C.HEAD_DIM)), jnp.bfloat16)
    for kind in kinds:
        layer = LAYER[kind]
        tk = topk if kind == "csa" else None
        calls = {impl: jax.jit(lambda st, q_, tk_, ck, sl, ps, sk, impl=impl: attention(
            st, layer, q_, sl, ps, sink=sk, topk=tk_, chunk_kv=ck, rope_inv_freq=inv,
            impl=impl, kernel=kernel, return_state=False))
            for impl in (("auto", "reference") if with_baseline else ("auto",))}
        args = (state, q, tk, chunk, slot, pos, sink)     # not captured: see bench_decode
        us, host_us, dev_us = _timed(b, lambda: calls["auto"](*args))
        p = np.arange(n)
        comp = np.minimum((p + 1) // 4, k) if kind == "csa" else (p + 1) // C.HCA_RATIO
        visited = int(np.sum(np.minimum(p + 1, C.WINDOW) + comp))
        row = _row(b, dict(op="attention", mode="prefill", kind=kind, B=1, context=n,
                           kernel=kernel, kv_format=kv_format), us, visited, n, H,
                   visited * entry_bytes(kv_format) + 4 * n * H * C.HEAD_DIM)
        row.update(peak_frac=row["tflops"] / peak, host_us=host_us, dev_us=dev_us)
        if with_baseline:
            ref_us, ref_host_us, ref_dev_us = _timed(b, lambda: calls["reference"](*args))
            row.update(baseline_us=ref_us, speedup=ref_us / us, baseline_host_us=ref_host_us,
                       baseline_dev_us=ref_dev_us,
                       rel_diff=_rel_diff(calls["auto"](*args)[0], calls["reference"](*args)[0]))
        b.record(**row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized shapes (a smoke run)")
    ap.add_argument("--json", type=output_path, help="write the rows to this file")
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-baseline", action="store_true",
                    help="time attention alone (no gathers + dense path, no jnp reference)")
    ap.add_argument("--batches", type=lambda v: tuple(int(x) for x in v.split(",")),
                    default=(1, 8, 64, 128), help="decode batch sizes (default 1,8,64,128)")
    ap.add_argument("--contexts", type=lambda v: tuple(int(x) for x in v.split(",")),
                    default=(4096, 65536),
                    help="decode contexts (default 4096,65536; 1048576: 1M tokens, CSA 512 "
                         "picks among 262,144 entries, HCA all 8,192)")
    ap.add_argument("--no-prefill", action="store_true", help="decode cases only")
    ap.add_argument("--kernel", choices=("auto", "mma_sync"), default="auto",
                    help="the CUDA kernel (attention's `kernel`): auto, or the warp-level "
                         "mma.sync one Blackwell runs")
    ap.add_argument("--kv-format", choices=C.KV_FORMATS, default="ds_fp8",
                    help="the pools' entry format (bf16: nothing to dequantize)")
    args = ap.parse_args(argv)
    base = not args.no_baseline
    if args.quick:
        b = BenchRun(Settings(reps=args.reps or 2, batch=1, with_reference=False))
        bench_decode(b, (1, 2), (512,), ("csa", "hca"), H=4, k=16, peak=args.peak_tflops,
                     with_baseline=base, kernel=args.kernel, kv_format=args.kv_format)
        bench_prefill(b, 256, ("csa", "hca"), H=4, k=16, peak=args.peak_tflops,
                      with_baseline=base, kernel=args.kernel, kv_format=args.kv_format)
    else:
        b = BenchRun(Settings(reps=args.reps or 20, batch=10, with_reference=False))
        bench_decode(b, args.batches, args.contexts, ("csa", "hca"), H=64, k=512,
                     peak=args.peak_tflops, with_baseline=base, kernel=args.kernel,
                     kv_format=args.kv_format)
        if not args.no_prefill:
            bench_prefill(b, 4096, ("csa", "hca"), H=64, k=512, peak=args.peak_tflops,
                          with_baseline=base, kernel=args.kernel, kv_format=args.kv_format)
    rate = _copy_rate(b)
    b.record(op="copy", gbps=rate / 1e9 if rate else b.copy_gbps,
             timeline=rate is not None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": b.platform, "rows": b.rows}, f, indent=1,
                      default=lambda v: v if not isinstance(v, float) or math.isfinite(v) else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
