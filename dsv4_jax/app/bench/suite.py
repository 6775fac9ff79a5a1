"""The ops benchmark, behind `python -m dsv4_jax bench` and benchmarks/run.py:
every op's time, bandwidth (bytes the op must move over its time, inputs.py)
and its share of a device copy of as many bytes (timing.py): apply_step,
append, flush and write_layer at decode and prefill sizes, the gathers,
indexer_topk and attention at decode sizes; then a V4-Flash decode step as a
model calls the library (model_step.py: ms a step and, on a GPU, its device
timeline). The FFI impl is "cuda" on a GPU, "cpu" on a CPU (smaller sizes
there by default).

    python -m dsv4_jax bench                       # everything: table, bench.json, bench.png
    python -m dsv4_jax bench --quick               # the ops at two or three sizes
    python -m dsv4_jax bench --ops append,gather_window --rows 1,64,64k
    python -m dsv4_jax bench --markdown bench.json # a saved run's tables, as docs/perf/ops.md
"""
from __future__ import annotations

import argparse
import json

import jax

from ... import config as C
from ...config import CacheConfig
from ..ui import UI
from . import report
from .filled_state import filled_state
from .model_step import Variant, measure_step, step_inputs
from .options import add_options, fill_defaults
from .ops import (bench_append, bench_apply_step, bench_attention, bench_flush, bench_gather_all,
                  bench_gather_topk, bench_gather_window, bench_indexer_topk, bench_write_layer)
from .timing import BenchRun, Settings


# what a decode-step row keeps of measure_step's record (the JSON of
# benchmarks/bench_decode_step.py has the per-kernel table and the sequence)
STEP_FIELDS = ("first_call_s", "span_us", "busy_us", "cache_busy_us", "family_us",
               "kernels_per_step", "kernels_per_layer", "cache_kernels_per_layer",
               "other_kernels_per_layer", "copy_kernels_per_step", "copy_kernels_per_layer")


def bench_flash_step(b, batches, context, fmt):
    """The V4-Flash decode step as a model calls the library (model_step's
    default: write_layer, indexer_topk, attention) at
    `context` tokens a request for each B in `batches`, with each of the
    run's impls on one filled state."""
    for B in batches:
        cfg = CacheConfig.flash(max_requests=B, max_context=context, kv_format=fmt)
        box, x = [filled_state(cfg, context)], step_inputs(B, context)
        for impl in b.impls:
            r = measure_step(cfg, context, Variant(), impl, box, x, warm=1,
                             reps=max(3, b.settings.reps // 3),
                             loop=max(2, b.settings.batch // 4), trace_steps=3)
            b.record(op="flash_decode_step", B=B, ctx=context, impl=impl, fmt=fmt,
                     ms=r["host_ms"], **{k: r[k] for k in STEP_FIELDS if k in r})
        b.count_errors(box[0])


def run(args, emit=print) -> dict:
    """Every case `args` asks for; the numbers as the JSON holds them."""
    b = BenchRun(Settings(args.reps, args.batch, args.with_reference, args.inner), emit)
    dev = jax.devices()[0]
    emit(f"device: {dev.device_kind} ({b.platform}), impl {b.impl}, jax {jax.__version__}")
    b.empty_call()
    ops = set(args.ops)
    cases = [(f"decode B={n}", n, 1) for n in args.flush_decode]
    cases += [(f"prefill T={n}", 1, n) for n in args.flush_prefill]
    decode, ctx = args.flush_decode, args.step_context
    # each op's case list, in the order of OPS
    per_op = {"apply_step": lambda fmt: bench_apply_step(b, args.rows, fmt),
              "append": lambda fmt: bench_append(b, args.rows, fmt),
              "flush_csa": lambda fmt: bench_flush(b, C.CSA, cases, fmt),
              "flush_hca": lambda fmt: bench_flush(b, C.HCA, cases, fmt),
              "write_layer": lambda fmt: bench_write_layer(b, cases, fmt),
              "gather_window": lambda fmt: bench_gather_window(b, args.rows, fmt),
              "gather_topk": lambda fmt: bench_gather_topk(b, args.rows, fmt),
              "gather_all": lambda fmt: bench_gather_all(b, args.rows, fmt),
              "indexer_topk": lambda fmt: bench_indexer_topk(b, decode, ctx, fmt),
              "attention": lambda fmt: bench_attention(b, decode, ctx, fmt),
              "flash_step": lambda fmt: bench_flash_step(b, args.step_batches, ctx, fmt)}
    for fmt in args.formats:
        for name, bench in per_op.items():
            if name in ops:
                bench(fmt)
    return {"device": dev.device_kind, "platform": b.platform, "jax": jax.__version__,
            "impl": b.impl, "errors": b.errors, "copy_gbps": b.copy_gbps, "rows": b.rows}


def command(args, ui) -> int:
    """Run, print the tables, write the JSON and the plot where asked."""
    if args.markdown:
        with open(args.markdown) as fh:
            for line in report.markdown(json.load(fh)["rows"]):
                ui.line(line)
        return 0
    fill_defaults(args)
    data = run(args, emit=ui.line)
    report.tables(data, ui)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=1)
        ui.line(f"numbers written to {args.json}")
    if args.plot:
        report.plot(data, args.plot, ui)
    if data["errors"]:    # a call that dropped rows did less work than it is credited with
        ui.line(f"error: the ops counted bad input while timed, the numbers are void: "
                f"{data['errors']}")
        return 1
    return 0


def main(argv=None) -> int:
    """benchmarks/run.py: the same options, no files unless asked, plain text."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p)
    return command(p.parse_args(argv), UI(plain=True))
