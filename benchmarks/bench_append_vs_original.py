"""dj.append against the append kernel of the original PyTorch cache
(original_append_swa.cu of the peers folder), same rows, same workload, one
device call (issue 36).

    python benchmarks/bench_append_vs_original.py [--peers .peers] [--json PATH]
    python benchmarks/bench_append_vs_original.py --quick     # CPU: ours only, host-timed

Workload at T rows: R = T requests of one token for T <= 64, else T // 128
requests of 128 tokens (a full window each), tokens grouped by request in
ascending positions from 4096 (what CacheManager emits). Both kernels write
every token into its request's 128-slot window.

Ours: one jit of L appends on L layers (the state donated); "µs/call" is a
host-timed loop of such calls over L, "device µs" the median duration of
the append kernel on the GPU timeline. Formats: fp8_token (the original's
layout: fp8 codes, a per-token f32 scale, bf16 rope) and ds_fp8 (the
default, a UE8M0 scale per 64 channels).

Original: the .cu is built with torch's cpp_extension exactly as the peers'
bench_original_append.py builds it (same module name and flags, so the two
share the build) and timed the way that script times it (CUDA events over
200 eager launches after 20, rotating input sets) for µs/call, and from the
torch profiler's kernel records for device µs. It runs in a subprocess
(`--torch-python`, default this interpreter) so that torch and JAX never
share a process or the GPU's memory pool; without torch, CUDA or the peers
folder it is skipped with the reason. `--peer-script` also runs the peers'
script as found (its own rows and workload) for reference.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BASE_POS = 4096


def sizes(text):
    return [int(v[:-1]) * 1024 if v.endswith("k") else int(v) for v in text.split(",") if v]


def workload(T):
    """(R, token_slot, token_pos) for T rows, grouped by request."""
    R = T if T <= 64 else T // 128
    per = T // R
    slot = np.repeat(np.arange(R, dtype=np.int32), per)
    pos = BASE_POS + np.tile(np.arange(per, dtype=np.int32), R)
    return R, slot, pos


# ---- ours -------------------------------------------------------------------------------------
def time_ours(T, fmt, reps, loop):
    import jax
    import jax.numpy as jnp
    import dsv4_jax as dj
    from dsv4_jax import bench_step as bs
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
    box, turn = [dj.init_state(cfg)], [0]

    def call():
        turn[0] += 1
        box[0] = f(box[0], kvs[turn[0] % 2])
        return box[0].errors
    row = {"rows": T, "requests": R, "format": fmt,
           "ours_us_per_call": bs.host_ms(call, 3, reps, loop) * 1e3 / L}
    events = bs.kernel_events(call)
    if events:
        append = [d / 1e3 for _, d, name in events if "Append" in name]
        row["ours_device_us"] = statistics.median(append)
        row["ours_kernels_per_call"] = len(events) / L
    errors = np.asarray(box[0].errors)
    if errors.any():
        print(f"  warning: append counted bad input {errors.tolist()}: the workload is wrong")
    return row


# ---- the original (torch, in a subprocess) ----------------------------------------------------
def time_original(rows, peers):
    """{T: {"original_us_per_call", "original_device_us"}} or {"skipped": why}."""
    source = os.path.join(peers, "original_append_swa.cu")
    if not os.path.isfile(source):
        return {"skipped": f"{source} not found (copy the peers folder there, or pass --peers)"}
    try:
        import torch
        from torch.utils.cpp_extension import load
    except ImportError as e:
        return {"skipped": f"no torch ({e})"}
    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA device"}
    try:
        mod = load(name="original_append_swa", sources=[source], verbose=False,
                   extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    except Exception as e:   # no nvcc or ninja, a compile error: say so, keep our rows
        return {"skipped": f"building {source} failed: {e}"}
    dev = torch.device("cuda")
    out = {}
    for T in rows:
        R, slot, pos = workload(T)
        sets = [(torch.randn(T, 512, device=dev).to(torch.bfloat16),
                 torch.from_numpy(slot).to(dev), torch.from_numpy(pos).to(dev)) for _ in range(2)]
        W = 128
        pools = (torch.zeros(R, W, 448, dtype=torch.uint8, device=dev),
                 torch.zeros(R, W, 64, dtype=torch.bfloat16, device=dev),
                 torch.zeros(R, W, dtype=torch.float32, device=dev),
                 torch.zeros(R, W, dtype=torch.int32, device=dev),
                 torch.zeros(R, dtype=torch.int32, device=dev))

        def run(i):
            kv, sl, po = sets[i % 2]
            mod.append_swa(kv, sl, po, *pools, 64)
        for i in range(20):
            run(i)
        torch.cuda.synchronize()
        n = 200
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            run(i)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / n
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(20):
                run(i)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:   # the chrome trace's format is stable
            prof.export_chrome_trace(os.path.join(d, "t.json"))
            with open(os.path.join(d, "t.json")) as fh:
                trace = json.load(fh)
        kernels = [e["dur"] for e in trace.get("traceEvents", [])
                   if e.get("cat") == "kernel" and "append_swa" in e.get("name", "")]
        out[T] = {"original_us_per_call": us,
                  "original_device_us": statistics.median(kernels) if kernels else None}
        print(f"original T={T}: {us:.2f} us/call, device "
              f"{out[T]['original_device_us']} us", flush=True)
    return out


def original_in_subprocess(rows, args):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "original.json")
        cmd = [args.torch_python, os.path.abspath(__file__), "--original-only", path,
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="rows 1,8,64 and few repetitions")
    ap.add_argument("--rows", help="default 1,8,64,512,4k,64k (quick: 1,8,64)")
    ap.add_argument("--formats", default="fp8_token,ds_fp8")
    ap.add_argument("--peers", default=".peers", help="folder holding original_append_swa.cu")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="interpreter with torch + CUDA for the original")
    ap.add_argument("--peer-script", action="store_true",
                    help="also run the peers' bench_original_append.py as found")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--json")
    ap.add_argument("--original-only", metavar="OUT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = sizes(args.rows or ("1,8,64" if args.quick else "1,8,64,512,4k,64k"))
    if args.original_only:
        with open(args.original_only, "w") as fh:
            json.dump(time_original(rows, args.peers), fh)
        return 0
    # JAX takes 75 % of the GPU by default; the original's process needs some of it
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path.insert(0, ROOT)
    import jax
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
    sys.exit(main())
