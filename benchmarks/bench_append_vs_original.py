"""dj.append against the append kernel of the original PyTorch cache
(original_append_swa.cu of the peers folder), same rows, same workload, one
device call.

    python benchmarks/bench_append_vs_original.py [--peers .peers] [--json PATH]
    python benchmarks/bench_append_vs_original.py --quick   # CPU: ours only, host-timed

Workload at T rows (append_original.workload): R = T requests of one token
for T <= 64, else T // 128 requests of 128 tokens (a full window each),
tokens grouped by request in ascending positions from 4096 (what
CacheManager emits). Both kernels write every token into its request's
128-slot window.

Ours: one jit of L appends on L layers (the state donated); "µs/call" is a
host-timed loop of such calls over L, "device µs" the median duration of
the append kernel on the GPU timeline. Formats: fp8_token (the original's
layout: fp8 codes, a per-token f32 scale, bf16 rope) and ds_fp8 (the
default, a UE8M0 scale per 64 channels).

Original: append_original.py, run as a script by `--torch-python` (default
this interpreter) so that torch and JAX never share a process or the GPU's
memory pool; without torch, CUDA or the peers folder it is skipped with the
reason. `--peer-script` also runs the peers' script as found (its own rows
and workload) for reference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from dsv4_jax.app.arguments import output_path, sizes
from dsv4_jax.app.bench.device_timeline import kernel_events
from dsv4_jax.app.bench.timing import time_it

import append_original
from append_original import BASE_POS, workload


# ---- ours -------------------------------------------------------------------------------------
def time_ours(T, fmt, reps, loop):
    R, slot, pos = workload(T)
    L = 32 if T <= 512 else (8 if T <= 4096 else 2)   # appends per jitted call
    MB = 2 * BASE_POS // 128
    cfg = dj.CacheConfig((0,) * L, R, R * MB, MB, fmt)
    meta = dj.StepMeta.build(token_slot=slot, token_pos=pos,
                             lengths=np.full(R, BASE_POS + T // R, np.int32))
    rng = np.random.default_rng(T)
    kvs = [[jnp.asarray(rng.standard_normal((T, 512)), jnp.bfloat16) for _ in range(L)]
           for _ in range(2)]

    def body(s, kv):
        for layer in range(L):
            s = dj.append(s, layer, meta, kv[layer])
        return s
    f = jax.jit(body, donate_argnums=0)
    box = [dj.init_state(cfg)]

    def call(i=0):
        box[0] = f(box[0], kvs[i % 2])
        return box[0].errors
    row = {"rows": T, "requests": R, "format": fmt,
           "ours_us_per_call": time_it(call, 2, loop, reps, warm=2) * 1e6 / L}
    events = kernel_events(call)
    if events:
        append = [d / 1e3 for _, d, name in events if "Append" in name]
        row["ours_device_us"] = statistics.median(append)
        row["ours_kernels_per_call"] = len(events) / L
    errors = np.asarray(box[0].errors)
    if errors.any():
        print(f"  warning: append counted bad input {errors.tolist()}: the workload is wrong")
    return row


# ---- the original (torch, in a subprocess) ----------------------------------------------------
def original_in_subprocess(rows, args):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "original.json")
        cmd = [args.torch_python, append_original.__file__, path,
               "--rows", ",".join(map(str, rows)), "--peers", args.peers]
        # cpp_extension needs ninja on PATH: the one next to this interpreter (pip's) will do
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                   + os.environ.get("PATH", ""))
        rc = subprocess.call(cmd, env=env)
        if rc != 0 or not os.path.isfile(path):
            return {"skipped": f"the original's subprocess exited with {rc}"}
        with open(path) as fh:
            return {k if k == "skipped" else int(k): v for k, v in json.load(fh).items()}


# ---- report -----------------------------------------------------------------------------------
def table(rows):
    def f(v, fmt=".2f"):
        return format(v, fmt) if v is not None else "–"
    out = ["| rows | requests | format | ours device µs | ours µs/call | original device µs "
           "| original µs/call | original ÷ ours (device) | original ÷ ours (µs/call) |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        od, oc = r.get("original_device_us"), r.get("original_us_per_call")
        d, c = r.get("ours_device_us"), r["ours_us_per_call"]
        out.append(f"| {r['rows']} | {r['requests']} | {r['format']} | {f(d)} | {f(c)} | {f(od)} "
                   f"| {f(oc)} | {f(od / d if od and d else None)} | {f(oc / c if oc else None)} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="rows 1,8,64 and few repetitions")
    ap.add_argument("--rows", type=sizes, help="default 1,8,64,512,4k,64k (quick: 1,8,64)")
    ap.add_argument("--formats", default="fp8_token,ds_fp8")
    ap.add_argument("--peers", default=".peers", help="folder holding original_append_swa.cu")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="interpreter with torch + CUDA for the original")
    ap.add_argument("--peer-script", action="store_true",
                    help="also run the peers' bench_original_append.py as found")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--json", type=output_path, help="write the rows here")
    args = ap.parse_args(argv)
    rows = args.rows or ([1, 8, 64] if args.quick else [1, 8, 64, 512, 4096, 65536])
    # JAX takes 75 % of the GPU by default; the original's process needs some of
    # it. Read when the GPU client starts, which is not yet.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    reps = args.reps or (3 if args.quick else 7)
    results = []
    for fmt in args.formats.split(","):
        for T in rows:
            results.append(time_ours(T, fmt, reps, loop=2 if args.quick else 20))
            print(f"ours T={T} {fmt}: {results[-1]['ours_us_per_call']:.2f} us/call, device "
                  f"{results[-1].get('ours_device_us')} us", flush=True)
    original = original_in_subprocess(rows, args)
    if "skipped" in original:
        print(f"original skipped: {original['skipped']}")
    for r in results:
        r.update(original.get(r["rows"], {}))
    if args.peer_script:
        script = os.path.join(args.peers, "bench_original_append.py")
        print(f"\n{script} as found (its own rows and workload):", flush=True)
        subprocess.call([args.torch_python, script])
    print()
    print(table(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "original": original.get("skipped", "ran"), "rows": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
