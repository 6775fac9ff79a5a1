"""The multi-request workload and the run-vs-run comparison used by the tests.

They live in the package (`dsv4_jax.workload`) so that `python -m dsv4_jax demo`
checks its cache with the same code; this module keeps the tests' import path.
"""
from dsv4_jax.workload import (  # noqa: F401
    E8M0, F8, MAX_FLIP_FRACTION, Flips, Schedule, assert_outputs_equal, compare_states,
    layer_params, read_step, step_inputs, write_step,
)
