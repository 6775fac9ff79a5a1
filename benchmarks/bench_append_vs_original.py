"""dj.append against the original PyTorch append kernel, from a checkout:
`python benchmarks/bench_append_vs_original.py [--peers .peers] [--quick]`
is `python -m dsv4_jax.bench.append_vs_original`
(dsv4_jax/bench/append_vs_original.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.bench.append_vs_original import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
