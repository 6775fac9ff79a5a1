"""Long prompts' cache writes through every V4-Flash layer (issue 37), from a
checkout: `python benchmarks/bench_prefill.py [options]` is
`python -m dsv4_jax.bench.prefill` (dsv4_jax/bench/prefill.py).

    python benchmarks/bench_prefill.py --json prefill.json          # 1x65536/8192, 8x8192/8192
    python benchmarks/bench_prefill.py --write separate --device-timeline
    python benchmarks/bench_prefill.py --scenarios 1x1024/256 --model tiny   # CPU-sized
    python benchmarks/bench_prefill.py --markdown prefill.json      # a saved run's table
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.bench.prefill import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
