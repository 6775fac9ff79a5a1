"""Benchmarks of the ops, runnable from anywhere the package is installed.

suite.py        the ops benchmark (`python -m dsv4_jax bench`, benchmarks/run.py)
  timing.py     the sampling loop and a run's record of rows and references
  inputs.py     the caches and inputs timed on, the bytes each op must move
  ops.py        append, the gathers, flush
  decode_step.py  the cache work of a V4-Flash decode step
  report.py     tables, markdown for benchmarks/RESULTS.md, the plot
indexer.py      indexer_topk on the GPU (`python -m dsv4_jax.bench.indexer`,
                benchmarks/indexer.py)
device_timeline.py  the GPU's kernels of a call as they ran (CUPTI), for indexer.py
"""
