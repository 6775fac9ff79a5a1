"""A multi-request, multi-layer workload run step by step through any
implementation (docs/design/testing.md): the schedule (admissions, releases,
chunk sizes, padding) and every input are drawn from a seed, so two
implementations see exactly the same steps. Their caches are compared with
dsv4_jax.app.workload.compare_states, their reads with `assert_outputs_equal`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import config as C
from dsv4_jax.host.manager import CacheFullError, CacheManager
from dsv4_jax.meta import bucket
from dsv4_jax.ops.append import append
from dsv4_jax.ops.apply_step import apply_step
from dsv4_jax.ops.flush import flush
from dsv4_jax.ops.gather import gather_all, gather_topk, gather_window
from dsv4_jax.ops.write_layer import write_layer
from dsv4_jax.app.demo import compressor_operands
from dsv4_jax.speculative import verify_begin, verify_commit, verify_layer


def step_inputs(cfg, T, rng):
    """Per-layer projections of T token rows (random, never zeros)."""
    out = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        x = {"kv": jnp.asarray(rng.normal(0, 2, (T, C.HEAD_DIM)), jnp.bfloat16)}
        if kind != C.SWA:
            w = 2 * C.HEAD_DIM if kind == C.CSA else C.HEAD_DIM
            x["ckv"] = jnp.asarray(rng.normal(0, 1.5, (T, w)), jnp.float32)
            x["score"] = jnp.asarray(rng.normal(0, 2, (T, w)), jnp.float32)
        if kind == C.CSA:
            x["ikv"] = jnp.asarray(rng.normal(0, 1.5, (T, 2 * C.INDEX_DIM)), jnp.float32)
            x["iscore"] = jnp.asarray(rng.normal(0, 2, (T, 2 * C.INDEX_DIM)), jnp.float32)
        out[layer] = x
    return out


def write_step(state, meta, inputs, params, impl):
    """apply_step, then append + flush on every layer: the cache work of one
    model step."""
    cfg = state.config
    state = apply_step(state, meta, impl=impl)
    for layer, kind in enumerate(cfg.layer_kinds):
        x = inputs[layer]
        state = append(state, layer, meta, x["kv"], impl=impl)
        if kind == C.CSA:
            state = flush(state, layer, meta, x["ckv"], x["score"], params[layer],
                             index_kv=x["ikv"], index_score=x["iscore"], impl=impl)
        elif kind == C.HCA:
            state = flush(state, layer, meta, x["ckv"], x["score"], params[layer], impl=impl)
    return state


def speculative_step(state, meta, inputs, accepted, params, drafts, impl, read=None):
    """The cache work of one speculative step (docs/design/speculative.md):
    apply_step, the verify pass's writes (verify_begin, verify_layer on every
    compressed layer), verify_commit with `accepted` (i32[R]), then
    write_layer of the kept rows on every layer. `read(state, layer, spec,
    x)`, if given, runs after each layer's verify write and returns (state,
    outputs): the verify pass's reads. Returns (state, kept StepMeta, {layer:
    outputs})."""
    cfg = state.config
    state = apply_step(state, meta, impl=impl)
    spec = verify_begin(state, meta, drafts=drafts, impl=impl)
    outputs = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        comp, extra = compressor_operands(kind, inputs[layer], params.get(layer))
        state = verify_layer(state, layer, spec, *comp, impl=impl, **extra)
        if read is not None:
            state, outputs[layer] = read(state, layer, spec, inputs[layer])
    state, kept = verify_commit(state, spec, accepted, impl=impl)
    # the rows a slot has in either step bound its rows: the CUDA writes'
    # choice of kernel (StepMeta.max_rows_per_slot)
    assert spec.verified.max_rows_per_slot == kept.max_rows_per_slot == 1 + drafts
    for layer, kind in enumerate(cfg.layer_kinds):
        x = inputs[layer]
        comp, extra = compressor_operands(kind, x, params.get(layer))
        state = write_layer(state, layer, kept, x["kv"], *comp, impl=impl, **extra)
    return state, kept, outputs


def read_step(state, meta, queries, impl):
    """Every gather of every layer for the step's tokens / requests."""
    cfg = state.config
    slots, topk, lengths = queries["slots"], queries["topk"], queries["lengths"]
    out = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        out[f"window{layer}"] = gather_window(state, layer, slots, impl=impl,
                                                 return_state=True)
        if kind == C.CSA:
            out[f"topk{layer}"] = gather_topk(state, layer, meta.token_slot, meta.token_pos,
                                                 topk, impl=impl, return_state=True)
        elif kind == C.HCA:
            out[f"all{layer}"] = gather_all(state, layer, slots, lengths,
                                               cfg.max_blocks_per_request, impl=impl,
                                               return_state=True)
    return out


