"""The indexer_topk benchmark from a checkout: `python benchmarks/indexer.py
[options]` is `python -m dsv4_jax.bench.indexer` (dsv4_jax/bench/indexer.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.bench.indexer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
