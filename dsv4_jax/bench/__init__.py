"""Benchmarks of the ops, runnable from anywhere the package is installed.

suite.py        the ops benchmark (`python -m dsv4_jax bench`, benchmarks/run.py)
  timing.py     the sampling loop and a run's record of rows and references
  inputs.py     the caches and inputs timed on, the bytes each op must move
  ops.py        append, the gathers, flush
  report.py     tables, markdown for benchmarks/RESULTS.md, the plot
model_step_bench.py  the V4-Flash decode step as a model runs it, per batch and
                context (`python -m dsv4_jax.bench.model_step_bench`,
                benchmarks/bench_decode_step.py); the suite runs its step too
  model_step.py   the step (indexer included, every layer's reads consumed), timed
  filled_state.py the full random valid state it runs on
prefill.py      long prompts' cache writes through every layer, step by step
                (`python -m dsv4_jax.bench.prefill`, benchmarks/bench_prefill.py)
indexer.py      indexer_topk on the GPU (`python -m dsv4_jax.bench.indexer`,
                benchmarks/indexer.py)
append_vs_original.py  append against the original PyTorch kernel
                (`python -m dsv4_jax.bench.append_vs_original`,
                benchmarks/bench_append_vs_original.py)
  append_original.py   the PyTorch side, a script run in torch's own process
device_timeline.py  the GPU's kernels of a call as they ran (CUPTI) and what a
                traced step spent where
"""
