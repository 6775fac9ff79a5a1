"""The decode-step benchmark (issue 36): the cache work of a V4-Flash step as
a model runs it (model_step.py) on a full state (filled_state.py), per batch
size and context: host ms a step and, on a GPU, from the device timeline,
span, busy time of everything and of the cache kernels with the copies XLA
adds, kernels a layer (cache + copies, and the rest: the step's own use of
what it read), a per-kernel table and the kernel sequence of one layer pair.

    python -m dsv4_jax.bench.model_step_bench --json step.json   # B 1..256 x 4k, 64k
    python -m dsv4_jax.bench.model_step_bench --variants base,no-return-state,unroll
    python -m dsv4_jax.bench.model_step_bench --quick            # CPU-sized smoke run
    python -m dsv4_jax.bench.model_step_bench --markdown step.json --sequence
    python benchmarks/bench_decode_step.py ...                   # the same, from a checkout
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import jax
import numpy as np

import dsv4_jax as dj
from .. import config as C
from .filled_state import filled_state
from .model_step import Variant, measure_step, step_inputs
from .options import sizes

PRESETS = {"flash": dj.CacheConfig.flash, "pro": dj.CacheConfig.pro, "tiny": dj.CacheConfig.tiny}
# issue 36's target case is B = 16 at 64k
BATCHES, CONTEXTS = [1, 8, 16, 64, 256], [4096, 65536]


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
            row.update(measure_step(cfg, context, v, args.impl, box, x, warm=args.warm,
                                    reps=args.reps, loop=args.loop,
                                    trace_steps=args.trace_steps))
        except NotImplementedError as e:
            print(f"skip variant {v.name}: {e}", flush=True)
            rows.append(dict(row, skipped=str(e)))
            continue
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
        line += (f", span {r['span_us']:.1f} us, busy {r['busy_us']:.1f} us "
                 f"(cache+copies {r['cache_busy_us']:.1f}), {r['kernels_per_step']:.0f} kernels "
                 f"({r['kernels_per_layer']:.2f}/layer: cache+copies "
                 f"{r['cache_kernels_per_layer']:.2f}, other {r['other_kernels_per_layer']:.2f}; "
                 f"{r['copy_kernels_per_step']:.0f} copies)")
    if any(r["errors"]):
        line += f", ERROR COUNTS {r['errors']} (the workload is not valid)"
    print(line, flush=True)


SUMMARY = (("span_us", "span µs", ".1f"), ("busy_us", "busy µs", ".1f"),
           ("cache_busy_us", "cache+copy busy µs", ".1f"),
           ("kernels_per_step", "kernels/step", ".0f"),
           ("kernels_per_layer", "kernels/layer", ".2f"),
           ("cache_kernels_per_layer", "cache+copy kernels/layer", ".2f"),
           ("other_kernels_per_layer", "other kernels/layer", ".2f"),
           ("copy_kernels_per_step", "copies/step", ".0f"))


def markdown(rows, per_kernel=True, sequence=False):
    """The summary table, then each case's per-kernel table (and, with
    `sequence`, its layer pair's kernels in order)."""
    def cell(r, key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "–"
    out = ["| B | context | variant | host ms | " + " | ".join(h for _, h, _ in SUMMARY) + " |",
           "|---:|---:|---|" + "---:|" * (1 + len(SUMMARY))]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['B']} | {r['context']} | {r.get('variant', '')} "
                       f"| skipped: {r['skipped']} |" + "|" * len(SUMMARY))
            continue
        out.append(f"| {r['B']} | {r['context']} | {r['variant']} | {r['host_ms']:.3f} | "
                   + " | ".join(cell(r, k, f) for k, _, f in SUMMARY) + " |")
    for r in rows if per_kernel else ():
        if r.get("kernels"):
            out += ["", f"B = {r['B']}, context {r['context']}, {r['variant']} (per step):", "",
                    "| kernel | kind | count | total µs | mean µs |", "|---|---|---:|---:|---:|"]
            out += [f"| {k['name']} | {k['kind']} | {k['count']:g} | {k['total_us']:.1f} "
                    f"| {k['mean_us']:.2f} |" for k in r["kernels"]]
    for r in rows if sequence else ():
        if "sequence" in r:
            first, second = r["sequence_layers"]
            out += ["", f"B = {r['B']}, context {r['context']}, {r['variant']}: layers {first} "
                        f"and {second} of one step, in launch order (each from its write):", ""]
            if r.get("sequence_skipped"):
                out.append(f"no sequence: {r['sequence_skipped']}")
                continue
            out += ["| # | kernel | kind | start µs | µs | gap µs |",
                    "|---:|---|---|---:|---:|---:|"]
            out += [f"| {i} | {k['name']} | {k['kind']} | {k['start_us']:.1f} | {k['us']:.2f} "
                    f"| {k['gap_us']:.2f} |" for i, k in enumerate(r["sequence"])]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a CPU-sized run: B=1, context 512, few repetitions")
    ap.add_argument("--batches", type=sizes, help="requests per step (default "
                    f"{','.join(map(str, BATCHES))}; quick 1)")
    ap.add_argument("--contexts", type=sizes, help="tokens per request (default 4k,64k; quick 512)")
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
    ap.add_argument("--sequence", action="store_true",
                    help="also print, per case, the kernels of the first repeated layer pair "
                         "of one step in order, with durations and gaps (the JSON always "
                         "holds them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--markdown", metavar="JSON", help="print a saved run's tables and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as fh:
            print(markdown(json.load(fh)["rows"], sequence=args.sequence))
        return 0
    # The largest case (64k context x 256 requests) holds ~56 GiB of cache: more
    # than JAX's default share (75 %) of an 80 GB card leaves for it. Read when
    # the GPU client starts, which is not yet.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    q = args.quick
    batches = args.batches or ([1] if q else BATCHES)
    contexts = args.contexts or ([512] if q else CONTEXTS)
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
    print(markdown(rows, sequence=args.sequence))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev.device_kind, "platform": jax.default_backend(),
                       "jax": jax.__version__, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
