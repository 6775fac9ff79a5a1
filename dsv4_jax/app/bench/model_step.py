"""A decode step as a model calls the library, and how one is timed: on the
host, and on the device's own timeline.

A V4-Flash step (43 layers: SWA SWA CSA, then (HCA, CSA) x 20), one token a
request. The default variant is what a model runs today: per layer
`write_layer` (append, and on CSA/HCA layers flush), on CSA layers
`indexer_topk` (k = 512), then `attention` with 64 query heads, the per-head
sink and the inverse RoPE of the output (SWA: the window; CSA: the window
and the picks; HCA: the window and every visible entry). Each layer's output
is summed over its heads into a carried h f32[B, 512] (the model's o_proj
stands in as one small reduction), so nothing is stacked across layers and
XLA drops no call.

The `gathers` variant reads as a model that runs its own attention does:
gather_window, on CSA layers indexer_topk + gather_topk, on HCA layers
gather_all, each read's rows folded into h (a masked mean: every row read).
Other flags: `separate-write` (append + flush instead of write_layer),
`no-return-state` (reads drop the state they could hand back),
`unroll` (every layer with a Python int index, no scan).

The layers run as a model writes them: the leading layers unrolled, then
`lax.scan` over the repeated (HCA, CSA) pair with a traced layer index (one
compiled body, as a 43-layer model keeps its compile time down). One
`jax.jit`, the state donated; the state is filled_state's.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from ... import config as C
from ...params import yarn_inv_freq
from .device_timeline import kernel_events, kernel_sequence, split_steps, timeline_summary
from .timing import time_it

F32 = jnp.float32
HEADS = 64          # V4-Flash's query heads
FLAGS = ("gathers", "separate-write", "no-return-state", "unroll")


@dataclasses.dataclass(frozen=True)
class Variant:
    gathers: bool = False        # gathers + a stand-in reduction instead of attention
    fused_write: bool = True     # write_layer; False: append + flush
    return_state: bool = True    # read ops hand the state (their error counts) back
    unroll: bool = False         # every layer with a Python int index, no scan

    @classmethod
    def parse(cls, text):
        """"base" (attention, write_layer) or flags joined by '+':
        gathers, separate-write, no-return-state, unroll."""
        flags = set() if text == "base" else set(text.split("+"))
        if flags - set(FLAGS):
            raise ValueError(f"variant {text!r}: expected 'base' or '+'-joined {FLAGS}")
        return cls("gathers" in flags, "separate-write" not in flags,
                   "no-return-state" not in flags, "unroll" in flags)

    @property
    def name(self):
        on = (self.gathers, not self.fused_write, not self.return_state, self.unroll)
        return "+".join(f for f, o in zip(FLAGS, on) if o) or "base"


def layer_plan(kinds):
    """(prefix, unit, repeats): kinds = kinds[:prefix] + unit * repeats with
    unit the last two kinds repeated as often as the tail allows."""
    unit, n, L = tuple(kinds[-2:]), 0, len(kinds)
    while 2 * (n + 1) <= L and tuple(kinds[L - 2 * (n + 1):L - 2 * n]) == unit:
        n += 1
    return L - 2 * n, unit, n


def step_inputs(B, context, seed=0):
    """One decode token per request at position context-1: what the model
    hands the cache (kv, compressor projections, indexer query and weights,
    the attention query after its RoPE, the sinks)."""
    rng = np.random.default_rng(seed)

    def normal(shape, dtype=F32, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)
    slot = np.arange(B, dtype=np.int32)
    pos = np.full(B, context - 1, np.int32)
    lengths = np.full(B, context, np.int32)
    return {"meta": dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=lengths),
            "slot": jnp.asarray(slot), "pos": jnp.asarray(pos), "lengths": jnp.asarray(lengths),
            "kv": normal((B, C.HEAD_DIM), jnp.bfloat16),
            "csa_kv": normal((B, 2 * C.HEAD_DIM)), "csa_score": normal((B, 2 * C.HEAD_DIM)),
            "hca_kv": normal((B, C.HEAD_DIM)), "hca_score": normal((B, C.HEAD_DIM)),
            "index_kv": normal((B, 2 * C.INDEX_DIM)), "index_score": normal((B, 2 * C.INDEX_DIM)),
            "q": normal((B, C.INDEX_HEADS, C.INDEX_DIM), jnp.bfloat16),
            "weights": normal((B, C.INDEX_HEADS)),
            # unit-sized logits: q of rms 0.05 against entries of a few units
            "aq": normal((B, HEADS, C.HEAD_DIM), jnp.bfloat16, 0.05),
            "sink": normal((HEADS,)),
            "inv_freq": jnp.asarray(yarn_inv_freq(), F32),
            "params": {C.CSA: dj.CompressorParams.neutral(C.CSA),
                       C.HCA: dj.CompressorParams.neutral(C.HCA)}}


def attend(h, rows, mask):
    """h plus the mean of the visible rows: a stand-in for attention that
    reads every gathered row under its mask, and costs about that read.
    Written as a dot of the 0/1 mask with the bf16 rows, accumulated in f32,
    so that XLA emits one dot per read; the product broadcast over the rows
    and summed that it replaces compiled to a reduction over the middle axis,
    far slower than the read (docs/perf/decode-step.md, "Ideas tried")."""
    total = jnp.einsum("bs,bsd->bd", mask.astype(rows.dtype), rows, preferred_element_type=F32)
    count = jnp.sum(mask, axis=1, keepdims=True, dtype=F32)
    return h + total / jnp.maximum(count, 1.0)


def make_step(cfg, context, variant, impl="auto"):
    """jitted (state, inputs) -> (state, h): one decode step."""
    k = cfg.index_topk
    entries = context // C.HCA_RATIO

    def read(op, s, *args, **kw):
        if variant.return_state:
            *outs, s = op(s, *args, impl=impl, return_state=True, **kw)
            return s, outs
        outs = op(s, *args, impl=impl, return_state=False, **kw)
        return s, list(outs) if isinstance(outs, tuple) else [outs]

    def write(s, layer, kind, x):
        comp = {C.CSA: ("csa_kv", "csa_score"), C.HCA: ("hca_kv", "hca_score")}.get(kind)
        comp = (x[comp[0]], x[comp[1]], x["params"][kind]) if comp else ()
        index = ({"index_kv": x["index_kv"], "index_score": x["index_score"]}
                 if kind == C.CSA else {})
        if variant.fused_write:
            return dj.write_layer(s, layer, x["meta"], x["kv"], *comp, impl=impl, **index)
        s = dj.append(s, layer, x["meta"], x["kv"], impl=impl)
        return dj.flush(s, layer, x["meta"], *comp, impl=impl, **index) if comp else s

    def picks(s, layer, x):
        return read(lambda s, *a, **kw: dj.indexer_topk(s, *a, k, **kw), s, layer,
                    x["slot"], x["pos"], x["q"], x["weights"])

    def attention_reads(s, h, layer, kind, x):
        topk = None
        if kind == C.CSA:
            s, (topk,) = picks(s, layer, x)
        s, (out, _lse) = read(dj.attention, s, layer, x["aq"], x["slot"], x["pos"],
                              sink=x["sink"], topk=topk, rope_inv_freq=x["inv_freq"], kind=kind)
        return s, h + jnp.sum(out.astype(F32), axis=1)

    def gather_reads(s, h, layer, kind, x):
        s, (rows, pos) = read(dj.gather_window, s, layer, x["slot"])
        h = attend(h, rows, (pos >= 0) & (pos <= x["pos"][:, None]))
        if kind == C.CSA:
            s, (idx,) = picks(s, layer, x)
            s, (rows, valid) = read(dj.gather_topk, s, layer, x["slot"], x["pos"], idx)
            h = attend(h, rows, valid)
        elif kind == C.HCA:
            s, (rows, count) = read(dj.gather_all, s, layer, x["slot"], x["lengths"], entries)
            h = attend(h, rows, jnp.arange(entries) < count[:, None])
        return s, h

    reads = gather_reads if variant.gathers else attention_reads

    def layer_step(s, h, layer, kind, x):
        return reads(write(s, layer, kind, x), h, layer, kind, x)

    kinds = cfg.layer_kinds
    prefix, unit, repeats = (len(kinds), (), 0) if variant.unroll else layer_plan(kinds)

    def step(s, x):
        h = jnp.zeros((x["kv"].shape[0], C.HEAD_DIM), F32)
        for layer in range(prefix):
            s, h = layer_step(s, h, layer, kinds[layer], x)

        def body(carry, i):
            s, h = carry
            for j, kind in enumerate(unit):
                s, h = layer_step(s, h, prefix + len(unit) * i + j, kind, x)
            return (s, h), None
        if repeats:
            (s, h), _ = jax.lax.scan(body, (s, h), jnp.arange(repeats, dtype=jnp.int32))
        return s, h
    return jax.jit(step, donate_argnums=0)


def measure_step(cfg, context, variant, impl, box, x, *, warm, reps, loop, trace_steps):
    """One variant's step on the state box[0] (donated and put back each
    call): seconds of its first call (compiling), host ms a step (the median
    of `reps` samples of `loop` steps) and, where there is a GPU, the
    timeline of `trace_steps` steps (timeline_summary: span, busy, µs per op
    family, kernels and copies per layer) and the kernel sequence of the
    first repeated layer pair of one step (the pair the scan runs;
    kernel_sequence)."""
    f = make_step(cfg, context, variant, impl)

    def call():
        box[0], h = f(box[0], x)
        return h
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    row = {"first_call_s": time.perf_counter() - t0,
           "host_ms": time_it(lambda i: call(), 1, loop, reps, warm) * 1e3}
    events = kernel_events(call, runs=trace_steps)
    if events:
        row.update(timeline_summary(events, trace_steps, cfg.num_layers))
        first = layer_plan(cfg.layer_kinds)[0]
        row["sequence_layers"] = [first, first + 1]
        steps = split_steps(events, trace_steps)
        seq, why = (kernel_sequence(steps[0], cfg.num_layers, first) if steps
                    else ([], "the trace does not split into steps"))
        row["sequence"] = seq
        if why:
            row["sequence_skipped"] = why
    return row
