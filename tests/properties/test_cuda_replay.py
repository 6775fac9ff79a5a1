"""The CUDA handlers over many steps (docs/design/in-place.md,
docs/design/bad-input.md, docs/design/testing.md), on the GPU only.

* One jitted write step and one read step, each compiled once, replayed for
  1000 steps of changing metadata on a CSA + HCA cache (ds_fp8) against the
  reference at every step: command buffers replayed with new operands.
* A jitted multi-layer step (write_step + read_step) run for 100 steps (ds_fp8) with
  changing inputs on impl "cuda" equals the same on "reference" step by step.
  The reference runs on the CPU device: there XLA performs every bf16
  rounding the oracle asks for (the GPU compiler may fuse them away).
* The whole sequence run twice on "cuda" gives identical bytes at every step
  (a moving result is a race).
* Bad rows (slots, positions, missing blocks, indices, lengths, layer -1)
  are dropped and counted as the reference does.
* A donated jitted write_step on "cuda" updates the state in place.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import CacheConfig, init_state
from dsv4_jax import config as C
from dsv4_jax.app.workload import Flips, compare_states, layer_params
from support.workload import (Schedule, assert_outputs_equal, read_step, step_inputs,
                              write_step)
from support.inplace import assert_in_place
from support.marks import CUDA, requires_cpu_ffi
from support.trees import assert_trees_bytes_equal

# DSV4_REPLAY_IMPL=cpu runs the same checks on the CPU handlers (a check of
# the test itself on a machine without a GPU).
IMPL = os.environ.get("DSV4_REPLAY_IMPL", "cuda")
pytestmark = CUDA if IMPL == "cuda" else [requires_cpu_ffi]
MAX_FLIP_FRACTION = 1e-3


def _jits(impl):
    """Jitted write and read steps; every array is an argument (nothing
    closed over), so a call on CPU-committed arguments runs on the CPU."""
    write = jax.jit(lambda s, m, x, p: write_step(s, m, x, p, impl), donate_argnums=0)
    read = jax.jit(lambda s, m, q: _outputs_and_errors(read_step(s, m, q, impl)))
    return write, read


def _outputs_and_errors(reads):
    """A read step's outputs with each returned state cut to its counters."""
    return {k: (*v[:-1], v[-1].errors) for k, v in reads.items()}


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _cpu(tree):
    """The tree committed to the CPU device: a jit called on it runs there."""
    return jax.device_put(tree, jax.devices("cpu")[0])


class Replay:
    """A cache stepped on IMPL twice (`ours`, `again`) and on the reference
    on the CPU device, each through one jitted write and one read step."""

    def __init__(self, cfg, params):
        (self.write, self.read), (self.write_ref, self.read_ref) = _jits(IMPL), _jits("reference")
        self.params, self.params_cpu = params, _cpu(params)
        self.ours, self.again, self.ref = init_state(cfg), init_state(cfg), _cpu(init_state(cfg))
        self.flips = Flips()

    def step(self, meta, inputs, q, where):
        """Write, then read: our state equals the reference's up to counted
        one-code flips, the two runs are byte-identical (a moving result is a
        race), and the reads equal the reference reading our state. Returns
        our reads on the host."""
        self.ours = self.write(self.ours, meta, inputs, self.params)
        self.again = self.write(self.again, meta, inputs, self.params)
        self.ref = self.write_ref(self.ref, _cpu(meta), _cpu(inputs), self.params_cpu)
        compare_states(self.ours, self.ref, self.flips, where)
        assert_trees_bytes_equal(_host(self.ours), _host(self.again), where + "rerun ")
        out = _host(self.read(self.ours, meta, q))
        assert_trees_bytes_equal(out, _host(self.read(self.again, meta, q)), where + "rerun reads ")
        assert_outputs_equal(out, self.read_ref(_cpu(self.ours), _cpu(meta), _cpu(q)), where)
        return out

    def compilations(self):
        return tuple(f._cache_size() for f in (self.write, self.read, self.write_ref,
                                               self.read_ref))


@pytest.mark.parametrize("kv_format,steps", [("ds_fp8", 100), ("fp8_token", 10), ("bf16", 10)])
def test_replay_equals_reference_and_repeats(kv_format, steps):
    cfg = CacheConfig.tiny(kv_format=kv_format, max_context=1024, num_blocks=24)
    run = Replay(cfg, layer_params(cfg, seed=5))
    sched = Schedule(cfg, seed=11, decode_after=5)
    rng = np.random.default_rng(12)
    for step in range(steps):
        meta = sched.next()
        inputs = step_inputs(cfg, meta.num_tokens, rng)
        run.step(meta, inputs, sched.queries(meta, k=16), f"step {step} ")
    print(f"cuda {kv_format}: {steps} steps, one-code flips {run.flips}")
    assert run.flips.fraction < MAX_FLIP_FRACTION, run.flips


