"""One process of the multi-process workload (tests/properties/
test_multiprocess.py starts them): runs support.multiprocess_workload on
this process's shards and writes their bytes (npz) and what it saw (json).

    python tests/support/multiprocess_worker.py OUT --processes 2 --process-id 0 \
        --coordinator 127.0.0.1:PORT
    python tests/support/multiprocess_worker.py OUT          # one process, every device

The caller sets the devices each process sees (XLA_FLAGS for CPU devices,
CUDA_VISIBLE_DEVICES for GPUs) in its environment.
"""
import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402


def routing_checks(host, state, fn, meta, x, q, i):
    """Bad routing on every process at step 1, each refused with nothing
    written; what each raised goes into the process's report."""
    from support.multiprocess_workload import schedule
    from dsv4_jax.multiprocess import StepAbandoned
    if i != 1:
        return
    m = host.manager
    _, shard_of = schedule(host.cfg.num_shards)
    seen = {}
    # a request admitted by another process: process 0 is handed one, the
    # others plan an empty step and learn of the failure in the exchange
    theirs = next(r for r, k in shard_of.items() if k not in m.shards)
    try:
        m.prepare_step({theirs: 1} if m.process == 0 else {})
    except (KeyError, StepAbandoned) as e:
        seen["wrong_process_request"] = f"{type(e).__name__}: {e}"
    other = next(k for k in range(host.cfg.num_shards) if k not in m.shards)
    try:
        m.admit("stray", shard=other)
    except ValueError as e:
        seen["admit_on_other_shard"] = str(e)
    # metadata of this process's shards alone, not the global array
    alone = dataclasses.replace(meta, data=m.local_rows(meta.data))
    try:
        with jax.set_mesh(host.mesh):
            fn(state, alone, x, q)
    except ValueError as e:
        seen["process_local_meta"] = str(e).split("\n")[0]
    seen["state_alive"] = not any(l.is_deleted() for l in jax.tree_util.tree_leaves(state))
    host.routing = seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--coordinator")
    args = ap.parse_args()
    if args.processes > 1:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.processes, process_id=args.process_id)
    from support import multiprocess_workload as W
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    cfg = W.config(mesh)
    host = (W.ProcessHost if args.processes > 1 else W.SingleHost)(cfg, mesh)
    saved, info = W.run(host, checks=routing_checks if args.processes > 1 else None)
    info.update(process=jax.process_index(), shards=list(host.shards),
                devices=[str(d) for d in jax.local_devices()],
                routing=getattr(host, "routing", None))
    np.savez(args.out + ".npz", **saved)
    with open(args.out + ".json", "w") as fh:
        json.dump(info, fh)
    if args.processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
