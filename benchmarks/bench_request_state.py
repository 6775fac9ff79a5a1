"""Moving one request's cache (issue 40), from a checkout:
`python benchmarks/bench_request_state.py [options]` is
`python -m dsv4_jax.bench.request_state` (dsv4_jax/bench/request_state.py).

    python benchmarks/bench_request_state.py --json request_state.json   # V4-Flash, 4k and 64k
    python benchmarks/bench_request_state.py --model tiny --contexts 512,1024 --reps 2   # CPU-sized
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.bench.request_state import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
