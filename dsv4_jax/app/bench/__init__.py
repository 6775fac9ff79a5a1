"""The ops benchmark behind `python -m dsv4_jax bench`, and what the
benchmarks of the checkout (benchmarks/) build on.

suite.py        the ops benchmark (`python -m dsv4_jax bench`, benchmarks/run.py)
  options.py    its options and each platform's defaults
  timing.py     the sampling loop and a run's record of rows and references
  inputs.py     the caches and inputs timed on, the bytes each op must move
  ops.py        each op at several sizes
  report.py     tables, markdown (the tables of docs/perf/ops.md), the plot
  model_step.py   a V4-Flash decode step as a model calls the library, timed
                  (also benchmarks/bench_decode_step.py's step)
  filled_state.py the full random valid state it runs on
device_timeline.py  the GPU's kernels of a call as they ran (CUPTI) and what a
                traced step spent where, per op family
"""
