"""The V4-Flash decode step on 2 GPUs as one process against two processes
(issue 41), from a checkout: `python benchmarks/bench_multiprocess.py
[options]` is `python -m dsv4_jax.bench.multiprocess_step`
(dsv4_jax/bench/multiprocess_step.py).

    python benchmarks/bench_multiprocess.py                      # 2 GPUs, B = 64 each, 4k
    python benchmarks/bench_multiprocess.py --contexts 4k,64k --json mp.json
    python benchmarks/bench_multiprocess.py --quick              # CPU smoke run
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.bench.multiprocess_step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
