"""Device times of the decode step's cache kernels in one run, against
their targets (docs/perf/decode-step.md): indexer_topk (score kernel, the
select's tail after it, the call's span), append at 1 .. 64k rows beside the
original PyTorch kernel, and write_layer at B = 64 and B = 1 on a CSA, an
HCA and an SWA layer; also write_layer then indexer_topk on one CSA layer,
as a step runs them (what the overlapped launches change between two of the
library's calls). Times are kernel durations on the GPU's own timeline
(CUPTI through jax.profiler), medians over the traced calls.

    python tools/step_kernels_check.py [--json PATH] [--peers .peers] [--quick]
        [--pair-only | --write-only]

With an overlapped launch a kernel's duration on the timeline starts when its
first CTA is in place, which may be while the kernel ahead still runs; so the
score kernel's own time is not its cost. The select's tail (its end less the
score kernel's end), the call's period in a loop and the write-then-indexer
span are. `--pair-only` times only that span (run it again with
XLA_FLAGS=--xla_gpu_enable_command_buffer= to see what XLA's command buffers
keep of the overlap).

Needs a GPU and the CUDA module; the original append kernel needs torch with
CUDA and the peers folder (else its column says why not).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dsv4_jax as dj  # noqa: E402
from dsv4_jax import config as C  # noqa: E402
from dsv4_jax.app.bench.device_timeline import kernel_events, two_kernel_phases  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from append_original import workload as append_workload  # noqa: E402
from bench_indexer import make_state as indexer_state  # noqa: E402


def durations(events, name):
    """(start, end) in µs of the kernels whose name holds `name`."""
    return [(s / 1e3, (s + d) / 1e3) for s, d, n in events if name in n]


def median(xs):
    return statistics.median(xs) if xs else None


# ---- indexer_topk ---------------------------------------------------------------------------
def indexer_times(st, B, ctx, calls=8):
    """Median score-kernel time, select tail (select end - score end), span
    (score start - select end) and period (score start to the next) of a
    jitted loop of `calls` calls on state `st` (the benchmark's: B requests
    of ctx tokens of quantized keys)."""
    rng = np.random.default_rng(1)
    slot = jnp.arange(B, dtype=jnp.int32)
    pos = jnp.full((B,), ctx - 1, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, 64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((B, 64)), jnp.float32)

    @jax.jit
    def loop(st):
        idx = jnp.zeros((B, 512), jnp.int32)
        for _ in range(calls):
            i, st = dj.indexer_topk(st, 1, slot, pos, q, w, 512, return_state=True)
            idx = idx + i
        return idx, st
    loop(st)[0].block_until_ready()
    ph = two_kernel_phases(kernel_events(lambda: loop(st)[0]), "ScoreKernel", "SelectKernel")
    return {"score_us": ph["first_us"], "select_tail_us": ph["tail_us"],
            "span_us": ph["span_us"], "period_us": ph["period_us"]}


# ---- append -----------------------------------------------------------------------------------
def append_us(T, fmt="ds_fp8"):
    """Median device time of one append at T rows, on the workload of
    benchmarks/bench_append_vs_original.py."""
    R, slot, pos = append_workload(T)
    L = 8 if T <= 4096 else 2
    MB = 2 * 4096 // 128
    cfg = dj.CacheConfig((0,) * L, R, R * MB, MB, fmt)
    meta = dj.StepMeta.build(token_slot=slot, token_pos=pos,
                             lengths=np.full(R, 4096 + T // R, np.int32))
    kv = jnp.asarray(np.random.default_rng(T).standard_normal((T, 512)), jnp.bfloat16)
    def appends(st):
        for layer in range(L):
            st = dj.append(st, layer, meta, kv)
        return st
    f = jax.jit(appends, donate_argnums=0)
    box = [f(dj.init_state(cfg))]

    def call():
        box[0] = f(box[0])
        return box[0].errors
    events = kernel_events(call, runs=2)
    return median([e - s for s, e in durations(events, "AppendKernel")])


def original_append(rows, peers):
    """{T: device µs} of the original kernel, from the benchmark's own script
    run in a subprocess (torch and JAX never share a process), or a reason."""
    script = os.path.join(ROOT, "benchmarks", "append_original.py")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "o.json")
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                   + os.environ.get("PATH", ""))
        rc = subprocess.call([sys.executable, script, out, "--rows",
                              ",".join(map(str, rows)), "--peers", peers], env=env)
        if rc != 0 or not os.path.isfile(out):
            return f"the original's script exited with {rc}"
        with open(out) as fh:
            res = json.load(fh)
    if "skipped" in res:
        return res["skipped"]
    return {int(k): v.get("original_device_us") for k, v in res.items()}


# ---- write_layer --------------------------------------------------------------------------------
def decode_state(B, ctx):
    """A tiny-config state of B requests whose accumulators hold finite carried
    values and whose blocks all exist (a permutation), so a token at ctx - 1
    closes a CSA and an HCA window."""
    cfg = dj.CacheConfig.tiny(max_requests=B, max_context=ctx)
    st = dj.init_state(cfg)
    rng = np.random.default_rng(0)

    def acc(shape):
        a = np.empty(shape, np.float32)
        a[..., 0, :] = rng.normal(0, 1, shape[:-2] + shape[-1:])
        a[..., 1, :] = rng.uniform(1, 4, shape[:-2] + shape[-1:])
        a[..., 2, :] = rng.normal(0, 2, shape[:-2] + shape[-1:])
        return jnp.asarray(a)
    MB = cfg.max_blocks_per_request
    bt = rng.permutation(cfg.num_blocks)[:B * MB].reshape(B, MB).astype(np.int32)
    csa = dataclasses.replace(st.csa, comp=acc(st.csa.comp.shape), icomp=acc(st.csa.icomp.shape))
    hca = dataclasses.replace(st.hca, comp=acc(st.hca.comp.shape))
    return dataclasses.replace(st, block_table=jnp.asarray(bt), csa=csa, hca=hca)


def step_inputs(B, ctx, seed=0):
    rng = np.random.default_rng(seed)

    def normal(shape, dtype=jnp.float32):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    meta = dj.StepMeta.build(token_slot=np.arange(B, dtype=np.int32),
                             token_pos=np.full(B, ctx - 1, np.int32),
                             lengths=np.full(B, ctx, np.int32))
    return {"meta": meta, "kv": normal((B, 512), jnp.bfloat16),
            "csa": (normal((B, 1024)), normal((B, 1024)), dj.CompressorParams.neutral(C.CSA)),
            "hca": (normal((B, 512)), normal((B, 512)), dj.CompressorParams.neutral(C.HCA)),
            "index": {"index_kv": normal((B, 256)), "index_score": normal((B, 256))},
            "q": normal((B, 64, 128), jnp.bfloat16), "w": normal((B, 64))}


LAYER_OF = {"swa": 0, "csa": 1, "hca": 2}   # the tiny config: SWA, CSA, HCA, CSA


def write(st, x, kind):
    layer = LAYER_OF[kind]
    if kind == "swa":
        return dj.write_layer(st, layer, x["meta"], x["kv"])
    extra = x["index"] if kind == "csa" else {}
    return dj.write_layer(st, layer, x["meta"], x["kv"], *x[kind], **extra)


def write_layer_us(B, ctx, kind, calls=6):
    x = step_inputs(B, ctx)

    def loop(st):
        for _ in range(calls):
            st = write(st, x, kind)
        return st
    f = jax.jit(loop, donate_argnums=0)
    box = [f(decode_state(B, ctx))]

    def call():
        box[0] = f(box[0])
        return box[0].errors
    events = kernel_events(call, runs=2)
    name = "AppendKernel" if kind == "swa" else "WriteLayerKernel"
    return median([e - s for s, e in durations(events, name)])


def write_then_indexer_us(B, ctx, calls=6):
    """A CSA layer as a step runs it: write_layer, then indexer_topk at the
    same tokens. Median span from the write's start to the select's end."""
    x = step_inputs(B, ctx)
    def loop(st):
        acc = jnp.zeros((B, 512), jnp.int32)
        for _ in range(calls):
            st = write(st, x, "csa")
            idx, st = dj.indexer_topk(st, 1, x["meta"].token_slot, x["meta"].token_pos,
                                      x["q"], x["w"], 512, return_state=True)
            acc = acc + idx
        return st, acc
    f = jax.jit(loop, donate_argnums=0)
    box = [f(decode_state(B, ctx))[0]]

    def call():
        box[0], acc = f(box[0])
        return acc
    events = kernel_events(call, runs=2)
    writes, selects = durations(events, "WriteLayerKernel"), durations(events, "SelectKernel")
    return median([se - ws for (ws, _), (_, se) in zip(writes, selects)])


# ---- report ---------------------------------------------------------------------------------
def fmt(v):
    return "–" if v is None else f"{v:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--peers", default=".peers")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--pair-only", action="store_true",
                    help="only write_layer then indexer_topk on one CSA layer")
    ap.add_argument("--write-only", action="store_true",
                    help="only write_layer, alone and then indexer_topk")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    rows = []

    def row(what, size, target="", **cols):
        r = {"what": what, "size": size, "target": target, **cols}
        rows.append(r)
        print(json.dumps(r), flush=True)

    indexer_cases = [(1, 4096, "span ≤ 8"), (64, 65536, "score ≤ 31, tail ≤ 10, span ≤ 45")]
    if args.pair_only or args.write_only:
        indexer_cases = []
    for B, ctx, target in indexer_cases[:1] if args.quick else indexer_cases:
        st = indexer_state(B, ctx)
        t = indexer_times(st, B, ctx)
        del st
        for part in ("score_us", "select_tail_us", "span_us", "period_us"):
            row(f"indexer {part[:-3]}", f"B={B} {ctx // 1024}k", target, us=t[part])
    sizes = [1, 64, 512] if args.quick else [1, 64, 512, 4096, 65536]
    if args.pair_only or args.write_only:
        sizes = []
    original = original_append(sizes, args.peers) if sizes else {}
    for T in sizes:
        row("append ds_fp8", f"{T} rows", "≤ original", us=append_us(T),
            original=original.get(T) if isinstance(original, dict) else None)
    if not isinstance(original, dict):
        print(f"original append: {original}", flush=True)
    for B in () if args.pair_only else (64, 1):
        for kind in ("csa", "hca", "swa"):
            row(f"write_layer {kind}", f"B={B} 4k", "≤ 6" if B == 64 else "",
                us=write_layer_us(B, 4096, kind))
    flags = os.environ.get("XLA_FLAGS", "")
    buffers = "command buffers off" if "enable_command_buffer=" in flags and \
        "enable_command_buffer=F" not in flags else "XLA's default"
    for B, ctx in ((1, 4096), (64, 4096)):
        row("write_layer + indexer span", f"B={B} {ctx // 1024}k, {buffers}", "",
            us=write_then_indexer_us(B, ctx))
    print()
    print("| what | size | µs | original µs | target |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['what']} | {r['size']} | {fmt(r.get('us'))} | {fmt(r.get('original'))} | "
              f"{r['target']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev.device_kind, "jax": jax.__version__, "rows": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
