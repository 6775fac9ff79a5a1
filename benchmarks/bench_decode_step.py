"""The decode-step benchmark: a V4-Flash step as a model calls the library
(dsv4_jax/app/bench/model_step.py: per layer write_layer, indexer_topk on CSA
layers, attention with 64 heads, the sink and the inverse RoPE, the output
folded into a carried h) on a full state (filled_state.py), per batch size
and context: host ms a step and, on a GPU, from the device timeline, span,
busy time, the time of each op family (attention, indexer score + select,
writes, gathers, copies, other: XLA's own kernels), kernels and copies per
layer, a per-kernel table and the kernel sequence of one layer pair.

    python benchmarks/bench_decode_step.py --cases 1x4096,64x4096,16x65536,64x65536
    python benchmarks/bench_decode_step.py --json step.json       # B 1..256 x 4k, 64k
    python benchmarks/bench_decode_step.py --variants base,gathers+separate-write
    python benchmarks/bench_decode_step.py --quick                # CPU-sized smoke run
    python benchmarks/bench_decode_step.py --markdown step.json --sequence

Variants (model_step.Variant): `base` is the step above; `gathers` reads with
gather_window / gather_topk / gather_all and folds the rows into h instead
of calling attention (a model running its own attention); `separate-write`
calls append + flush instead of write_layer; `no-return-state` drops the
state the reads could hand back; `unroll` runs every layer with a Python
int index instead of the scan. Join flags with '+'.
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import jax
import numpy as np

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.app.arguments import input_path, output_path, sizes
from dsv4_jax.app.bench.device_timeline import FAMILY_NAMES
from dsv4_jax.app.bench.filled_state import filled_state
from dsv4_jax.app.bench.model_step import HEADS, Variant, measure_step, step_inputs

from device import memory_limit_bytes

BATCHES, CONTEXTS = [1, 8, 16, 64, 256], [4096, 65536]


def case(text):
    """"BxCONTEXT": requests and tokens each, e.g. 64x65536 or 16x64k."""
    try:
        B, ctx = text.split("x")
        return sizes(B)[0], sizes(ctx)[0]
    except (ValueError, IndexError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected BxCONTEXT such as 64x65536, "
                                         f"got {text!r}") from None


def cases(text):
    return [case(v) for v in text.split(",") if v]


def variants(text):
    try:
        return [Variant.parse(v) for v in text.split(",") if v]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def bytes_needed(cfg, context):
    """The state (dj.memory_report; filling it needs nothing more) plus the
    step's workspace, generously: four layers' gathered rows in bf16 and f32
    (the gathers variant), four layers' attention outputs (bf16, and f32
    where h sums them), and 1 GiB for XLA's scratch and the compiled
    program."""
    B = cfg.max_requests
    rows = B * (C.WINDOW + cfg.index_topk + context // C.HCA_RATIO) * C.HEAD_DIM
    outputs = B * HEADS * C.HEAD_DIM
    return dj.memory_report(cfg).total + 4 * (rows + outputs) * 6 + 2 ** 30


def run_case(B, context, variants, args):
    """Rows of one (B, context): every variant on the same filled state."""
    cfg = C.PRESETS[args.model](max_requests=B, max_context=context, kv_format=args.kv_format)
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
        except Exception as e:   # keep going with the other variants and cases
            print(f"B={B} context={context} {v.name}: FAILED {type(e).__name__}: "
                  f"{str(e)[:400]}", flush=True)
            rows.append(dict(row, skipped=f"{type(e).__name__}: {str(e)[:400]}"))
            box = [filled_state(cfg, context, args.seed)]   # a failed call may have taken it
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
        fam = r.get("family_us", {})
        line += (f", span {r['span_us']:.1f} us, busy {r['busy_us']:.1f} us ("
                 + ", ".join(f"{k} {fam[k]:.1f}" for k in FAMILY_NAMES if fam.get(k))
                 + f"), {r['kernels_per_layer']:.2f} kernels/layer, "
                   f"{r['copy_kernels_per_layer']:.2f} copies/layer")
    if any(r["errors"]):
        line += f", ERROR COUNTS {r['errors']} (the workload is not valid)"
    print(line, flush=True)


def _family(name):
    return lambda r: r.get("family_us", {}).get(name)


# (heading, value of a row, format); a row's missing value prints as –
SUMMARY = ((("span µs", lambda r: r.get("span_us"), ".1f"),
            ("busy µs", lambda r: r.get("busy_us"), ".1f"))
           + tuple((f"{name} µs", _family(name), ".1f") for name in FAMILY_NAMES)
           + (("kernels/layer", lambda r: r.get("kernels_per_layer"), ".2f"),
              ("copies/layer", lambda r: r.get("copy_kernels_per_layer"), ".2f")))


def markdown(rows, per_kernel=True, sequence=False):
    """The summary table, then each case's per-kernel table (and, with
    `sequence`, its layer pair's kernels in order)."""
    def cell(r, get, fmt):
        v = get(r)
        return format(v, fmt) if v is not None else "–"
    out = ["| B | context | variant | host ms | " + " | ".join(h for h, _, _ in SUMMARY) + " |",
           "|---:|---:|---|" + "---:|" * (1 + len(SUMMARY))]
    for r in rows:
        if "host_ms" not in r:
            out.append(f"| {r['B']} | {r['context']} | {r.get('variant', '')} "
                       f"| skipped: {r['skipped']} |" + "|" * len(SUMMARY))
            continue
        out.append(f"| {r['B']} | {r['context']} | {r['variant']} | {r['host_ms']:.3f} | "
                   + " | ".join(cell(r, g, f) for _, g, f in SUMMARY) + " |")
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


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a CPU-sized run: B=1, context 512, few repetitions")
    ap.add_argument("--cases", type=cases, metavar="BxCTX,...",
                    help="(requests, context) pairs, e.g. 1x4096,64x65536 (overrides "
                         "--batches and --contexts)")
    ap.add_argument("--batches", type=sizes, help="requests per step (default "
                    f"{','.join(map(str, BATCHES))}; quick 1)")
    ap.add_argument("--contexts", type=sizes, help="tokens per request (default 4k,64k; quick 512)")
    ap.add_argument("--model", default="flash", choices=sorted(C.PRESETS))
    ap.add_argument("--kv-format", default="ds_fp8", choices=C.KV_FORMATS)
    ap.add_argument("--impl", default="auto", choices=["auto", "cuda", "cpu", "reference"],
                    help="auto (the platform's FFI), cuda, cpu or reference")
    ap.add_argument("--variants", type=variants, default=[Variant()],
                    help="variants on the same state, comma-separated: 'base' or flags joined "
                         "by '+' among gathers, separate-write, no-return-state, unroll "
                         "(default base)")
    ap.add_argument("--reps", type=int, help="host samples (default 7; quick 3)")
    ap.add_argument("--loop", type=int, help="steps per host sample (default 10; quick 2)")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=3, help="steps traced on the timeline")
    ap.add_argument("--sequence", action="store_true",
                    help="also print, per case, the kernels of the first repeated layer pair "
                         "of one step in order, with durations and gaps (the JSON always "
                         "holds them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write the rows here")
    ap.add_argument("--markdown", type=input_path, metavar="JSON",
                    help="print a saved run's tables and exit")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.markdown:
        with open(args.markdown) as fh:
            print(markdown(json.load(fh)["rows"], sequence=args.sequence))
        return 0
    # The largest case (64k context x 256 requests) holds ~56 GiB of cache: more
    # than JAX's default share (75 %) of an 80 GB card leaves for it. Read when
    # the GPU client starts, which is not yet.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    q = args.quick
    if args.cases:
        todo = args.cases
    else:
        todo = [(B, ctx) for ctx in args.contexts or ([512] if q else CONTEXTS)
                for B in args.batches or ([1] if q else BATCHES)]
    args.reps = args.reps or (3 if q else 7)
    args.loop = args.loop or (2 if q else 10)
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"model {args.model}, kv_format {args.kv_format}, impl {args.impl}, "
          f"variants {[v.name for v in args.variants]}", flush=True)
    rows = []
    for B, context in todo:
        rows += run_case(B, context, args.variants, args)
    print()
    print(markdown(rows, sequence=args.sequence))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev.device_kind, "platform": jax.default_backend(),
                       "jax": jax.__version__, "rows": rows}, fh, indent=1)
    return 1 if any(any(r.get("errors", ())) for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
