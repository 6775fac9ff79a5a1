"""The decode step hands every cache op its operands where they already lie:
no copy kernel beside the library's calls, at any batch.

The rule checked on the compiled step's optimized HLO (support/hlo.py): no
operand of a dsv4_* custom call is made by an instruction that only moves
bytes, a copy (but of a literal constant: XLA materializes the scan
counter's start so, once a step, and hands it to the calls whose layer
index is that constant), slice, dynamic-slice,
transpose, concatenate, reshape, pad or reverse, or a fusion of nothing
but those, seen through bitcasts. Such an operand is a buffer of its own
that XLA fills before every call: the write ops once took meta.token_slot
and meta.token_pos, two slices of the step's packed metadata, and the
V4-Flash step ran them as two copies a layer (43 `memcpy32_post` a step on
an H200 at B = 1 and 16). The step is the decode-step benchmark's
(model_step.make_step) on the V4-Flash layer plan, compiled, never run."""
import jax
import jax.numpy as jnp
import pytest

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.app.bench import model_step as bs
from dsv4_jax.ops.dispatch import ffi_in_place
from support.hlo import copied_operands
from support.marks import CUDA, requires_cpu_ffi

CONTEXT = 512
VARIANTS = ["base", "gathers+separate-write", "unroll"]


def step_hlo(B, variant, impl):
    """Optimized HLO of the V4-Flash decode step at B requests, compiled for
    the default backend on abstract operands (no state is made)."""
    cfg = dj.CacheConfig.flash(max_requests=B, max_context=CONTEXT)
    state = jax.eval_shape(lambda: dj.init_state(cfg))
    x = bs.step_inputs(B, CONTEXT)
    step = bs.make_step(cfg, CONTEXT, bs.Variant.parse(variant), impl)
    return step.lower(state, x).compile().as_text()


def check(B, variant, impl):
    hlo = step_hlo(B, variant, impl)
    assert "dsv4_write_layer_csa" in hlo or "dsv4_flush_csa" in hlo, "no cache op compiled"
    found = copied_operands(hlo)
    assert not found, "copies made for the cache ops' operands:\n" + "\n".join(found)


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=requires_cpu_ffi),
                                  pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B", [1, 16, 64])
def test_step_hands_cache_ops_no_copies(B, variant, impl):
    check(B, variant, impl)


@requires_cpu_ffi
def test_rule_sees_a_sliced_operand():
    """The rule is not blind: an append handed a slice of the metadata (the
    old operands' way) and a transposed kv is reported, once each; the
    same call on the metadata whole is not."""
    cfg = dj.CacheConfig.tiny(max_requests=2, max_context=CONTEXT)
    state = jax.eval_shape(lambda: dj.init_state(cfg))
    meta = dj.StepMeta.build(token_slot=[0, 1], token_pos=[5, 9], lengths=[6, 10])
    kv = jnp.zeros((C.HEAD_DIM, 2), jnp.bfloat16)

    def append(st, data, kv, sliced):
        rows = data[:4] if sliced else data
        return ffi_in_place("dsv4_append", [jnp.int32(0), rows, kv.T],
                            [st.swa.pos, st.errors, *jax.tree_util.tree_leaves(st.swa.kv)],
                            kv_format=C.KV_FORMAT_CODE[cfg.kv_format],
                            max_context=cfg.max_context, max_rows_per_slot=0)

    def hlo(sliced):
        f = jax.jit(lambda st, d, k: append(st, d, k, sliced), donate_argnums=0)
        return f.lower(state, meta.data, kv).compile().as_text()
    sliced, whole = copied_operands(hlo(True)), copied_operands(hlo(False))
    assert len(sliced) == 2 and "operand 1:" in sliced[0] and "operand 2:" in sliced[1], sliced
    assert len(whole) == 1 and "operand 2:" in whole[0], whole
