"""indexer_topk's top-k select on large cases: long contexts with big tie
groups, past the CUDA select's register capacity, spread over a cluster of
CTAs, and most keys taken; exact indices against the replayed ranking."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.errors import ErrorKind as EK

from support.indexer import (IMPLS, Q_FORMATS, expected, make_state, needs_cpu_target,
                             queries, random_blocks, run, visible, with_index_keys,
                             with_random_blocks)
from support.marks import CUDA, requires_cpu_ffi

# The select after either query format: its bf16 runs (exact fp32 scores, an
# oracle several times slower) are slow; the mxfp4 runs, the default format,
# stay, and test_indexer_topk_scores checks the bf16 scores themselves.
Q_FORMATS_SELECT = [pytest.param(f, marks=pytest.mark.slow(
    reason="the bf16 query's select; the mxfp4 run stays")) if f == "bf16" else f
    for f in Q_FORMATS]


def few_distinct_keys(rng, st, n_distinct=6):
    """Every key of the pool replaced by one of `n_distinct` keys: scores
    collapse into a few large tie groups (the k-th score sits inside one)."""
    packed = np.array(st.csa.index.packed)
    scale = np.array(st.csa.index.scale.view(np.uint8))
    pick = rng.integers(0, n_distinct, packed.shape[:3])
    src_p = rng.integers(0, 256, (n_distinct, 64), dtype=np.uint8)
    src_s = rng.integers(123, 130, (n_distinct, 4), dtype=np.uint8)
    packed[...] = src_p[pick]
    scale[...] = src_s[pick]
    return with_index_keys(st, packed, scale)


@pytest.mark.parametrize("q_format", Q_FORMATS_SELECT)
@pytest.mark.parametrize("impl", IMPLS)
def test_long_context_many_ties(impl, q_format):
    """2048 entries (several score chunks and select passes on CUDA), k = 512
    and 700, scores in six tie groups, in one (every key equal), and random
    keys."""
    rng = np.random.default_rng(21)
    st = make_state(rng, R=2, max_context=8192)
    st = with_random_blocks(rng, st, 2)
    tied = few_distinct_keys(rng, st)
    same = few_distinct_keys(rng, st, n_distinct=1)     # one key everywhere: one big tie
    slot = np.array([0, 1, 0, 1], np.int32)
    pos = np.array([8191, 5000, 3001, 8191], np.int32)
    q, w = queries(rng, 4)
    for state in (tied, same, st):
        for k in (512, 700):
            got = np.asarray(run(state, 1, slot, pos, q, w, k, impl, return_state=False,
                                 q_format=q_format))
            want, _ = expected(state, 1, slot, pos, q, w, k, q_format)
            np.testing.assert_array_equal(got, want, err_msg=f"k={k}")


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
                                  pytest.param("cuda", marks=CUDA)])
def test_long_context_past_register_capacity(impl):
    """Requests with more than 16384 visible entries (the CUDA select keeps up
    to 16384 keys a token in registers and re-reads the scratch row beyond),
    at the boundary (16384, 16385) and with a partial last warp (17500); k =
    512 (one register per thread in the sort), 1500 (the shared-memory sort);
    random keys, six tie groups (the ordered collection of the ties), and one
    key everywhere (more keys in the select's top-bits bin than its shared
    buffer holds: the passes over all the keys)."""
    rng = np.random.default_rng(23)
    st = make_state(rng, R=2, max_context=131072)
    st = with_random_blocks(rng, st, 2)
    slot = np.array([0, 1, 0, 1], np.int32)
    pos = np.array([131071, 69999, 65535, 65539], np.int32)
    q, w = queries(rng, 4)
    for state, ks in ((st, (512, 1500)), (few_distinct_keys(rng, st), (512,)),
                      (few_distinct_keys(rng, st, n_distinct=1), (512,))):
        want_all, _ = expected(state, 1, slot, pos, q, w, max(ks), "mxfp4")
        for k in ks:
            got = np.asarray(run(state, 1, slot, pos, q, w, k, impl, return_state=False,
                                 q_format="mxfp4"))
            np.testing.assert_array_equal(got, want_all[:, :k], err_msg=f"k={k}")


@pytest.mark.parametrize("max_context", [pytest.param(262144, marks=pytest.mark.slow(
    reason="the largest spread on the CPU; 1048576 over fewer entries stays")), 1048576])
@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
                                  pytest.param("cuda", marks=CUDA)])
def test_select_spread_over_a_cluster(impl, max_context):
    """Past 16384 visible entries a token's CUDA select spreads over a
    cluster of CTAs (SelectCtas in cuda/indexer_topk/launch_policy.h: 4 here
    at 65536 entries, 8 at 262144, whose chunks exceed a CTA's registers),
    each counting its chunk of the keys and handing the leader its
    candidates. Every path of it: random keys (small top-bits bins: ranks
    within bins), six tie groups (a bin past the ranking's limit: radix
    passes over the bin's keys, at 1M over all the keys), one key everywhere
    (a bin larger than the buffer: the leader's passes over all the keys; at
    999 entries a bin that fits the gather, and with k = 1500 every
    candidate taken, both sorted);
    k = 512 and 1500 (the shared-memory sort); a token with fewer
    candidates than k (all taken), one with fewer entries than CTAs, a
    padding token, and a missing block (counted once a token that needs
    it, by the score kernel in "mxfp4" and by the select's leader in
    "bf16", whose indices this test does not replay: too large a replay)."""
    if impl == "cpu" and max_context > 262144:
        pytest.skip("the CPU handler at 1M context: minutes")
    rng = np.random.default_rng(29)
    st = make_state(rng, R=2, max_context=max_context)
    MB = st.config.max_blocks_per_request
    bt = np.stack([np.r_[b] for b in random_blocks(rng, st.config, range(2)).values()])
    bt[1, MB // 2 + 1] = -1                    # slot 1: a missing block past its middle
    st = dataclasses.replace(st, block_table=jnp.asarray(bt.astype(np.int32)))
    slot = np.array([0, 1, 0, -1, 1, 0], np.int32)
    pos = np.array([max_context - 1, max_context - 1, 9, 100, max_context // 2 + 200, 3999],
                   np.int32)
    missing = sum(1 for s, p in zip(slot, pos)
                  if s == 1 and visible(int(p), MB) > (MB // 2 + 1) * 32)
    q, w = queries(rng, len(slot))
    for state, ks in ((st, (512, 1500)), (few_distinct_keys(rng, st), (512,)),
                      (few_distinct_keys(rng, st, n_distinct=1), (512, 1500))):
        want_all, _ = expected(state, 1, slot, pos, q, w, max(ks), "mxfp4")
        for k in ks:
            got, st2 = run(state, 1, slot, pos, q, w, k, impl, q_format="mxfp4")
            np.testing.assert_array_equal(np.asarray(got), want_all[:, :k], err_msg=f"k={k}")
            err = np.asarray(st2.errors)
            assert err[EK.MISSING_BLOCK] == missing == 2 and err.sum() == missing
    _, st2 = run(st, 1, slot, pos, q, w, 512, impl, q_format="bf16")
    err = np.asarray(st2.errors)
    assert err[EK.MISSING_BLOCK] == missing and err.sum() == missing


@pytest.mark.parametrize("q_format", Q_FORMATS_SELECT)
@pytest.mark.parametrize("impl", IMPLS)
def test_many_taken_keys_a_warp(impl, q_format):
    """k = 3000 and 4096 (the CUDA handler's largest k) over 3100 to 4096
    entries: most keys are taken, about 100 a warp of the CUDA select, where
    the usual case takes one or two a round; with k = 4096 every candidate
    is taken and the shorter tokens' rows end in -1. Random keys, and one
    key everywhere: a single tie of 3100 to 4096 keys, more than the CUDA
    select ranks within a bin, so its radix passes and its bitonic sort in
    shared memory order them (k = 4096: the sort of every candidate)."""
    rng = np.random.default_rng(47)
    st = make_state(rng, R=2, max_context=16384)
    st = with_random_blocks(rng, st, 2)
    slot = np.array([0, 1, 0], np.int32)
    pos = np.array([16000, 12399, 16383], np.int32)          # 4000, 3100, 4096 entries
    q, w = queries(rng, 3)
    for state in (st, few_distinct_keys(rng, st, n_distinct=1)):
        want_all, _ = expected(state, 1, slot, pos, q, w, 4096, q_format)
        for k in (3000, 4096):
            got = np.asarray(run(state, 1, slot, pos, q, w, k, impl, return_state=False,
                                 q_format=q_format))
            np.testing.assert_array_equal(got, want_all[:, :k], err_msg=f"k={k}")
        assert (want_all[1] >= 0).sum() == 3100 and np.all(want_all[2] >= 0)
