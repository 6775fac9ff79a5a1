"""A multi-request, multi-layer workload run step by step through any
implementation, and the comparison of two such runs (docs/design.md §12).

Shared by the test suite (imported directly by tests/) and by
`python -m dsv4_jax demo`, which checks its cache against the reference path
with `compare_states`.

The schedule (admissions, releases, chunk sizes, padding) and every input
are drawn from a seed, so two implementations see exactly the same steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import config as C
from .manager import CacheFullError, CacheManager
from .ops.append import append
from .ops.apply_step import apply_step
from .ops.flush import flush
from .ops.gather import gather_all, gather_topk, gather_window
from .ops.write_layer import write_layer
from .params import CompressorParams, yarn_inv_freq
from .speculative import verify_begin, verify_commit, verify_layer

F8 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu


def layer_params(cfg, seed=0):
    """Random compressor parameters of every compressed layer."""
    rng = np.random.default_rng(seed)
    inv_freq = jnp.asarray(yarn_inv_freq())

    def one(m, width, d):
        return CompressorParams(
            ape=jnp.asarray(rng.normal(0, 0.5, (m, width)), jnp.float32),
            norm=jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32), inv_freq=inv_freq)
    params = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        if kind == C.CSA:
            p = one(C.CSA_RATIO, 2 * C.HEAD_DIM, C.HEAD_DIM)
            params[layer] = dataclasses.replace(
                p, index=one(C.CSA_RATIO, 2 * C.INDEX_DIM, C.INDEX_DIM))
        elif kind == C.HCA:
            params[layer] = one(C.HCA_RATIO, C.HEAD_DIM, C.HEAD_DIM)
    return params


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


def compressor_operands(kind, x, p):
    """(comp_kv, comp_score, params) and the indexer keywords of a layer's
    inputs, as write_layer and verify_layer take them."""
    if kind == C.SWA:
        return (), {}
    extra = {"index_kv": x["ikv"], "index_score": x["iscore"]} if kind == C.CSA else {}
    return (x["ckv"], x["score"], p), extra


def speculative_step(state, meta, inputs, accepted, params, drafts, impl, read=None):
    """The cache work of one speculative step (docs/design.md §13):
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
    """Admissions, releases and chunk sizes drawn from a seed."""

    def __init__(self, cfg, seed, decode_after=3):
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.manager = CacheManager(cfg)
        self.step_no = 0
        self.decode_after = decode_after

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
        meta = m.prepare_step(tokens, min_tokens=int(rng.integers(1, 5)))
        self.step_no += 1
        return meta

    def queries(self, meta, k=8):
        """Slots of every request (plus -1 padding), top-k indices mixing
        visible, invisible and -1, lengths for gather_all."""
        m, rng = self.manager, self.rng
        slots = [m.slot_of(r) for r in m.requests] + [-1]
        lengths = [m.length_of(r) for r in m.requests] + [0]
        T = meta.num_tokens
        pos = np.asarray(meta.token_pos)
        visible = (pos + 1) // C.CSA_RATIO
        idx = rng.integers(0, np.maximum(visible, 1)[:, None] + 3, (T, k))
        idx[rng.random((T, k)) < 0.2] = -1
        return {"slots": jnp.asarray(slots, jnp.int32), "lengths": jnp.asarray(lengths, jnp.int32),
                "topk": jnp.asarray(idx, jnp.int32)}


# ---- comparison ---------------------------------------------------------------------------
# Most one-code flips a run may show, as a fraction of the codes compared: a
# flip needs an fp32 value on a rounding boundary, which is rare.
MAX_FLIP_FRACTION = 1e-3


def _require(ok, message):
    """An assert that `python -O` keeps: the demo's PASS/FAIL depends on it."""
    if not ok:
        raise AssertionError(message)


@dataclasses.dataclass
class Flips:
    """One-code differences between two runs (fp32 values on a rounding
    boundary), and the number of values compared."""
    fp8: int = 0
    e2m1: int = 0
    bf16: int = 0
    total: int = 0

    @property
    def fraction(self):
        return (self.fp8 + self.e2m1 + self.bf16) / max(self.total, 1)


