"""Start the processes of a multi-process run on this machine: a free port
for the coordinator, N children each told its process id, a deadline, and
every child ended when one fails or time runs out (docs/design/sharding.md).

On several hosts a cluster's own launcher (SLURM, Kubernetes, ...) does this
job; `jax.distributed.initialize` then takes the same three things each
child gets here: the coordinator's address, the number of processes and
this process's id.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import tempfile
import time
from typing import Callable, Mapping, Sequence


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it, so runs started
    side by side get different ones)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class ProcessResult:
    process_id: int
    returncode: int | None     # None: ended by us (deadline, or another process failed)
    output: str                # stdout and stderr together


def run_processes(command: Callable[[int, str], Sequence[str]], num_processes: int, *,
                  env: Callable[[int], Mapping[str, str]] | None = None,
                  timeout_s: float = 120.0, cwd: str | None = None) -> list[ProcessResult]:
    """Run `command(process_id, coordinator_address)` for every process id,
    side by side, with the environment `os.environ | env(process_id)`.

    Returns when all have exited, or when one fails (non-zero exit) or the
    deadline passes: then the others are killed (their returncode None).
    Children are always killed and reaped before this returns, also when it
    raises."""
    address = f"127.0.0.1:{free_port()}"
    procs = []
    logs = []
    try:
        for i in range(num_processes):
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                list(command(i, address)), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                env={**os.environ, **(env(i) if env else {})}, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
    finally:
        codes = [p.poll() for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    results = []
    for i, log in enumerate(logs):
        log.seek(0)
        results.append(ProcessResult(i, codes[i], log.read()))
        log.close()
    return results
