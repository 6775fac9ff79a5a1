"""dsv4_jax/app/workload.py's compare_states on bf16 leaves: identical bytes
pass whatever they hold (Inf or NaN poison the op never touched, without a
floating-point warning), a difference within one bf16 ulp of the row's
largest finite value passes and is counted, and a larger one fails."""
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.app.workload import Flips, compare_states


def bf16_rows(rng):
    want = rng.standard_normal((3, 64)).astype(np.float32)
    want[0, :5] = [np.inf, -np.inf, np.nan, np.inf, np.nan]      # poison in both
    return {"x": jnp.asarray(want, jnp.bfloat16)}


def test_identical_poison_passes_without_a_warning():
    want = bf16_rows(np.random.default_rng(1))
    flips = Flips()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare_states(want, want, flips)
    assert flips.bf16 == 0 and flips.total == 3 * 64


def test_a_difference_is_judged_against_the_rows_largest_value():
    rng = np.random.default_rng(2)
    want = bf16_rows(rng)
    w = np.asarray(want["x"], np.float32)
    ulp = np.max(np.abs(np.where(np.isfinite(w), w, 0)), axis=-1) * 2.0 ** -7
    near, far = w.copy(), w.copy()
    near[1, 7] += 0.5 * ulp[1]
    far[2, 9] += 4 * ulp[2]
    flips = Flips()
    compare_states({"x": jnp.asarray(near, jnp.bfloat16)}, want, flips)
    assert flips.bf16 == int(np.sum(np.asarray(jnp.asarray(near, jnp.bfloat16)).view(np.uint16)
                                    != np.asarray(want["x"]).view(np.uint16))) >= 1
    with pytest.raises(AssertionError, match="bf16 values differ beyond the row's ulp"):
        compare_states({"x": jnp.asarray(far, jnp.bfloat16)}, want, Flips())
