"""The sharded cache across processes (docs/design/sharding.md, "Across
processes"): two jax.distributed processes on this machine, each driving its
own devices and its own shards' tables, against one process driving all of
them. Every process runs tests/support/multiprocess_worker.py (a workload of
every op, support/multiprocess_workload.py) and writes its shards' bytes.

CPU: each process gets 2 CPU devices (a 4-shard mesh), the one-process run
4. GPU (`-m gpu`, a host of 2 GPUs): each process gets one GPU, the
one-process run both."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dsv4_jax.multiprocess import run_processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "multiprocess_worker.py")
TIMEOUT_S = 240     # a run of 3 processes takes ~15 s on 2 idle cores


def gpu_count() -> int:
    """GPUs on this host, asked of nvidia-smi: this process must not start a
    GPU client, whose memory pool would crowd the children out."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def env_for(platform, devices):
    """A child's devices: `devices` CPU devices, or the GPUs listed."""
    if platform == "cpu":
        return {"JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": devices,
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def run_worker(out, num_processes, env):
    cmd = lambda i, address: [sys.executable, WORKER, f"{out}{i}", "--processes",
                              str(num_processes), "--process-id", str(i),
                              "--coordinator", address]
    results = run_processes(cmd, num_processes, env=env, timeout_s=TIMEOUT_S, cwd=ROOT)
    for r in results:
        assert r.returncode == 0, (f"process {r.process_id} of {num_processes} "
                                   f"{'timed out or was stopped' if r.returncode is None else 'failed'}"
                                   f":\n{r.output[-4000:]}")
    reports = []
    for i in range(num_processes):
        with open(f"{out}{i}.json") as fh:
            reports.append(json.load(fh))
        reports[-1]["bytes"] = dict(np.load(f"{out}{i}.npz"))
    return reports


@pytest.mark.slow(reason="two processes against one; the two-process example and README script stay")
@pytest.mark.parametrize("platform", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        gpu_count() < 2, reason="needs 2 GPUs on one host")])])
def test_two_processes_equal_one_process_byte_for_byte(platform, tmp_path):
    per_process = 2 if platform == "cpu" else 1
    total = 2 * per_process
    (single,) = run_worker(tmp_path / "single", 1, lambda i: env_for(
        platform, total if platform == "cpu" else "0,1"))
    procs = run_worker(tmp_path / "proc", 2, lambda i: env_for(
        platform, per_process if platform == "cpu" else str(i)))

    # each process drives its own devices, and their shards, in mesh order
    assert [p["process"] for p in procs] == [0, 1]
    assert [p["shards"] for p in procs] == [list(range(per_process)),
                                            list(range(per_process, total))]
    assert single["shards"] == list(range(total))
    for p in [single, *procs]:
        assert p["collectives"] == [], f"collectives in the step: {p['collectives']}"

    # every shard's state and every step's outputs, byte for byte
    got = {**procs[0]["bytes"], **procs[1]["bytes"]}
    want = single["bytes"]
    assert sorted(got) == sorted(want)
    assert {k.split("/")[0] for k in got} == {str(k) for k in range(total)}
    assert any("/state" in k for k in want) and any("/step4" in k for k in want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)

    # the bad rows were the last shard's: counted there, on the process that
    # holds it, and nowhere else
    last = str(total - 1)
    assert set(single["errors"]) == {last}
    kinds = single["errors"][last][1]
    assert kinds == {"NONFINITE": 1, "BAD_SLOT": 5}   # one NaN row; a bad slot in 5 reads
    assert procs[0]["errors"] == {} and procs[0]["check_errors"] is None
    assert procs[1]["errors"] == {last: [1, kinds]}
    assert f"shard {last} (process 1): bad_slot 5, nonfinite 1" in procs[1]["check_errors"]

    # bad routing, refused on every process with nothing written (the bytes
    # above are those of a run without these calls)
    r0, r1 = procs[0]["routing"], procs[1]["routing"]
    assert r0["wrong_process_request"].startswith("KeyError") and \
        "is not admitted on process 0" in r0["wrong_process_request"]
    assert r1["wrong_process_request"].startswith("StepAbandoned")
    assert f"shard {per_process} is process 1's, this is process 0" in r0["admit_on_other_shard"]
    assert "shard 0 is process 0's, this is process 1" in r1["admit_on_other_shard"]
    for r in (r0, r1):
        assert r["process_local_meta"].startswith("meta.data: expected shape")
        assert r["state_alive"]


def test_serving_example_runs_two_processes():
    """examples/multiprocess_serving.py starts its processes, each serves the
    requests routed to it (some wait for a free slot) and finds no bad input."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multiprocess_serving.py"),
                          "--steps", "6", "--timeout", str(TIMEOUT_S)],
                         capture_output=True, text=True, timeout=TIMEOUT_S + 30, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "process 0: shards (0, 1) served, no bad input" in out.stdout
    assert "process 1: shards (2, 3) served, no bad input" in out.stdout
    assert "process 0 step 0: 4 requests, 4 waiting" in out.stdout   # its shards were full


def test_process_manager_in_one_process_fixed_sizes_and_row_checks():
    """In one process a ProcessCacheManager holds every shard and equals the
    ShardedCacheManager's metadata; fixed sizes too small for a shard raise
    CacheFullError naming it with nothing changed; rows that are not a whole
    number of this process's shards are refused."""
    import jax
    from dsv4_jax import CacheConfig, CacheFullError
    from dsv4_jax.multiprocess import ProcessCacheManager
    from dsv4_jax.sharding import ShardedCacheManager, shard_config
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    cfg = shard_config(CacheConfig.tiny(max_requests=8, num_blocks=32), mesh, "data")
    mine, ref = ProcessCacheManager(cfg, mesh), ShardedCacheManager(cfg)
    assert mine.shards == (0, 1, 2, 3)
    for r, k in [(10, 0), (11, 2), (12, 2), (13, 3)]:
        mine.admit(r, shard=k)
        ref.admit(r, shard=k)
    tokens = {10: 20, 11: 5, 12: 40, 13: 1}
    with pytest.raises(CacheFullError, match=r"needs 64 token rows on shard 2 \(process 0\)"):
        mine.prepare_step(tokens, sizes=(32, 2, 2))
    assert mine.length_of(11) == 0                       # nothing changed
    got = mine.prepare_step(tokens, sizes=(64, 2, 2))
    want = ref.prepare_step(tokens, min_tokens=64)   # its NB, NR: 2 and 2 as well
    np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))
    assert mine.token_rows(12) == ref.token_rows(12)
    assert mine.admit() == 0 and mine.admit() == 1      # ids of process 0 of 1
    with pytest.raises(ValueError, match="expected 4 shards' rows of process 0"):
        mine.put_rows(np.zeros((6, 3), np.float32))
    with pytest.raises(KeyError, match="not admitted on process 0"):
        mine.prepare_step({99: 1})


def test_importing_dsv4_jax_leaves_jax_distributed_possible():
    """jax.distributed.initialize must come before JAX starts a backend; a
    program that imports dsv4_jax first (and registers its FFI targets) must
    still be able to call it. A fresh interpreter, one process."""
    from dsv4_jax.multiprocess import free_port
    code = ("import jax, dsv4_jax; from dsv4_jax import _ffi; _ffi.module_status(); "
            f"jax.distributed.initialize(coordinator_address='127.0.0.1:{free_port()}', "
            "num_processes=1, process_id=0); print(len(jax.devices()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) >= 1, done.stderr[-2000:]