class FixedShapeSchedule:
    """Admissions, releases, prefill chunks and decode tokens drawn from a
    seed, every step padded to the same sizes (T tokens, R new-block rows, R
    resets, R query slots): one compiled step serves them all."""

    def __init__(self, cfg, seed, T):
        self.cfg, self.T = cfg, T
        self.rng = np.random.default_rng(seed)
        self.manager = dj.CacheManager(cfg)
        self.released = 0

    def next(self):
        m, rng, cfg = self.manager, self.rng, self.cfg
        full = [r for r in m.requests if m.length_of(r) >= cfg.max_context]
        if full or (m.requests and rng.random() < 0.03):
            m.release(full[0] if full else m.requests[rng.integers(len(m.requests))])
            self.released += 1
        while m.free_slots and rng.random() < 0.5:
            m.admit()
        tokens, budget = {}, self.T
        for rid in rng.permutation(np.array(m.requests, dtype=object)):
            room = cfg.max_context - m.length_of(rid)
            n = int(rng.integers(1, 25)) if m.length_of(rid) < 64 else int(rng.random() < 0.8)
            n = min(n, room, budget)
            if n:
                tokens[rid], budget = n, budget - n
        while tokens:                      # blocks run out: drop requests until it fits
            try:
                m.plan_step(tokens)
                break
            except dj.CacheFullError:
                tokens.popitem()
        R = cfg.max_requests
        return m.prepare_step(tokens, min_tokens=self.T, min_new_blocks=R, min_resets=R)

    def queries(self, meta, k):
        m, rng, R = self.manager, self.rng, self.cfg.max_requests
        slots, lengths = np.full(R, -1, np.int32), np.zeros(R, np.int32)
        for i, r in enumerate(m.requests):
            slots[i], lengths[i] = m.slot_of(r), m.length_of(r)
        visible = (np.asarray(meta.token_pos) + 1) // C.CSA_RATIO
        idx = rng.integers(0, np.maximum(visible, 1)[:, None] + 3, (self.T, k))
        idx[rng.random((self.T, k)) < 0.2] = -1
        return {"slots": jnp.asarray(slots), "lengths": jnp.asarray(lengths),
                "topk": jnp.asarray(idx, jnp.int32)}


def _uses_command_buffers(jitted, *args):
    """Whether XLA outlined part of the compiled step into a command buffer."""
    return "command_buffer" in jitted.lower(*args).compile().as_text()


def test_one_executable_replayed_1000_steps():
    """One jitted write step and one read step, each compiled once, replayed
    for 1000 steps of changing metadata (admissions, releases with slot resets
    and block reuse, prefill chunks, decode tokens, padding) on a two-layer
    ds_fp8 cache (a CSA and an HCA layer: apply_step, append, both flushes,
    gather_window, gather_topk, gather_all), equal to the reference run on the
    CPU device at every step, and run twice on the same executable with
    byte-identical results (a moving result is a race). On the GPU the
    compiled write step holds its handlers in an XLA command buffer (checked
    in the optimized HLO), so this replays one recorded graph with new operand
    values. The per-step work is small (T = 32 tokens, 4 requests, chunks of
    at most 24 tokens) to keep the reference affordable;
    test_replay_equals_reference_and_repeats covers larger chunks on four
    layers and the other formats. DSV4_REPLAY_STEPS overrides the 1000."""
    steps = int(os.environ.get("DSV4_REPLAY_STEPS", 1000))
    cfg = CacheConfig((C.CSA_RATIO, C.HCA_RATIO), max_requests=4, num_blocks=10,
                      max_blocks_per_request=3, kv_format="ds_fp8", index_topk=16)
    run = Replay(cfg, layer_params(cfg, seed=8))
    sched = FixedShapeSchedule(cfg, seed=9, T=32)
    rng = np.random.default_rng(10)
    hca_entries = 0
    for step in range(steps):
        meta = sched.next()
        inputs = step_inputs(cfg, meta.num_tokens, rng)
        if step == 0:
            graphs = _uses_command_buffers(run.write, run.ours, meta, inputs, run.params)
        out = run.step(meta, inputs, sched.queries(meta, k=8), f"step {step} ")
        hca_entries = max(hca_entries, int(out["all1"][1].max()))
    assert not np.asarray(run.ours.errors).any()
    # one executable each, replayed: no step retraced or recompiled
    assert run.compilations() == (1, 1, 1, 1), run.compilations()
    if steps >= 1000:   # the schedule did exercise release, reuse and HCA entries
        assert sched.released >= 5 and hca_entries >= 2, (sched.released, hca_entries)
    print(f"{IMPL}: {steps} steps of one executable, {sched.released} releases, "
          f"command buffers {graphs}, one-code flips {run.flips}")
    assert run.flips.fraction < MAX_FLIP_FRACTION, run.flips
    assert graphs or IMPL != "cuda", "the compiled write step holds no command buffer"


