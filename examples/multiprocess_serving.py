"""The sharded cache served by several processes (jax.distributed): each
process drives its own devices, holds the tables of its own shards, and
serves the requests routed to it. One jitted step runs on every process.

    python examples/multiprocess_serving.py                    # 2 processes, 2 CPU devices each
    python examples/multiprocess_serving.py --platform cuda    # 2 processes, one GPU each
    python examples/multiprocess_serving.py --processes 4 --devices 1

Without --process-id it starts the processes itself on this machine
(dsv4_jax.multiprocess: a free port for the coordinator, each child told its id,
the devices it sees set in its environment) and prints their output. On
several hosts start one per host (or per GPU) yourself with the same three
things jax.distributed needs:

    python examples/multiprocess_serving.py --coordinator HOST0:PORT \
        --processes N --process-id I

Routing: a request goes to process `request % N` for its whole life (any
rule every front end agrees on works; a process refuses tokens of a request
it did not admit). When a process's shards have no free slot, `admit`
raises CacheFullError and the request waits in that process's queue until
one of its requests finishes; the other processes are not affected.
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def serve(args):
    import jax
    import numpy as np
    if args.processes > 1:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.processes, process_id=args.process_id)
    import dsv4_jax as dj
    from dsv4_jax.multiprocess import ProcessCacheManager
    from dsv4_jax.sharding import init_sharded_state, shard_config

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))   # every process's devices
    S = mesh.shape["data"]
    cfg = shard_config(dj.CacheConfig.tiny(max_requests=2 * S, num_blocks=8 * S), mesh, "data")
    state = init_sharded_state(cfg, mesh)         # global arrays, shards on their owners
    manager = ProcessCacheManager(cfg, mesh)      # this process's shards only
    me, P = jax.process_index(), jax.process_count()
    params = dj.CompressorParams.neutral("csa")
    hca = dj.CompressorParams.neutral("hca")

    def step(state, meta, kv, ckv, score, ikv, iscore, hkv, hscore):
        state = dj.apply_step(state, meta)
        for layer, kind in enumerate(cfg.layer_kinds):
            if kind == "csa":
                state = dj.write_layer(state, layer, meta, kv, ckv, score, params,
                                       index_kv=ikv, index_score=iscore)
            elif kind == "hca":
                state = dj.write_layer(state, layer, meta, kv, hkv, hscore, hca)
            else:
                state = dj.write_layer(state, layer, meta, kv)
        window, pos, state = dj.gather_window(state, 0, meta.token_slot)
        return state, window
    step = jax.jit(step, donate_argnums=0)   # the state donated: updated in place

    # every process sees the same request stream and keeps the ones routed to it
    prompts = {r: 40 + 37 * r % 150 for r in range(4 * S)}
    queue = collections.deque(r for r in prompts if r % P == me)
    decode = {}                     # admitted request -> decode steps left
    rng = np.random.default_rng(me)
    for t in range(args.steps):
        tokens = {}
        while queue:                # admit what fits; the rest waits for a free slot
            try:
                rid = manager.admit(queue[0])
            except dj.CacheFullError:
                break
            queue.popleft()
            tokens[rid], decode[rid] = prompts[rid], 3
        for rid in decode:
            tokens.setdefault(rid, 1)
        meta = manager.prepare_step(tokens)   # every process calls it every step
        rows = len(manager.shards) * manager.tokens_per_shard   # this process's token rows
        x = lambda width: rng.standard_normal((rows, width), np.float32)
        with jax.set_mesh(mesh):
            state, window = step(state, meta, *manager.put_rows(
                [x(512).astype(jax.numpy.bfloat16), x(1024), x(1024), x(256), x(256),
                 x(512), x(512)]))
        mine = manager.local_rows(window)     # [rows, 128, 512]: this process's rows only
        for rid in list(decode):
            decode[rid] -= tokens[rid] == 1
            if decode[rid] == 0:
                manager.release(rid)
                del decode[rid]
        print(f"process {me} step {t}: {len(tokens)} requests, {len(queue)} waiting, "
              f"window rows {mine.shape[0]}", flush=True)
    dj.check_errors(state)          # this process's shards
    print(f"process {me}: shards {manager.shards} served, no bad input", flush=True)
    if args.processes > 1:
        jax.distributed.shutdown()


def launch(args):
    from dsv4_jax.multiprocess import run_processes

    def command(i, address):
        return [sys.executable, os.path.abspath(__file__), "--processes", str(args.processes),
                "--process-id", str(i), "--coordinator", address, "--steps", str(args.steps)]

    def env(i):
        if args.platform == "cpu":
            return {"JAX_PLATFORMS": "cpu",
                    "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
        first = i * args.devices
        return {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES":
                ",".join(str(first + j) for j in range(args.devices))}
    results = run_processes(command, args.processes, env=env, timeout_s=args.timeout)
    for r in results:
        print(f"--- process {r.process_id} (exit {r.returncode})")
        print("\n".join(line for line in r.output.splitlines() if "Gloo" not in line))
    return 0 if all(r.returncode == 0 for r in results) else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--process-id", type=int, help="run as this process (else start them all)")
    ap.add_argument("--coordinator", help="HOST:PORT of process 0 (with --process-id)")
    ap.add_argument("--platform", default="cpu", choices=["cpu", "cuda"],
                    help="devices of each started process: CPU devices or GPUs")
    ap.add_argument("--devices", type=int, help="devices per process (default 2 CPU, 1 GPU)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    args.devices = args.devices or (2 if args.platform == "cpu" else 1)
    if args.process_id is None:
        return launch(args)
    serve(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