def within_one_step(a, b, sign_bit: int):
    """True where two codes of a sign-magnitude float format (e4m3: sign bit
    0x80; e2m1: 0x8) are at most one step apart on the value line. Codes
    below the sign bit count magnitude steps in value order, and -0 and +0
    are one value: the sign of a zero code follows the sign of the value
    rounded (docs/design.md §4), so a value that rounds to zero and lies
    within rounding noise of it may give either, as a value on a rounding
    boundary gives either of two neighbouring codes."""
    def rank(c):
        c = c.astype(int)
        return np.where(c & sign_bit, -(c & (sign_bit - 1)), c & (sign_bit - 1))
    return np.abs(rank(a) - rank(b)) <= 1


def compare_states(got, want, flips: Flips, what=""):
    """Byte-identical except one-code flips (counted into `flips`) and fp32
    accumulators within rtol 1e-6."""
    pairs = zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want))
    for (path, a), b in pairs:
        name = what + jax.tree_util.keystr(path)
        a, b = np.asarray(a), np.asarray(b)
        _require(a.shape == b.shape and a.dtype == b.dtype, name)
        if a.dtype == np.float32 and name.endswith("comp"):
            # (max, sum, weighted kv) rows of [..., 3, width] accumulators. The
            # max is order-free: exact. The weighted sum cancels, so its 1e-6 is
            # taken relative to the row's magnitude, not each element.
            np.testing.assert_array_equal(a[..., 0, :], b[..., 0, :], err_msg=name + " max")
            np.testing.assert_allclose(a[..., 1, :], b[..., 1, :], rtol=1e-6, err_msg=name + " sum")
            scale = np.max(np.abs(b[..., 2, :]), axis=-1, keepdims=True)
            _require(np.all(np.abs(a[..., 2, :] - b[..., 2, :]) <= 1e-6 * scale + 1e-30),
                     f"{name} kv: differs by more than 1e-6 of the row scale")
            continue
        if a.dtype == np.float32:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-30, err_msg=name)
            continue
        ab, bb = a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32), \
            b.view(np.uint8) if b.dtype.itemsize == 1 else b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32)
        diff = ab != bb
        if a.dtype == F8:
            flips.total += a.size
            _require(np.all(within_one_step(ab[diff], bb[diff], 0x80)),
                     f"{name}: fp8 codes differ by more than one step")
            flips.fp8 += int(diff.sum())
        elif a.dtype == jnp.bfloat16:
            # RoPE output can cancel (x0 c - x1 s): a 1-ulp sin/cos difference
            # then moves a small result by more than one of its own ulps. Judge
            # a difference against one bf16 ulp of the row's largest value.
            flips.total += a.size
            # Identical bytes are equal whatever they hold (a poisoned NaN the
            # op never touched included), so only differing values are judged.
            af, bf = a.astype(np.float32), b.astype(np.float32)
            finite = np.where(np.isfinite(bf), np.abs(bf), 0.0)
            scale = np.max(finite, axis=-1, keepdims=True) * 2.0 ** -7
            _require(np.all(~diff | (np.abs(af - bf) <= scale)),
                     f"{name}: bf16 values differ beyond the row's ulp")
            flips.bf16 += int(diff.sum())
        elif name.endswith("index.packed"):
            flips.total += 2 * a.size
            for shift in (0, 4):
                na, nb = (ab >> shift) & 0xF, (bb >> shift) & 0xF
                nd = na != nb
                step = within_one_step(na[nd], nb[nd], 0x8)
                _require(np.all(step), f"{name}: e2m1 codes differ by more than one step: "
                                       f"{list(zip(na[nd][~step][:8], nb[nd][~step][:8]))}")
                flips.e2m1 += int(nd.sum())
        else:   # int32 tables and positions, error counters, e8m0 scales
            _require(not diff.any(), f"{name}: {int(diff.sum())} values differ")


def assert_outputs_equal(got, want, what=""):
    """Gathers are pure reads: identical inputs give byte-identical outputs."""
    for key in want:
        for i, (a, b) in enumerate(zip(jax.tree_util.tree_leaves(got[key]),
                                       jax.tree_util.tree_leaves(want[key]))):
            a, b = np.asarray(a), np.asarray(b)
            _require(a.dtype == b.dtype and a.shape == b.shape, f"{what}{key}[{i}]")
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                raise AssertionError(f"{what}{key}[{i}]: {int(np.sum(a != b))} values differ")