def _prefilled(cfg, params, impl, seed=3):
    """A state with two requests prefilled through `impl` (blocks assigned)."""
    m = dj.CacheManager(cfg)
    a, b = m.admit(), m.admit()
    meta = m.prepare_step({a: 300, b: 140})
    rng = np.random.default_rng(seed)
    inputs = step_inputs(cfg, meta.num_tokens, rng)
    write, _ = _jits(impl)
    args = (init_state(cfg), meta, inputs, params)
    if impl == "reference":
        args = _cpu(args)
    return write(*args)


def _both(f, ours, ref, *args):
    """f(state, *args, impl) on cuda (GPU arrays) and on reference (CPU)."""
    return f(ours, *args, IMPL), f(_cpu(ref), *_cpu(args), "reference")


def test_bad_rows_dropped_and_counted_like_reference():
    cfg = CacheConfig.tiny(max_context=512, num_blocks=16)
    params = layer_params(cfg, seed=7)
    ours = _prefilled(cfg, params, IMPL)
    ref = _prefilled(cfg, params, "reference")
    flips = Flips()
    compare_states(ours, ref, flips, "prefill ")
    R, mc = cfg.max_requests, cfg.max_context
    rng = np.random.default_rng(21)
    T = 64
    # append: garbage slots/positions, several tokens on one (slot, ring slot),
    # equal positions twice (the later row wins)
    slot = rng.choice([-1, -7, 0, 1, 2, 3, R, R + 9], T).astype(np.int32)
    pos = rng.choice([-4, 5, 133, 261, 389, 5, 77, mc, mc + 100, 300], T).astype(np.int32)
    meta = dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(R, np.int32))
    kv = jnp.asarray(rng.normal(0, 3, (T, C.HEAD_DIM)), jnp.bfloat16)
    fa = jax.jit(lambda s, l, m, k, impl: dj.append(s, l, m, k, impl=impl), static_argnums=4)
    for layer in list(range(cfg.num_layers)) + [-1]:
        ours, ref = _both(fa, ours, ref, jnp.int32(layer), meta, kv)
    compare_states(ours, ref, flips, "append ")
    # flush: the next valid tokens of request 0 interleaved with bad rows
    # (bad slot, negative position, a slot with no blocks)
    n0 = 300
    fslot = np.array([0, -1, 9, 0, 2, 0, 0, -5, 0], np.int32)
    fpos = np.array([n0, 0, 3, n0 + 1, 7, -2, n0 + 2, 1, n0 + 3], np.int32)
    fmeta = dj.StepMeta.build(token_slot=fslot, token_pos=fpos, lengths=np.zeros(R, np.int32))
    inputs = step_inputs(cfg, len(fslot), rng)
    ff = jax.jit(lambda s, l, m, x, p, impl: dj.flush(
        s, l, m, x["ckv"], x["score"], p, index_kv=x.get("ikv"), index_score=x.get("iscore"),
        impl=impl), static_argnums=5)
    for layer, kind in enumerate(cfg.layer_kinds):
        if kind != C.SWA:
            ours, ref = _both(ff, ours, ref, jnp.int32(layer), fmeta, inputs[layer], params[layer])
    compare_states(ours, ref, flips, "flush ")
    # gathers with bad slots, lengths, indices and a bad layer, on the same state
    slots = jnp.asarray([0, -1, 1, R + 2, -3, 2], jnp.int32)
    lengths = jnp.asarray([304, 0, 140, 5, 9, 600], jnp.int32)
    qslot = jnp.asarray([0, 1, -1, 7, 0, 1], jnp.int32)
    qpos = jnp.asarray([303, 139, 5, 4, -1, 60], jnp.int32)
    idx = jnp.asarray(rng.integers(-3, 90, (6, 32)), jnp.int32)
    g = jax.jit(lambda s, l, sl, ln, qs, qp, ix, impl: (
        dj.gather_window(s, l, sl, impl=impl, return_state=True),
        dj.gather_topk(s, l, qs, qp, ix, impl=impl, return_state=True),
        dj.gather_all(s, l, sl, ln, 4, impl=impl, return_state=True)), static_argnums=7)
    for layer in [0, 1, 2, 3, -1]:
        a, b = _both(g, ours, ours, jnp.int32(layer), slots, lengths, qslot, qpos, idx)
        for x, y, what in zip(_host(a), _host(b), ("window", "topk", "all")):
            assert_outputs_equal({what: x[:2]}, {what: y[:2]}, f"layer {layer} ")
            np.testing.assert_array_equal(x[2].errors, y[2].errors,
                                          err_msg=f"layer {layer} {what} errors")
    assert np.asarray(ours.errors).sum() > 0


def test_write_step_in_place_on_gpu():
    cfg = CacheConfig.tiny()
    params = layer_params(cfg, seed=2)
    sched = Schedule(cfg, seed=4, decode_after=1)
    rng = np.random.default_rng(5)
    meta = sched.next()
    inputs = step_inputs(cfg, meta.num_tokens, rng)
    step, _ = _jits(IMPL)
    state = assert_in_place(step, init_state(cfg), meta, inputs, params)
    meta = sched.next()
    inputs = step_inputs(cfg, meta.num_tokens, rng)
    assert_in_place(step, state, meta, inputs, params)
