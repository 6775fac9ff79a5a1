"""The prefill benchmark: long prompts' cache writes through every layer of a
model, step by step, as a serving engine makes them.

    python benchmarks/bench_prefill.py --json prefill.json     # 1x65536/8192, 8x8192/8192
    python benchmarks/bench_prefill.py --scenarios 1x1024/256 --model tiny --impl cpu
    python benchmarks/bench_prefill.py --device-timeline       # + busy time, kernels a chunk
    python benchmarks/bench_prefill.py --markdown prefill.json # a saved run's table

Scenario BxP/C: B requests of a P-token prompt each, written a chunk of C
tokens a step. A step's chunk is the next C tokens of the queue of prompts,
request after request, as a serving engine with a token budget of C a step
(chunked prefill) schedules them: 1x65536/8192 is 8 chunks of 8k tokens of
one request, 8x8192/8192 is 8 chunks of one whole request each (as many rows
a chunk, over 8 requests). A request is admitted in the step that schedules
its first token, so that step's apply_step resets its slot.

A step is one jitted call, the state donated: apply_step (the step's new
blocks and resets), then per layer write_layer (append + flush in one call;
SWA layers: append alone), or, with --write separate, append then flush.
The projections are random, and the same arrays serve every layer and every
step (only positions differ); a CSA layer's projections at 8k rows (80 MB)
exceed an H100's 50 MB L2, so little of them is served from cache.

Timing: the metadata of every step of a run is built on the host first (the
manager is plain Python). A warm-up run compiles and syncs after each step
(printing each chunk's ms, the first with the compile); then `reps` runs of
all the prompts, each synced once at its end; the median is reported. Each run
releases the last run's requests and admits new ones: it starts from reset
slots and freshly scrubbed blocks, as a server's next prompts do.

Bytes read (read_bytes), per real token and layer: what the writes must read
of their inputs. The bf16 window row (1 KiB, every layer); the f32 kv and
score projections of the compressor (CSA 2 x 4 KiB, HCA 2 x 2 KiB); on CSA
layers the indexer's f32 kv and score (2 x 1 KiB). 333 KiB a token through
V4-Flash's 43 layers: 22.3 GB for 64k tokens. Not counted: what the writes
write (window rows, entries, indexer keys, accumulators), the compressor
parameters, the metadata, padding rows. It is set against the device's copy
rate (bytes read + written a second, as BenchRun's copy reference measures
it in the same run, unless --copy-gbps gives it): "ms at copy" is the time
a copy of those bytes would take: about the floor of any cache write that
reads them once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.app.arguments import input_path, output_path
from dsv4_jax.app.bench.device_timeline import kernel_events, timeline_summary
from dsv4_jax.app.bench.inputs import flush_params
from dsv4_jax.app.bench.timing import BenchRun, Settings
from dsv4_jax.config import PRESETS
from dsv4_jax.errors import error_counts
from dsv4_jax.meta import bucket

from device import memory_limit_bytes

SCENARIOS = "1x65536/8192,8x8192/8192"
WRITES = ("fused", "separate")
IMPLS = {"auto": "auto", "cpu": "cpu", "cuda": "cuda", "ref": "reference",
         "reference": "reference"}
# f32 projections a token of a layer reads, in channels
PROJECTION_WIDTH = {C.SWA: 0, C.CSA: 2 * C.HEAD_DIM + 2 * C.INDEX_DIM, C.HCA: C.HEAD_DIM}


@dataclasses.dataclass(frozen=True)
class Scenario:
    requests: int   # B
    tokens: int     # P, a prompt
    chunk: int      # C, tokens a step

    @classmethod
    def parse(cls, text):
        """"BxP/C", sizes with an optional k (x1024): 1x64k/8k."""
        m = re.fullmatch(r"(\d+k?)x(\d+k?)/(\d+k?)", text.strip())
        if not m:
            raise ValueError(f"scenario {text!r}: expected BxP/C, e.g. 1x65536/8192")
        b, p, c = (int(v[:-1]) * 1024 if v.endswith("k") else int(v) for v in m.groups())
        if min(b, p, c) <= 0:
            raise ValueError(f"scenario {text!r}: sizes must be positive")
        return cls(b, p, c)

    @property
    def name(self):
        return f"{self.requests}x{self.tokens}/{self.chunk}"

    def schedule(self):
        """Per step, [(request, tokens)]: the next `chunk` tokens of the
        prompts, request after request."""
        steps, request, done = [], 0, 0
        while request < self.requests:
            budget, step = self.chunk, []
            while budget and request < self.requests:
                n = min(budget, self.tokens - done)
                step.append((request, n))
                budget, done = budget - n, done + n
                if done == self.tokens:
                    request, done = request + 1, 0
            steps.append(step)
        return steps


def scenarios(text):
    """Comma-separated scenarios (an option's type)."""
    try:
        return [Scenario.parse(v) for v in text.split(",") if v]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prefill_config(model, scenario, kv_format="ds_fp8"):
    """A pool sized for the prompts: their blocks and one spare a request
    (a pool in use is never sized to the block)."""
    per = C.blocks_for_tokens(scenario.tokens)
    return PRESETS[model](max_requests=scenario.requests, max_context=per * C.BLOCK_TOKENS,
                          num_blocks=scenario.requests * (per + 1), kv_format=kv_format)


def read_bytes(cfg, tokens):
    """Bytes the writes of `tokens` tokens must read through every layer
    (the module's docstring says what is counted)."""
    per_token = sum(2 * C.HEAD_DIM + 2 * 4 * PROJECTION_WIDTH[k] for k in cfg.layer_kinds)
    return tokens * per_token


def step_inputs(rows, seed=0):
    """Random model outputs for `rows` token rows: the window rows, each
    kind's compressor projections and the indexer's, and the parameters."""
    rng = np.random.default_rng(seed)

    def normal(width, dtype=jnp.float32):
        return jnp.asarray(rng.standard_normal((rows, width), np.float32), dtype)
    return {"kv": normal(C.HEAD_DIM, jnp.bfloat16),
            "csa_kv": normal(2 * C.HEAD_DIM), "csa_score": normal(2 * C.HEAD_DIM),
            "index_kv": normal(2 * C.INDEX_DIM), "index_score": normal(2 * C.INDEX_DIM),
            "hca_kv": normal(C.HEAD_DIM), "hca_score": normal(C.HEAD_DIM),
            "params": {C.CSA: flush_params(C.CSA, rng), C.HCA: flush_params(C.HCA, rng)}}


def layer_operands(kind, x):
    """(compressor operands, indexer keywords) of a layer of `kind`."""
    if kind == C.SWA:
        return (), {}
    comp = (x[f"{kind}_kv"], x[f"{kind}_score"], x["params"][kind])
    index = {"index_kv": x["index_kv"], "index_score": x["index_score"]} if kind == C.CSA else {}
    return comp, index


def make_step(cfg, impl="auto", write="fused"):
    """jitted (state, meta, x) -> state: a step's cache writes, every layer."""
    if write not in WRITES:
        raise ValueError(f"write: expected one of {WRITES}, got {write!r}")

    def step(s, meta, x):
        s = dj.apply_step(s, meta, impl=impl)
        for layer, kind in enumerate(cfg.layer_kinds):
            comp, index = layer_operands(kind, x)
            if write == "fused":
                s = dj.write_layer(s, layer, meta, x["kv"], *comp, impl=impl, **index)
                continue
            s = dj.append(s, layer, meta, x["kv"], impl=impl)
            if comp:
                s = dj.flush(s, layer, meta, *comp, impl=impl, **index)
        return s
    return jax.jit(step, donate_argnums=0)


class PromptRuns:
    """Runs of one scenario's prompts on one state: a manager that admits
    each run's requests (releasing the last run's), the step metadata of
    every run (`metas`, in order), and the state, put back after each step."""

    def __init__(self, cfg, scenario):
        self.cfg, self.scenario = cfg, scenario
        self.manager = dj.CacheManager(cfg)
        self.state = dj.init_state(cfg)
        self.metas = []
        most = min(scenario.requests, scenario.chunk)   # requests in one step, at most
        # one shape every step: a step's new blocks and resets fit these
        self.sizes = dict(min_tokens=bucket(scenario.chunk),
                          min_new_blocks=bucket(C.blocks_for_tokens(scenario.chunk) + most),
                          min_resets=bucket(most))

    @property
    def rows(self):
        return self.sizes["min_tokens"]

    def plan(self):
        """The metadata of the next run's steps."""
        m = self.manager
        for rid in m.requests:
            m.release(rid)
        run, ids, metas = len(self.metas), {}, []
        for step in self.scenario.schedule():
            for r, _ in step:
                if r not in ids:
                    ids[r] = m.admit((run, r))
            metas.append(m.prepare_step({ids[r]: n for r, n in step}, **self.sizes))
        self.metas.append(metas)
        return metas

    def run(self, f, x, on_step=None):
        """One run of the prompts through the jitted step f; on_step(i, ms)
        after each step, synced, if given. Returns the wall seconds."""
        metas = self.plan()
        t0 = time.perf_counter()
        for i, meta in enumerate(metas):
            t = time.perf_counter()
            self.state = f(self.state, meta, x)
            if on_step:
                jax.block_until_ready(self.state)
                on_step(i, (time.perf_counter() - t) * 1e3)
        jax.block_until_ready(self.state)
        return time.perf_counter() - t0


def copy_rate_gbps(nbytes):
    """The device's copy rate (bytes read + written a second), by
    BenchRun's copy reference over `nbytes`."""
    bench = BenchRun(Settings(reps=5, batch=3, with_reference=False), emit=lambda *_: None)
    return nbytes / bench.copy_seconds(nbytes) / 1e9


def measure(cfg, scenario, *, impl="auto", write="fused", reps=3, seed=0, copy_gbps,
            timeline=False, emit=print):
    """(row, runs): one scenario timed (the module's docstring says how);
    `runs` holds the final state and every run's metadata."""
    runs = PromptRuns(cfg, scenario)
    f = make_step(cfg, impl, write)
    x = step_inputs(runs.rows, seed)
    chunks = len(scenario.schedule())

    def progress(i, ms):
        emit(f"  {scenario.name} warm-up chunk {i + 1}/{chunks}: {ms:.1f} ms"
             + (" (compiling)" if i == 0 else ""))
    warm_s = runs.run(f, x, progress)
    times = []
    for k in range(reps):
        times.append(runs.run(f, x))
        emit(f"  {scenario.name} run {k + 1}/{reps}: {times[-1] * 1e3:.1f} ms")
    ms = statistics.median(times) * 1e3
    nbytes = read_bytes(cfg, scenario.requests * scenario.tokens)
    copy_ms = nbytes / (copy_gbps * 1e9) * 1e3
    row = {"scenario": scenario.name, "requests": scenario.requests, "tokens": scenario.tokens,
           "chunk": scenario.chunk, "chunks": chunks, "rows_per_chunk": runs.rows,
           "layers": cfg.num_layers, "model": cfg.model, "kv_format": cfg.kv_format,
           "impl": impl, "write": write, "warm_up_s": warm_s, "ms_total": ms,
           "ms_per_chunk": ms / chunks, "read_bytes": nbytes, "GBps": nbytes / ms / 1e6,
           "copy_GBps": copy_gbps, "copy_ms": copy_ms, "copy_pct": 100 * copy_ms / ms,
           "runs_ms": [t * 1e3 for t in times]}
    if timeline:
        events = kernel_events(lambda: runs.run(f, x))
        if events:
            summary = timeline_summary(events, chunks, cfg.num_layers)
            row.update(busy_ms_per_chunk=summary["busy_us"] / 1e3,
                       span_ms_per_chunk=summary["span_us"] / 1e3,
                       kernels_per_chunk=summary["kernels_per_step"],
                       kernels=summary["kernels"])
    row["errors"] = {k.name.lower(): n for k, n in error_counts(runs.state).items()}
    return row, runs


# ---- report -----------------------------------------------------------------------------------
COLUMNS = (("ms_total", "ms in all", ".1f"), ("ms_per_chunk", "ms/chunk", ".2f"),
           ("read_bytes", "GB read", ".2f"), ("GBps", "GB/s", ".1f"),
           ("copy_ms", "ms at copy", ".2f"), ("copy_pct", "% of copy", ".1f"),
           ("busy_ms_per_chunk", "busy ms/chunk", ".2f"),
           ("kernels_per_chunk", "kernels/chunk", ".0f"))


def markdown(rows):
    """One line a scenario, and each timeline's five busiest kernels."""
    def cell(r, key, fmt):
        v = r.get(key)
        return "–" if v is None else format(v / 1e9 if key == "read_bytes" else v, fmt)
    out = ["| scenario | chunks | write | impl | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
           "|---|---:|---|---|" + "---:|" * len(COLUMNS)]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['scenario']} | skipped: {r['skipped']} |")
            continue
        out.append(f"| {r['scenario']} | {r['chunks']} | {r['write']} | {r['impl']} | "
                   + " | ".join(cell(r, k, f) for k, _, f in COLUMNS) + " |")
    for r in rows:
        if r.get("kernels"):
            out += ["", f"{r['scenario']}, {r['write']}: busiest kernels a chunk", "",
                    "| kernel | kind | count | ms | mean µs |", "|---|---|---:|---:|---:|"]
            out += [f"| {k['name']} | {k['kind']} | {k['count']:g} | {k['total_us'] / 1e3:.2f} "
                    f"| {k['mean_us']:.1f} |" for k in r["kernels"][:5]]
    return "\n".join(out)


