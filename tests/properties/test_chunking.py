"""Any chunking of several requests into prefill chunks and single-token
decodes, in mixed padded batches, gives the pools, window, accumulators and
gathers of the whole-sequence oracle (docs/design/testing.md).

Quantized bytes must be bit exact except one-code flips where an fp32 value
sits on a rounding boundary (the f32 online softmax against the f64 oracle);
those are counted and must stay rare.
"""
import numpy as np
import pytest

from support.harness import Harness

# every test here runs once per implementation (reference, CPU FFI, CUDA)
pytestmark = pytest.mark.usefixtures("impl_under_test")

MAX_FLIP_RATE = 1e-3


def run_schedule(h: Harness, lengths, *, big_first=0, seed=0, check_every=12):
    """Admit requests of `lengths` as slots free up; each step gives a random
    subset of the active requests a prefill chunk (random size) or, after
    their prefill, one decode token. `big_first` > 0 opens the first request
    with a chunk of that many tokens in a 256-token step."""
    rng = np.random.default_rng(seed)
    pending = list(lengths)
    prefill = {}
    steps = 0
    first = True
    while pending or h.active:
        if pending and h.mgr.free_slots and (first or rng.random() < 0.5):
            L = pending.pop(0)
            rid = h.admit(L)
            prefill[rid] = int(rng.integers(L // 3, L))
        tokens, budget, T = {}, 64, 64
        if first and big_first:
            rid = next(iter(h.active))
            tokens[rid], budget, T = big_first, 256 - big_first, 256
        first = False
        for rid in rng.permutation(list(h.active)).tolist():
            if rid in tokens or rng.random() > 0.8 or budget == 0:
                continue
            have, L = h.mgr.length_of(rid), h.active[rid].length
            if have < prefill[rid]:
                n = min(int(rng.choice([1, 2, 3, 5, 17, 37, 64])), prefill[rid] - have, budget)
            else:
                n = min(1, L - have)
            if n:
                tokens[rid] = n
                budget -= n
        if not tokens:
            continue
        h.step(tokens, T)
        steps += 1
        done = [r for r in h.active if h.mgr.length_of(r) == h.active[r].length]
        if done or steps % check_every == 0:
            h.check()
            for r in done:
                h.release(r)
    h.check()
    return steps


def _report(h, steps):
    print(f"\n[{h.fmt}] {steps} steps, {h.checks} checks; one-code flips (rate "
          f"{h.stats.rate():.2e}): {h.stats.summary()}")


def test_chunked_ds_fp8_matches_oracle():
    # 5 requests on 4 slots: one is admitted into a recycled slot with recycled
    # blocks; lengths cross block boundaries and the 512-token maximum.
    h = Harness("ds_fp8", seed=10)
    steps = run_schedule(h, [300, 512, 131, 77, 200], big_first=200, seed=1)
    _report(h, steps)
    assert h.stats.rate() < MAX_FLIP_RATE, h.stats


@pytest.mark.parametrize("fmt", ["fp8_token", "bf16"])
def test_chunked_other_formats_match_oracle(fmt):
    h = Harness(fmt, seed=20)
    steps = run_schedule(h, [150, 133, 70, 40], seed=2)
    _report(h, steps)
    assert h.stats.rate() < MAX_FLIP_RATE, h.stats
