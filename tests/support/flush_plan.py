"""flush's FFI targets called on chosen rows, for the window plan's tests
(tests/ops/test_flush_windows*.py): a state with poisoned pools and random
carried accumulators, the rows of several requests, projections with NaN
rows, and one call of a named target (the handler, or the testing module's
serial walk) on a chosen device."""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as D
from dsv4_jax import config as C
from dsv4_jax.ops.dispatch import ffi_in_place
from dsv4_jax.ops._layer import layer_operand
from dsv4_jax.ops.flush import TARGETS, flush_ffi_operands
from dsv4_jax.ops.write_layer import write_layer

from .trees import poison

LAYER = {C.CSA: 1, C.HCA: 2}          # a global layer of each kind in CacheConfig.tiny
SERIAL = {C.CSA: "dsv4_flush_csa_serial", C.HCA: "dsv4_flush_hca_serial"}


def _accumulators(shape, rng, empty_slots):
    """Carried (max, sum, kv) rows as a real run leaves them: finite, sum >= 1;
    the slots in `empty_slots` empty (-inf, 0, 0)."""
    acc = np.empty(shape, np.float32)
    acc[..., 0, :] = rng.normal(0, 1, shape[:-2] + shape[-1:])
    acc[..., 1, :] = rng.uniform(1, 4, shape[:-2] + shape[-1:])
    acc[..., 2, :] = rng.normal(0, 2, shape[:-2] + shape[-1:])
    for s in empty_slots:
        acc[:, s, :, 0] = -np.inf
        acc[:, s, :, 1:] = 0
    return jnp.asarray(acc)


def prefill_state(fmt, *, R=4, max_context=1024, seed=0, missing=(), empty_slots=()):
    """A tiny-config state whose pools hold random bytes and whose
    accumulators hold random carried values; slot s owns blocks s*MB ..
    (s+1)*MB - 1 shuffled, except the (slot, block index) pairs in `missing`."""
    MB = max_context // C.BLOCK_TOKENS
    cfg = D.CacheConfig.tiny(max_requests=R, max_context=max_context, kv_format=fmt,
                             num_blocks=R * MB + 3)
    st = poison(D.init_state(cfg), seed)
    rng = np.random.default_rng(seed + 1)
    bt = rng.permutation(R * MB).astype(np.int32).reshape(R, MB)
    for s, b in missing:
        bt[s, b] = -1
    csa = dataclasses.replace(st.csa, comp=_accumulators(st.csa.comp.shape, rng, empty_slots),
                              icomp=_accumulators(st.csa.icomp.shape, rng, empty_slots))
    hca = dataclasses.replace(st.hca, comp=_accumulators(st.hca.comp.shape, rng, empty_slots))
    return dataclasses.replace(st, block_table=jnp.asarray(bt), csa=csa, hca=hca,
                               errors=jnp.zeros_like(st.errors))


def rows(*runs, pad=0):
    """token_slot and token_pos of runs (slot, first position, count) one
    after another, `pad` padding rows (-1) after each."""
    slots, pos = [], []
    for s, p0, n in runs:
        slots += [s] * n + [-1] * pad
        pos += list(range(p0, p0 + n)) + [0] * pad
    return np.array(slots, np.int32), np.array(pos, np.int32)


def projections(kind, T, seed=0, nan_rows=()):
    """Random f32 projections of T rows (kv, score, index_kv, index_score;
    the last two None for HCA); each row of `nan_rows` gets a NaN or an Inf
    in one of its operands, in turn."""
    rng = np.random.default_rng(seed)
    coff = 2 if kind == C.CSA else 1
    out = [rng.standard_normal((T, coff * C.HEAD_DIM)).astype(np.float32),
           rng.normal(0, 2, (T, coff * C.HEAD_DIM)).astype(np.float32)]
    if kind == C.CSA:
        out += [rng.standard_normal((T, 2 * C.INDEX_DIM)).astype(np.float32),
                rng.normal(0, 2, (T, 2 * C.INDEX_DIM)).astype(np.float32)]
    for i, t in enumerate(nan_rows):
        x = out[i % len(out)]
        x[t, rng.integers(x.shape[1])] = np.nan if i % 2 == 0 else np.inf
    return tuple(out) + ((None, None) if kind == C.HCA else ())


def params(kind, seed=0):
    rng = np.random.default_rng(seed)
    inv_freq = (1.0 / 160000.0 ** (np.arange(32) / 32)).astype(np.float32)

    def one(m, width, d, index=None):
        return D.CompressorParams(jnp.asarray(rng.normal(0, 0.5, (m, width)).astype(np.float32)),
                                  jnp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32)),
                                  jnp.asarray(inv_freq), index)
    if kind == C.HCA:
        return one(C.HCA_RATIO, C.HEAD_DIM, C.HEAD_DIM)
    return one(C.CSA_RATIO, 2 * C.HEAD_DIM, C.HEAD_DIM,
               one(C.CSA_RATIO, 2 * C.INDEX_DIM, C.INDEX_DIM))


def call_flush(state, kind, slots, pos, proj, prm, *, target=None, device=None,
               max_rows_per_slot=0):
    """One call of FFI `target` (default: flush's own) with flush's operands,
    on `device` (default: the CPU), with the caller's bound on a request's
    rows (StepMeta.max_rows_per_slot). Returns the new state."""
    target = target or TARGETS[kind]
    cfg = state.config
    layer = layer_operand(cfg, LAYER[kind], kind)

    def run(st, layer, slots, pos, proj, prm):
        kv, score, ikv, iscore = proj
        inputs, aliased, rebuild = flush_ffi_operands(st, kind, kv, score, prm, ikv, iscore)
        meta = jnp.concatenate([slots, pos])   # the handlers' token rows (StepMeta.token_fields)
        return rebuild(ffi_in_place(target, [layer, meta, *inputs], aliased,
                                    kv_format=C.KV_FORMAT_CODE[cfg.kv_format],
                                    max_context=cfg.max_context,
                                    max_rows_per_slot=max_rows_per_slot))
    device = device or jax.devices("cpu")[0]
    args = jax.device_put((state, layer, jnp.asarray(slots), jnp.asarray(pos), proj, prm), device)
    return jax.jit(run)(*args)


def call_write_layer(state, kind, slots, pos, window_kv, proj, prm, *, impl, device,
                     max_rows_per_slot=0):
    """write_layer of the kind's layer through `impl` on `device`, called on
    concrete arrays committed there (so impl "cpu" resolves on a GPU host)."""
    meta = D.StepMeta.build(token_slot=slots, token_pos=pos,
                            lengths=np.zeros(state.config.max_requests, np.int32),
                            max_rows_per_slot=max_rows_per_slot)
    state, meta, window_kv, proj, prm = jax.device_put((state, meta, window_kv, proj, prm), device)
    kv, score, ikv, iscore = proj
    with warnings.catch_warnings():   # not donated: the copy is what a test wants
        warnings.simplefilter("ignore", D.NotDonatedWarning)
        return write_layer(state, LAYER[kind], meta, window_kv, kv, score, prm, index_kv=ikv,
                           index_score=iscore, impl=impl)