class Schedule:
    """Admissions, releases and chunk sizes drawn from a seed. With
    `pad_to_capacity`, every step's new blocks and resets and the queries'
    slots are padded to what the pool and the slots can hold, so that steps
    differ in shape only by their token rows: fewer programs to compile."""

    def __init__(self, cfg, seed, decode_after=3, pad_to_capacity=False):
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.manager = CacheManager(cfg)
        self.step_no = 0
        self.decode_after = decode_after
        self.pads = {}
        if pad_to_capacity:
            self.pads = dict(min_new_blocks=bucket(cfg.num_blocks),
                             min_resets=bucket(cfg.max_requests))

    def next(self):
        m, rng, cfg = self.manager, self.rng, self.cfg
        if self.step_no == 4 and m.requests:           # release one: its blocks are reused
            m.release(m.requests[0])
        while m.free_slots and rng.random() < 0.6:
            m.admit()
        tokens = {}
        for rid in m.requests:
            room = cfg.max_context - m.length_of(rid)
            if room <= 0:
                continue
            n = 1 if self.step_no >= self.decode_after else int(rng.integers(1, 150))
            if rng.random() < 0.2:
                n = 0                                  # sits this step out
            tokens[rid] = min(n, room)
        # keep within the free blocks: drop requests until the plan fits
        while tokens:
            try:
                m.plan_step(tokens)
                break
            except CacheFullError:
                tokens.popitem()
        meta = m.prepare_step(tokens, min_tokens=int(rng.integers(1, 5)), **self.pads)
        self.step_no += 1
        return meta

    def queries(self, meta, k=8):
        """Slots of every request (plus -1 padding), top-k indices mixing
        visible, invisible and -1, lengths for gather_all."""
        m, rng = self.manager, self.rng
        slots = [m.slot_of(r) for r in m.requests] + [-1]
        lengths = [m.length_of(r) for r in m.requests] + [0]
        if self.pads:
            extra = self.cfg.max_requests + 1 - len(slots)
            slots, lengths = slots + [-1] * extra, lengths + [0] * extra
        T = meta.num_tokens
        pos = np.asarray(meta.token_pos)
        visible = (pos + 1) // C.CSA_RATIO
        idx = rng.integers(0, np.maximum(visible, 1)[:, None] + 3, (T, k))
        idx[rng.random((T, k)) < 0.2] = -1
        return {"slots": jnp.asarray(slots, jnp.int32), "lengths": jnp.asarray(lengths, jnp.int32),
                "topk": jnp.asarray(idx, jnp.int32)}


def assert_outputs_equal(got, want, what=""):
    """Gathers are pure reads: identical inputs give byte-identical outputs."""
    for key in want:
        for i, (a, b) in enumerate(zip(jax.tree_util.tree_leaves(got[key]),
                                       jax.tree_util.tree_leaves(want[key]))):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}{key}[{i}]"
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                raise AssertionError(f"{what}{key}[{i}]: {int(np.sum(a != b))} values differ")
