"""The cache work of a V4-Flash decode step as a model runs it (issue 36),
from a checkout: `python benchmarks/bench_decode_step.py [options]` is
`python -m dsv4_jax.bench.model_step_bench` (dsv4_jax/bench/model_step_bench.py).

    python benchmarks/bench_decode_step.py --json step.json            # B 1..256 x 4k, 64k
    python benchmarks/bench_decode_step.py --variants base,no-return-state,unroll
    python benchmarks/bench_decode_step.py --quick --sequence          # CPU-sized smoke run
    python benchmarks/bench_decode_step.py --markdown step.json        # a saved run's tables
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.bench.model_step_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
