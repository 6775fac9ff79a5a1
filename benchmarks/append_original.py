"""The original PyTorch append kernel (original_append_swa.cu of the peers
folder) timed on the workload of bench_append_vs_original.py. A script of its own,
importing neither JAX nor this package, so that it runs in a torch
interpreter of its own: torch and JAX never share a process or the GPU's
memory pool.

    python append_original.py OUT.json --rows 1,8,64 --peers .peers

The .cu is built with torch's cpp_extension exactly as the peers'
bench_original_append.py builds it (same module name and flags, so the two
share the build) and timed the way that script times it (CUDA events over
200 eager launches after 20, rotating input sets) for µs/call, and from the
torch profiler's kernel records for device µs. Without torch, CUDA or the
.cu the result is {"skipped": why}.
"""
import argparse
import json
import os
import statistics
import tempfile

import numpy as np

BASE_POS = 4096


def workload(T):
    """(R, token_slot, token_pos) of T rows: R = T requests of one token for
    T <= 64, else T // 128 requests of 128 tokens (a full window each),
    tokens grouped by request in ascending positions from 4096 (what
    CacheManager emits)."""
    R = T if T <= 64 else T // 128
    per = T // R
    slot = np.repeat(np.arange(R, dtype=np.int32), per)
    pos = BASE_POS + np.tile(np.arange(per, dtype=np.int32), R)
    return R, slot, pos


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where to write the JSON")
    ap.add_argument("--rows", required=True, help="comma-separated row counts")
    ap.add_argument("--peers", required=True, help="folder holding original_append_swa.cu")
    args = ap.parse_args()
    with open(args.out, "w") as fh:
        json.dump(time_original([int(v) for v in args.rows.split(",")], args.peers), fh)


if __name__ == "__main__":
    main()
