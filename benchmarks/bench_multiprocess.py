"""The V4-Flash decode step on a sharded cache, driven by one process for
all devices against one process per device under jax.distributed: ms a
step at B requests per device. Both runs compile the same step
(dsv4_jax/app/bench/model_step.py's default, every op per shard, no
collectives) on the same global state (filled_state.py's, per shard); the
two should match within noise, since nothing crosses processes inside a
step.

    python benchmarks/bench_multiprocess.py                      # 2 GPUs: B = 64 each, 4k
    python benchmarks/bench_multiprocess.py --contexts 4k,64k --json mp.json
    python benchmarks/bench_multiprocess.py --quick              # CPU smoke run: 2 x 2 devices

Without --process-id it starts the runs itself (dsv4_jax.multiprocess): first one
process seeing every device, then one process per device (or per
--per-process devices), each timing its own loop of steps; it prints ms a
step of each process and the ratio of the slowest to the one-process run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

PLATFORMS = ("cuda", "cpu")


# ---- one process of a run ---------------------------------------------------------------------
def _global(mesh, spec, array):
    """A global array of `array` (the same numpy on every process), laid out
    by `spec`; each process puts only its own devices' pieces."""
    import jax
    from jax.sharding import NamedSharding
    return jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec),
                                        lambda index: array[index])


def sharded_inputs(cfg, mesh, B, context, seed):
    """model_step.step_inputs of B requests on every shard: per-token and
    per-request rows shard after shard with shard-local slots, parameters
    and the attention's sinks and frequencies replicated."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import dsv4_jax as dj
    from dsv4_jax.app.bench.model_step import step_inputs
    S = cfg.num_shards
    axis = cfg.shard_axis
    one = step_inputs(B, context, seed)
    local = dj.StepMeta.build(token_slot=np.asarray(one["slot"]), token_pos=np.asarray(one["pos"]),
                              lengths=np.asarray(one["lengths"]), device_put=False)
    rows = lambda a: _global(mesh, P(axis), np.concatenate([np.asarray(a)] * S))
    whole = ("params", "sink", "inv_freq")        # the same on every shard
    x = {k: rows(v) for k, v in one.items() if k != "meta" and k not in whole}
    x["meta"] = dj.StepMeta(rows(local.data), local.num_tokens, local.num_requests,
                            local.num_new_blocks, local.num_resets)
    for k in whole:
        x[k] = jax.tree_util.tree_map(lambda a: _global(mesh, P(), np.asarray(a)), one[k])
    return x


def sharded_filled_state(cfg, mesh, context, seed):
    """filled_state over the global shapes, every shard's block table a
    permutation of its own blocks, created on the shards' devices."""
    import jax
    import numpy as np
    from dsv4_jax.app.bench.filled_state import _filled
    from dsv4_jax.sharding import state_sharding
    local = cfg.local()
    rng = np.random.default_rng(seed)
    R, MB = local.max_requests, local.max_blocks_per_request
    table = np.concatenate([rng.permutation(local.num_blocks)[:R * MB].reshape(R, MB)
                            for _ in range(cfg.num_shards)]).astype(np.int32)
    make = jax.jit(lambda t: _filled(cfg, context, seed, t),
                   out_shardings=state_sharding(cfg, mesh))
    return make(table)


def run_one(args):
    """This process's part of a run: prints one line `RESULT {json}`."""
    import jax
    import numpy as np
    if args.processes > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.processes, process_id=args.process_id)
    import dsv4_jax as dj
    from dsv4_jax.app.bench.model_step import Variant, make_step
    from dsv4_jax.app.bench.timing import time_it
    from dsv4_jax.errors import shard_error_counts
    from dsv4_jax.sharding import shard_config
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    S = mesh.shape["data"]
    rows = []
    for context in args.contexts:
        cfg = shard_config(dj.CacheConfig.flash(max_requests=args.batch * S, max_context=context),
                           mesh, "data")
        box = [sharded_filled_state(cfg, mesh, context, args.seed)]
        x = sharded_inputs(cfg, mesh, args.batch, context, args.seed)
        with jax.set_mesh(mesh):
            f = make_step(cfg, context, Variant(), "auto")
            hlo = f.lower(box[0], x).compile().as_text()

            def call(i):
                box[0], h = f(box[0], x)
                return h
            seconds = time_it(call, 1, args.loop, args.reps, args.warm)
        collectives = [c for c in ("all-gather", "all-reduce", "collective-permute",
                                   "all-to-all", "reduce-scatter") if c in hlo]
        rows.append({"context": context, "B_per_device": args.batch, "shards": S,
                     "ms": seconds * 1e3, "collectives": collectives,
                     "errors": {str(k): {kind.name: n for kind, n in counts.items()}
                                for k, (_, counts) in shard_error_counts(box[0]).items()}})
        box.clear()
    print("RESULT " + json.dumps({"process": jax.process_index(), "processes": args.processes,
                                  "devices": [str(d) for d in jax.local_devices()],
                                  "device_kind": jax.local_devices()[0].device_kind,
                                  "rows": rows}), flush=True)
    if args.processes > 1:
        jax.distributed.shutdown()


