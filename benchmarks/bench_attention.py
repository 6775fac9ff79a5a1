"""Attention straight from the cache against gathers + dense attention
(issue 39), from a checkout: `python benchmarks/bench_attention.py [options]`
is `python -m dsv4_jax.bench.attention` (dsv4_jax/bench/attention.py).

    python benchmarks/bench_attention.py --json attention.json   # B 1..128 x 4k, 64k; 4k prefill
    python benchmarks/bench_attention.py --quick                 # CPU-sized smoke run
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.bench.attention import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
