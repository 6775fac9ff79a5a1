"""The cache work of a decode step as a model runs it, timed on the host and
read off the device's own timeline (issue 36).

A V4-Flash step (43 layers: SWA SWA CSA, then (HCA, CSA) x 20): every layer
writes its token (append, and flush on CSA/HCA layers) and reads what its
attention needs (gather_window; indexer_topk (k = 512) + gather_topk on CSA
layers; gather_all on HCA layers). Each layer reduces what it gathered into a
carried hidden state h f32[B, 512] (the masked mean of the rows: every row is
read, as attention reads it), so nothing is stacked across layers and XLA
can drop no gather. The layers run as a model writes them: the leading
layers unrolled, then `lax.scan` over the repeated (HCA, CSA) pair with a
traced layer index (one compiled body, as a 43-layer model keeps its compile
time down); `unroll` variants run every layer with a Python int index, which
shows what the traced index costs (its table lookup is a small XLA kernel
per op). One `jax.jit`, the state donated.

The state is full: every pool holds random valid entries (fp8 codes that are
no NaN, scales of unit-sized rows, indexer keys of MXFP4 codes whose four
block scales lie within a byte, as quantized keys do), every request has
`context` tokens (window positions context-129 .. context-2, its block table a random
permutation of the blocks) and the step's one token per request sits at
position context-1, which closes a CSA and an HCA window: flush's worst case.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from . import config as C
from .state import state_shapes

F32 = jnp.float32
PRESETS = {"flash": dj.CacheConfig.flash, "pro": dj.CacheConfig.pro, "tiny": dj.CacheConfig.tiny}
VARIANT_FLAGS = ("no-return-state", "fused-write", "unroll")


# ---- the device timeline ----------------------------------------------------------------------
def kernel_events(fn, runs=1):
    """[(start_ns, duration_ns, demangled name)] of the GPU activity of `runs`
    calls of fn(), sorted by start; [] without a GPU. fn runs once untraced
    first, so no compilation lands in the trace. Only the streams' lines are
    read: the profiler's "XLA Modules" / "XLA Ops" lines repeat the kernels'
    spans. (Same reading as benchmarks/device_timeline.py, kept here while
    issue 35 moves that file into the package.)"""
    from jax.profiler import ProfileData
    jax.block_until_ready(fn())
    folder = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(folder):
            for _ in range(runs):
                jax.block_until_ready(fn())
        events = []
        for root, _, files in os.walk(folder):
            for name in (f for f in files if f.endswith(".xplane.pb")):
                for plane in ProfileData.from_file(os.path.join(root, name)).planes:
                    if plane.name.startswith("/device:GPU"):
                        events += [(e.start_ns, e.duration_ns, e.name) for line in plane.lines
                                   if not line.name.startswith("XLA") for e in line.events]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return sorted(events)


def short_name(demangled):
    """GatherWindowKernel of 'dsv4::(anonymous namespace)::GatherWindowKernel(
    dsv4::(anonymous namespace)::GatherWindowArgs)': the parameter list is cut
    at the parenthesis matching the last one, not at the last '('."""
    depth, cut = 0, len(demangled)
    if demangled.endswith(")"):
        for i in range(len(demangled) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(demangled[i], 0)
            if depth == 0:
                cut = i
                break
    return demangled[:cut].split("::")[-1]


def kernel_kind(demangled):
    """"cache" (a dsv4 kernel), "copy" (memcpy / copy kernels, what XLA adds
    between calls) or "other" (the step's own XLA fusions)."""
    if "dsv4" in demangled:
        return "cache"
    return "copy" if "copy" in demangled.lower() or "memcpy" in demangled.lower() else "other"


def timeline_summary(events, steps, layers):
    """Per step, from the events of `steps` identical steps traced back to
    back: kernel counts (all, per layer, cache ops + copies per layer, copies),
    busy time (sum of durations) and span (first start to last end, the
    median over the steps), and per kernel name: kind, count, total and mean
    microseconds. Each step launches the same kernels, so the events split
    into steps by count; if they do not, the span is that of the whole trace
    over `steps` and `split` says so."""
    n = len(events)
    split = n % steps == 0
    per = n // steps if split else n
    chunks = [events[i * per:(i + 1) * per] for i in range(n // per)] if n else []
    spans = [(max(s + d for s, d, _ in c) - c[0][0]) / 1e3 for c in chunks]
    span = statistics.median(spans) if split else spans[0] / steps
    names = {}
    for _, d, raw in events:
        row = names.setdefault(short_name(raw), {"kind": kernel_kind(raw), "count": 0, "ns": 0})
        row["count"] += 1
        row["ns"] += d
    table = sorted(({"name": k, "kind": v["kind"], "count": v["count"] / steps,
                     "total_us": v["ns"] / 1e3 / steps, "mean_us": v["ns"] / 1e3 / v["count"]}
                    for k, v in names.items()), key=lambda r: -r["total_us"])
    count = {kind: sum(r["count"] for r in table if r["kind"] == kind)
             for kind in ("cache", "copy", "other")}
    return {"kernels_per_step": n / steps, "kernels_per_layer": n / steps / layers,
            "cache_kernels_per_layer": (count["cache"] + count["copy"]) / layers,
            "copy_kernels_per_step": count["copy"],
            "busy_us": sum(d for _, d, _ in events) / 1e3 / steps,
            "cache_busy_us": sum(r["total_us"] for r in table if r["kind"] != "other"),
            "span_us": span, "split": split, "kernels": table}


def host_ms(call, warm, reps, loop):
    """Median over `reps` samples of the wall time of `loop` back-to-back
    calls (closed by block_until_ready) over `loop`, after `warm` calls."""
    for _ in range(warm):
        out = call()
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(loop):
            out = call()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / loop * 1e3)
    return statistics.median(samples)


# ---- a full state -----------------------------------------------------------------------------
# The pools are filled by a counter hash rather than jax.random: one fused
# elementwise kernel per leaf that compiles in a blink (threefry over a dozen
# leaf shapes took ~30 s to compile on the CPU, and would recompile per case)
# and needs no temporaries beside its output (the 64k x 256 state is 56 GiB).
def _mix(h):
    """murmur3's 32-bit finalizer: every input bit moves every output bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash(shape, salt, axes=None):
    """u32 pseudo-random bits per element of `shape`, hashed over its
    indices along `axes` (default all): equal along the others."""
    h = jnp.full(shape, salt * 0x9E3779B1 & 0xFFFFFFFF, jnp.uint32)
    for axis in range(len(shape)) if axes is None else axes:
        h = _mix(h + jax.lax.broadcasted_iota(jnp.uint32, shape, axis))
    return h


def _unit(h):
    """[0, 1) from the top 24 bits."""
    return (h >> 8).astype(F32) * (1.0 / (1 << 24))


def _pool_leaf(name, shape, dtype, salt):
    """Valid random values of one pool leaf."""
    h = _hash(shape, salt)
    if dtype == jnp.float8_e4m3fn:   # every code but the two NaNs (S.1111.111)
        b = (h & 0xFF).astype(jnp.uint8)
        return jax.lax.bitcast_convert_type(jnp.where((b & 0x7F) == 0x7F, b - 1, b), dtype)
    if name.endswith(".index.scale"):
        # a key's four block scales within a byte of each other (122..129), as
        # MXFP4 rounding of a Gaussian key leaves them
        key = _hash(shape, salt, axes=range(len(shape) - 1))
        b = 122 + key % 7 + (h & 1)
        return jax.lax.bitcast_convert_type(b.astype(jnp.uint8), dtype)
    if dtype == jnp.float8_e8m0fnu:  # 2^-9 .. 2^-5: rows of a few units (codes reach 448)
        return jax.lax.bitcast_convert_type((118 + h % 5).astype(jnp.uint8), dtype)
    if dtype == jnp.bfloat16:
        return (4 * _unit(h) - 2).astype(dtype)
    if dtype == F32:                 # fp8_token scales: amax / 448 of unit-sized rows
        return 0.002 + 0.018 * _unit(h)
    return (h & 0xFF).astype(dtype)  # u8: packed e2m1 codes, all valid


def _accumulators(shape, salt):
    """Online-softmax accumulators (max, sum, weighted kv) on axis -2 of a
    window some tokens were folded into: finite max, sum >= 1."""
    row = shape[:-2] + (1, shape[-1])
    total = 1 + 3 * _unit(_hash(row, salt + 1))
    return jnp.concatenate([4 * _unit(_hash(row, salt)) - 2, total,
                            (4 * _unit(_hash(row, salt + 2)) - 2) * total], axis=-2)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _filled(cfg, context, seed, block_table):
    shapes, tree = jax.tree_util.tree_flatten_with_path(state_shapes(cfg))
    # ring slot j holds the one position of context-129 .. context-2 that is j mod 128
    first = context - 1 - C.WINDOW
    ring = jnp.asarray(first + (np.arange(C.WINDOW) - first) % C.WINDOW, jnp.int32)
    leaves = []
    for i, (path, x) in enumerate(shapes):
        name, salt = jax.tree_util.keystr(path), 1000 * seed + 7 * i
        if name.endswith("block_table"):
            leaves.append(block_table)
        elif name.endswith(".pos"):
            leaves.append(jnp.broadcast_to(ring, x.shape))
        elif name.endswith("errors"):
            leaves.append(jnp.zeros(x.shape, x.dtype))
        elif name.endswith("comp"):
            leaves.append(_accumulators(x.shape, salt))
        else:
            leaves.append(_pool_leaf(name, x.shape, x.dtype, salt))
    return jax.tree_util.tree_unflatten(tree, leaves)


def filled_state(cfg, context, seed=0):
    """A state whose `max_requests` requests each hold `context` tokens (the
    block table a random permutation of the blocks)."""
    R, MB = cfg.max_requests, cfg.max_blocks_per_request
    table = np.random.default_rng(seed).permutation(cfg.num_blocks)[:R * MB].reshape(R, MB)
    return _filled(cfg, context, seed, jnp.asarray(table, jnp.int32))


def step_inputs(B, context, seed=0):
    """One decode token per request at position context-1: what the model
    hands the cache (kv, compressor projections, indexer query and weights)."""
    rng = np.random.default_rng(seed)

    def normal(shape, dtype=F32):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    slot = np.arange(B, dtype=np.int32)
    pos = np.full(B, context - 1, np.int32)
    lengths = np.full(B, context, np.int32)
    return {"meta": dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=lengths),
            "slot": jnp.asarray(slot), "pos": jnp.asarray(pos), "lengths": jnp.asarray(lengths),
            "kv": normal((B, C.HEAD_DIM), jnp.bfloat16),
            "csa_kv": normal((B, 2 * C.HEAD_DIM)), "csa_score": normal((B, 2 * C.HEAD_DIM)),
            "hca_kv": normal((B, C.HEAD_DIM)), "hca_score": normal((B, C.HEAD_DIM)),
            "index_kv": normal((B, 2 * C.INDEX_DIM)), "index_score": normal((B, 2 * C.INDEX_DIM)),
            "q": normal((B, C.INDEX_HEADS, C.INDEX_DIM), jnp.bfloat16),
            "weights": normal((B, C.INDEX_HEADS)),
            "params": {C.CSA: dj.CompressorParams.neutral(C.CSA),
                       C.HCA: dj.CompressorParams.neutral(C.HCA)}}


# ---- the step ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    return_state: bool = True    # read ops hand the state (their error counts) back
    fused_write: bool = False    # dj.write_layer instead of append + flush
    unroll: bool = False         # every layer with a Python int index, no scan

    @classmethod
    def parse(cls, text):
        """"base" or flags joined by '+': no-return-state, fused-write, unroll."""
        flags = set() if text == "base" else set(text.split("+"))
        if flags - set(VARIANT_FLAGS):
            raise ValueError(f"variant {text!r}: expected 'base' or '+'-joined {VARIANT_FLAGS}")
        return cls("no-return-state" not in flags, "fused-write" in flags, "unroll" in flags)

    @property
    def name(self):
        flags = [f for f, on in zip(VARIANT_FLAGS, (not self.return_state, self.fused_write,
                                                    self.unroll)) if on]
        return "+".join(flags) or "base"


def layer_plan(kinds):
    """(prefix, unit, repeats): kinds = kinds[:prefix] + unit * repeats with
    unit the last two kinds repeated as often as the tail allows."""
    unit, n, L = tuple(kinds[-2:]), 0, len(kinds)
    while 2 * (n + 1) <= L and tuple(kinds[L - 2 * (n + 1):L - 2 * n]) == unit:
        n += 1
    return L - 2 * n, unit, n


def attend(h, rows, mask):
    """h plus the mean of the visible rows: a stand-in for attention that
    reads every gathered row under its mask."""
    w = mask.astype(F32)
    w = w / jnp.maximum(w.sum(axis=1, keepdims=True), 1.0)
    return h + jnp.sum(rows.astype(F32) * w[..., None], axis=1)


def make_step(cfg, context, variant, impl="auto"):
    """jitted (state, inputs) -> (state, h): one decode step's cache work."""
    write_layer = getattr(dj, "write_layer", None)
    if variant.fused_write and write_layer is None:
        raise NotImplementedError("dj.write_layer does not exist in this checkout")
    k = cfg.index_topk
    entries = context // C.HCA_RATIO

    def read(op, s, *args):
        if variant.return_state:
            *outs, s = op(s, *args, impl=impl, return_state=True)
            return s, outs
        outs = op(s, *args, impl=impl)
        return s, list(outs) if isinstance(outs, tuple) else [outs]

    def write(s, layer, kind, x):
        comp = {C.CSA: ("csa_kv", "csa_score"), C.HCA: ("hca_kv", "hca_score")}.get(kind)
        comp = (x[comp[0]], x[comp[1]], x["params"][kind]) if comp else ()
        index = ({"index_kv": x["index_kv"], "index_score": x["index_score"]}
                 if kind == C.CSA else {})
        if variant.fused_write:   # its own default impl: the planned signature has no impl
            return write_layer(s, layer, x["meta"], x["kv"], *comp, **index)
        s = dj.append(s, layer, x["meta"], x["kv"], impl=impl)
        return dj.flush(s, layer, x["meta"], *comp, impl=impl, **index) if comp else s

    def layer_step(s, h, layer, kind, x):
        s = write(s, layer, kind, x)
        s, (rows, pos) = read(dj.gather_window, s, layer, x["slot"])
        h = attend(h, rows, (pos >= 0) & (pos <= x["pos"][:, None]))
        if kind == C.CSA:
            s, (idx,) = read(lambda s, *a, **kw: dj.indexer_topk(s, *a, k, **kw), s, layer,
                             x["slot"], x["pos"], x["q"], x["weights"])
            s, (rows, valid) = read(dj.gather_topk, s, layer, x["slot"], x["pos"], idx)
            h = attend(h, rows, valid)
        elif kind == C.HCA:
            s, (rows, count) = read(dj.gather_all, s, layer, x["slot"], x["lengths"], entries)
            h = attend(h, rows, jnp.arange(entries) < count[:, None])
        return s, h

    kinds = cfg.layer_kinds
    prefix, unit, repeats = (len(kinds), (), 0) if variant.unroll else layer_plan(kinds)

    def step(s, x):
        h = jnp.zeros((x["kv"].shape[0], C.HEAD_DIM), F32)
        for layer in range(prefix):
            s, h = layer_step(s, h, layer, kinds[layer], x)

        def body(carry, i):
            s, h = carry
            for j, kind in enumerate(unit):
                s, h = layer_step(s, h, prefix + len(unit) * i + j, kind, x)
            return (s, h), None
        if repeats:
            (s, h), _ = jax.lax.scan(body, (s, h), jnp.arange(repeats, dtype=jnp.int32))
        return s, h
    return jax.jit(step, donate_argnums=0)


# ---- one case ---------------------------------------------------------------------------------
def memory_limit_bytes():
    """What the default device can hold: the allocator's limit on a GPU,
    physical memory on a CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def bytes_needed(cfg, context):
    """The state (dj.memory_report; filling it needs nothing more) plus the
    step's workspace, generously: four layers' gathered rows in bf16 and f32,
    and 1 GiB for XLA's scratch and the compiled program."""
    rows = cfg.max_requests * (C.WINDOW + cfg.index_topk + context // C.HCA_RATIO) * C.HEAD_DIM
    return dj.memory_report(cfg).total + 4 * rows * 6 + 2 ** 30


def run_case(B, context, variants, args):
    """Rows of one (B, context): every variant on the same filled state."""
    cfg = PRESETS[args.model](max_requests=B, max_context=context, kv_format=args.kv_format)
    need, have = bytes_needed(cfg, context), memory_limit_bytes()
    base = {"B": B, "context": context, "model": cfg.model, "kv_format": cfg.kv_format,
            "state_gib": dj.memory_report(cfg).total / 2 ** 30}
    if need > have:
        reason = f"needs ~{need / 2 ** 30:.1f} GiB (state {base['state_gib']:.1f}), " \
                 f"the device has {have / 2 ** 30:.1f} GiB free"
        print(f"skip B={B} context={context}: {reason}", flush=True)
        return [dict(base, skipped=reason)]
    box = [filled_state(cfg, context, args.seed)]
    x = step_inputs(B, context, args.seed)
    rows = []
    for v in variants:
        row = dict(base, variant=v.name, impl=args.impl)
        try:
            f = make_step(cfg, context, v, args.impl)
        except NotImplementedError as e:
            print(f"skip variant {v.name}: {e}", flush=True)
            rows.append(dict(row, skipped=str(e)))
            continue

        def call(f=f):
            box[0], h = f(box[0], x)
            return h
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        row["first_call_s"] = time.perf_counter() - t0
        row["host_ms"] = host_ms(call, args.warm, args.reps, args.loop)
        events = kernel_events(call, runs=args.trace_steps)
        if events:
            row.update(timeline_summary(events, args.trace_steps, cfg.num_layers))
        row["errors"] = [int(e) for e in np.asarray(box[0].errors)]
        rows.append(row)
        print_row(row)
    box.clear()
    gc.collect()
    return rows


# ---- report -----------------------------------------------------------------------------------
def print_row(r):
    line = f"B={r['B']} context={r['context']} {r['variant']}: {r['host_ms']:.3f} ms host"
    if "span_us" in r:
        line += (f", span {r['span_us']:.1f} us, busy {r['busy_us']:.1f} us, "
                 f"{r['kernels_per_step']:.0f} kernels ({r['kernels_per_layer']:.2f}/layer, "
                 f"cache+copies {r['cache_kernels_per_layer']:.2f}/layer, "
                 f"{r['copy_kernels_per_step']:.0f} copies)")
    if any(r["errors"]):
        line += f", ERROR COUNTS {r['errors']} (the workload is not valid)"
    print(line, flush=True)


def markdown(rows, per_kernel=True):
    """The summary table, then each case's per-kernel table."""
    def cell(r, key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "–"
    out = ["| B | context | variant | host ms | span µs | busy µs | kernels/step | kernels/layer "
           "| cache+copy kernels/layer | copies/step |", "|---:|---:|---|" + "---:|" * 7]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['B']} | {r['context']} | {r.get('variant', '')} "
                       f"| skipped: {r['skipped']} |||||||")
            continue
        out.append(f"| {r['B']} | {r['context']} | {r['variant']} | {r['host_ms']:.3f} | "
                   + " | ".join(cell(r, k, f) for k, f in (
                       ("span_us", ".1f"), ("busy_us", ".1f"), ("kernels_per_step", ".0f"),
                       ("kernels_per_layer", ".2f"), ("cache_kernels_per_layer", ".2f"),
                       ("copy_kernels_per_step", ".0f"))) + " |")
    for r in rows if per_kernel else ():
        if r.get("kernels"):
            out += ["", f"B = {r['B']}, context {r['context']}, {r['variant']} (per step):", "",
                    "| kernel | kind | count | total µs | mean µs |", "|---|---|---:|---:|---:|"]
            out += [f"| {k['name']} | {k['kind']} | {k['count']:g} | {k['total_us']:.1f} "
                    f"| {k['mean_us']:.2f} |" for k in r["kernels"]]
    return "\n".join(out)


def sizes(text):
    """'1,8,4k,64k' -> [1, 8, 4096, 65536]."""
    return [int(v[:-1]) * 1024 if v.endswith("k") else int(v) for v in text.split(",") if v]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a CPU-sized run: B=1, context 512, few repetitions")
    ap.add_argument("--batches", help="requests per step (default 1,8,64,256; quick 1)")
    ap.add_argument("--contexts", help="tokens per request (default 4k,64k; quick 512)")
    ap.add_argument("--model", default="flash", choices=sorted(PRESETS))
    ap.add_argument("--kv-format", default="ds_fp8", choices=C.KV_FORMATS)
    ap.add_argument("--impl", default="auto",
                    help="auto (the platform's FFI), cuda, cpu or reference")
    ap.add_argument("--no-return-state", action="store_true",
                    help="read ops drop the state they could hand back (XLA then copies it)")
    ap.add_argument("--fused-write", action="store_true",
                    help="one dj.write_layer call per layer instead of append + flush")
    ap.add_argument("--unroll", action="store_true", help="every layer unrolled, no scan")
    ap.add_argument("--variants", help="several variants on the same state, comma-separated: "
                    "'base' or flags joined by '+', e.g. base,no-return-state,unroll+fused-write "
                    "(overrides the three flags above)")
    ap.add_argument("--reps", type=int, help="host samples (default 7; quick 3)")
    ap.add_argument("--loop", type=int, help="steps per host sample (default 10; quick 2)")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=3, help="steps traced on the timeline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--markdown", metavar="JSON", help="print a saved run's tables and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as fh:
            print(markdown(json.load(fh)["rows"]))
        return 0
    q = args.quick
    batches = sizes(args.batches or ("1" if q else "1,8,64,256"))
    contexts = sizes(args.contexts or ("512" if q else "4k,64k"))
    args.reps = args.reps or (3 if q else 7)
    args.loop = args.loop or (2 if q else 10)
    if args.variants:
        variants = [Variant.parse(v) for v in args.variants.split(",")]
    else:
        variants = [Variant(not args.no_return_state, args.fused_write, args.unroll)]
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"model {args.model}, kv_format {args.kv_format}, impl {args.impl}, "
          f"variants {[v.name for v in variants]}", flush=True)
    rows = []
    for context in contexts:
        for B in batches:
            rows += run_case(B, context, variants, args)
    print()
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev.device_kind, "platform": jax.default_backend(),
                       "jax": jax.__version__, "rows": rows}, fh, indent=1)
    return 0