# ---- the two runs -----------------------------------------------------------------------------
def _env(platform, devices):
    if platform == "cpu":
        return {"JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={len(devices)}"}
    return {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}


# A child process: jax.distributed first, as JAX asks, before anything of
# dsv4_jax is imported; then this script as __main__ (argv: coordinator,
# processes, process id, the script, then main's options).
_CHILD = ("import runpy, sys, jax; a = sys.argv; "
          "jax.distributed.initialize(coordinator_address=a[1], num_processes=int(a[2]), "
          "process_id=int(a[3])); "
          "sys.argv = a[4:]; runpy.run_path(a[4], run_name='__main__')")


def _run(args, processes, per_process):
    from dsv4_jax.multiprocess import run_processes

    def command(i, address):
        return [sys.executable, "-c", _CHILD, address, str(processes), str(i),
                os.path.abspath(__file__), "--process-id", str(i),
                "--processes", str(processes), "--coordinator", address,
                "--batch", str(args.batch), "--contexts", ",".join(map(str, args.contexts)),
                "--reps", str(args.reps), "--loop", str(args.loop), "--warm", str(args.warm),
                "--seed", str(args.seed)]
    env = lambda i: _env(args.platform, range(i * per_process, (i + 1) * per_process))
    results = run_processes(command, processes, env=env, timeout_s=args.timeout)
    out = []
    for r in results:
        lines = [l for l in r.output.splitlines() if l.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            raise RuntimeError(f"process {r.process_id} of {processes} "
                               f"{'timed out' if r.returncode is None else 'failed'}:\n"
                               + r.output[-3000:])
        out.append(json.loads(lines[-1][len("RESULT "):]))
    return out


def main(argv=None):
    from dsv4_jax.app.arguments import output_path, sizes
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", choices=PLATFORMS, help="cuda (default) or cpu")
    ap.add_argument("--devices", type=int, default=2, help="devices in all (default 2)")
    ap.add_argument("--per-process", type=int, default=1,
                    help="devices of each process in the multi-process run (default 1)")
    ap.add_argument("--batch", type=int, help="requests per device (default 64; quick 1)")
    ap.add_argument("--contexts", type=sizes, help="tokens per request (default 4k; quick 512)")
    ap.add_argument("--reps", type=int, help="samples (default 7; quick 3)")
    ap.add_argument("--loop", type=int, help="steps a sample (default 20; quick 2)")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a CPU smoke run: 2 processes of 2 CPU devices, B = 1, context 512")
    ap.add_argument("--timeout", type=float, default=570, help="seconds for each run")
    ap.add_argument("--json", type=output_path, help="write both runs' results here")
    ap.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    args.platform = args.platform or ("cpu" if q else "cuda")
    if q:
        args.devices, args.per_process = 4, 2
    args.batch = args.batch or (1 if q else 64)
    args.contexts = args.contexts or ([512] if q else [4096])
    args.reps = args.reps or (3 if q else 7)
    args.loop = args.loop or (2 if q else 20)
    if args.process_id is not None:
        run_one(args)
        return 0
    if args.devices % args.per_process:
        ap.error("--devices must be a multiple of --per-process")
    one = _run(args, 1, args.devices)
    many = _run(args, args.devices // args.per_process, args.per_process)
    print(f"{one[0]['device_kind']} x {args.devices}, B = {args.batch} per device, V4-Flash "
          f"decode step (ms a step, median of {args.reps} samples of {args.loop} steps)")
    print("| context | 1 process | " + " | ".join(f"process {p['process']} of {len(many)}"
                                                  for p in many) + " | slowest / 1 process |")
    print("|---:|---:|" + "---:|" * len(many) + "---:|")
    for i, context in enumerate(args.contexts):
        base = one[0]["rows"][i]["ms"]
        each = [p["rows"][i]["ms"] for p in many]
        print(f"| {context} | {base:.3f} | " + " | ".join(f"{m:.3f}" for m in each)
              + f" | {max(each) / base:.3f} |")
    for run in (one, many):
        for p in run:
            for r in p["rows"]:
                if r["collectives"] or r["errors"]:
                    print(f"WARNING: {p['processes']}-process run, process {p['process']}, "
                          f"context {r['context']}: collectives {r['collectives']}, "
                          f"error counts {r['errors']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"one_process": one, "processes": many, "batch": args.batch}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
