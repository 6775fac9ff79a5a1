"""examples/serving_engine.py runs on the CPU at its tiny size: three requests
admitted, prefilled in chunks beside decode tokens, one preempted to host
memory and resumed under its id, one started on another's prefix, one
speculative step; each step program compiles once; no op counts bad input;
and the cache it leaves equals, up to the documented one-code flips, a
replay of the same steps through the jnp reference (the replay takes the
run's next tokens and accepted counts, so both make the same steps), whose
own next tokens and accepted counts mostly agree with the run's."""

import numpy as np

import dsv4_jax as dj
from dsv4_jax.app.demo import check_against
from support.examples import load_example
from support.marks import requires_cpu_ffi

@requires_cpu_ffi
def test_serving_engine_equals_its_reference_replay():
    ex = load_example("serving_engine")
    run = ex.run(verbose=False)
    assert dict(run.steps) == {"chunk": run.steps["chunk"], "decode": run.steps["decode"],
                               "speculative": 1}
    assert run.steps["chunk"] >= 4 and run.steps["decode"] >= 4
    assert {k: p._cache_size() for k, p in run.programs.items()} == \
        {"chunk": 1, "decode": 1, "speculative": 1}
    assert sorted(run.finished) == ["a", "b", "c"] and not run.running and not run.parked
    for rid, req in run.finished.items():
        assert req.generated >= req.max_new and all(0 <= t < ex.ModelSize().vocab
                                                     for t in req.tokens)
    assert run.manager.prefixes == ("system",) and run.manager.prefix_tokens("system") == 256
    # the speculative step kept each request's first row, and at most its rows
    (kept,) = run.kept
    assert len(kept) >= 2 and all(1 <= a <= 1 + run.drafts for a in kept.values())

    with dj.default_impl("reference"):
        replay = ex.run(replay=list(run.host), verbose=False)
    assert dict(replay.steps) == dict(run.steps)
    assert {r: q.tokens for r, q in replay.finished.items()} == \
        {r: q.tokens for r, q in run.finished.items()}
    check = check_against(run.state, replay.state)
    assert check.ok, check.message
    # the reference's own values: the same tokens and counts but where an
    # argmax sits on a near tie
    same = [np.mean(np.asarray(a) == np.asarray(b)) for a, b in zip(run.host,
                                                                    replay.device_values)]
    assert len(same) == len(run.host) and np.mean(same) >= 0.9, same


@requires_cpu_ffi
def test_timed_mode_runs_prefill_then_decode_steps():
    """The path `--model flash` takes on a GPU, on the tiny model: every
    request prefilled, then the timed decode steps, one token a request a
    step, nothing counted."""
    ex = load_example("serving_engine")
    r = ex.timed(3, 200, steps=3, budget=128, model="tiny", size=ex.ModelSize())
    assert (r["B"], r["context"], r["decode_steps"], r["prefill_tokens"]) == (3, 200, 3, 600)
    assert r["tokens_per_s"] > 0 and r["prefill_s"] > 0
