"""The application built on the library: `python -m dsv4_jax` and what it runs.

cli.py         the command line (demo, plan, bench, info)
arguments.py   its argument types (also the checkout's benchmarks/)
ui.py          its terminal output: rich tables, or plain text
demo.py        the checked decode loop of `demo`
workload.py    what the demo checks a run with: random layer parameters and
               the byte-for-byte comparison of two runs' caches
bench/         the ops benchmark of `bench`, and what benchmarks/ builds on

The library (everything outside this folder) never imports it.
"""