def bytes_needed(cfg, scenario):
    """The state, the step's inputs, and 1 GiB for XLA's scratch."""
    per_row = 2 * C.HEAD_DIM + 2 * 4 * (PROJECTION_WIDTH[C.CSA] + PROJECTION_WIDTH[C.HCA])
    inputs = bucket(scenario.chunk) * per_row
    return dj.memory_report(cfg).total + inputs + 2 ** 30


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=scenarios, default=scenarios(SCENARIOS),
                    help=f"comma-separated BxP/C: B requests of P tokens, C tokens a step "
                         f"(default {SCENARIOS})")
    ap.add_argument("--model", default="flash", choices=sorted(PRESETS))
    ap.add_argument("--kv-format", default="ds_fp8", choices=C.KV_FORMATS)
    ap.add_argument("--impl", default="auto", choices=sorted(IMPLS),
                    help="auto (the platform's FFI), cpu, cuda or ref (the jnp reference)")
    ap.add_argument("--write", default="fused", choices=WRITES,
                    help="fused: write_layer a layer; separate: append then flush")
    ap.add_argument("--reps", type=int, default=3, help="timed runs (the median is reported)")
    ap.add_argument("--copy-gbps", type=float,
                    help="the device's copy rate, bytes read + written a second (default: "
                         "measured in the run)")
    ap.add_argument("--device-timeline", action="store_true",
                    help="also trace one more run on the GPU: busy ms and kernels a chunk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write the rows here")
    ap.add_argument("--markdown", type=input_path, metavar="JSON", help="print a saved run's table and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as fh:
            print(markdown(json.load(fh)["rows"]))
        return 0
    dev = jax.devices()[0]
    gpu = jax.default_backend() == "gpu"
    # a copy well past the last-level cache, smaller off the GPU to keep CPU runs short
    copy_gbps = args.copy_gbps or copy_rate_gbps(2 ** 30 if gpu else 2 ** 27)
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"model {args.model}, kv_format {args.kv_format}, impl {args.impl}, write "
          f"{args.write}, copy {copy_gbps:.0f} GB/s"
          + (" (measured)" if not args.copy_gbps else ""), flush=True)
    emit = lambda line: print(line, flush=True)  # noqa: E731
    rows = []
    for sc in args.scenarios:
        cfg = prefill_config(args.model, sc, args.kv_format)
        need, have = bytes_needed(cfg, sc), memory_limit_bytes()
        if need > have:
            reason = f"needs ~{need / 2 ** 30:.1f} GiB, the device has {have / 2 ** 30:.1f} free"
            emit(f"skip {sc.name}: {reason}")
            rows.append({"scenario": sc.name, "skipped": reason})
            continue
        row, _ = measure(cfg, sc, impl=IMPLS[args.impl], write=args.write, reps=args.reps,
                         seed=args.seed, copy_gbps=copy_gbps, timeline=args.device_timeline,
                         emit=emit)
        rows.append(row)
        emit(f"{sc.name}: {row['ms_total']:.1f} ms in all, "
             f"{row['ms_per_chunk']:.2f} ms a chunk, {row['GBps']:.0f} GB/s read "
             f"({row['copy_pct']:.1f} % of copy)"
             + (f", ERROR COUNTS {row['errors']} (the workload is not valid)"
                if row["errors"] else ""))
    print()
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev.device_kind, "platform": jax.default_backend(),
                       "jax": jax.__version__, "copy_gbps": copy_gbps, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
