"""Helpers of the test suite, imported by the test files as `support.<module>`
(conftest.py puts tests/ on the import path). Nothing here is a test, and no
test file imports another: what two test files share lives here.

- marks: skip marks (CUDA, the CPU FFI module, host memory)
- trees: byte-level comparison and poisoning of state pytrees
- oracle: the whole-sequence numpy oracle (encoders, compressor, accumulators)
- npq: numpy quantizers and float64 epilogues of the CPU handler cases
- harness: a cache driven the way a model drives it, checked against the oracle
- inplace: assertions that a jitted step updates the state in place
- sharding: a sharded state cut into its shards
- indexer: states, queries, float32 replays and float64 oracle of the
  indexer_topk tests
"""
import pathlib

# tests/data: the golden set (tests/data/README.md)
DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
