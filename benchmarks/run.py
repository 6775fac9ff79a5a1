"""The ops benchmark from a checkout: `python benchmarks/run.py [options]`
is `python -m dsv4_jax bench` without its default files (the code and the
options: dsv4_jax/app/bench/suite.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4_jax.app.bench.suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
