"""The cache work of a V4-Flash decode step as a model runs it (issue 36):
host ms per step and, on a GPU, kernels, busy time and span per step from
the device timeline. The implementation is dsv4_jax/bench_step.py.

    python benchmarks/bench_decode_step.py --json step.json            # B 1..256 x 4k, 64k
    python benchmarks/bench_decode_step.py --variants base,no-return-state,unroll
    python benchmarks/bench_decode_step.py --quick                     # CPU-sized smoke run
    python benchmarks/bench_decode_step.py --markdown step.json        # a saved run's tables
"""
import os
import sys

# The largest case (64k context x 256 requests) holds ~56 GiB of cache: more
# than JAX's default share (75 %) of an 80 GB card leaves for it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4_jax.bench_step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
