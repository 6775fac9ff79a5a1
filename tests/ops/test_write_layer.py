"""write_layer (dsv4_jax/ops/write_layer.py) against its definition: append
then flush with the same arguments. Every implementation must leave the
same bytes and the same error counts as its own append + flush, on random
multi-request steps (chunks longer than the window, decode, padding) and on
bad input; the CUDA kernels also against the CPU handlers."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind as K

from dsv4_jax.app.workload import Flips, compare_states, layer_params
from support.workload import step_inputs
from support.harness import poison
from support.inplace import assert_in_place, compiled_text
from support.marks import CUDA, requires_cpu_ffi
from support.trees import assert_trees_bytes_equal

FORMATS = ("ds_fp8", "fp8_token", "bf16")
T_PAD = 512                # every step of the workload padded to this many rows


# ---- the two ways of writing a step ------------------------------------------------------
def _split(state, meta, x, params, impl):
    for layer, kind in enumerate(state.config.layer_kinds):
        state = dj.append(state, layer, meta, x[layer]["kv"], impl=impl)
        if kind == C.CSA:
            state = dj.flush(state, layer, meta, x[layer]["ckv"], x[layer]["score"],
                             params[layer], index_kv=x[layer]["ikv"],
                             index_score=x[layer]["iscore"], impl=impl)
        elif kind == C.HCA:
            state = dj.flush(state, layer, meta, x[layer]["ckv"], x[layer]["score"],
                             params[layer], impl=impl)
    return state


def _fused(state, meta, x, params, impl):
    for layer, kind in enumerate(state.config.layer_kinds):
        if kind == C.SWA:
            state = dj.write_layer(state, layer, meta, x[layer]["kv"], impl=impl)
        else:
            state = dj.write_layer(state, layer, meta, x[layer]["kv"], x[layer]["ckv"],
                                   x[layer]["score"], params[layer], index_kv=x[layer].get("ikv"),
                                   index_score=x[layer].get("iscore"), impl=impl)
    return state


@functools.partial(jax.jit, static_argnames=("impl", "fused"), donate_argnames=("state",))
def write_step(state, meta, x, params, impl, fused):
    state = dj.apply_step(state, meta, impl=impl)
    return (_fused if fused else _split)(state, meta, x, params, impl)


def workload(cfg, seed, steps=7):
    """Per step (meta, inputs): admissions, a release, prefill chunks of up to
    300 tokens (several tokens of a request on one ring slot in one call),
    then decode; rows padded to T_PAD."""
    rng = np.random.default_rng(seed)
    m = dj.CacheManager(cfg)
    for step in range(steps):
        if step == 3 and m.requests:
            m.release(m.requests[0])
        while m.free_slots and rng.random() < 0.7:
            m.admit()
        tokens, budget = {}, T_PAD
        for rid in m.requests:
            room = cfg.max_context - m.length_of(rid)
            n = int(rng.integers(1, 300)) if step < 3 or m.length_of(rid) == 0 else 1
            n = min(n, room, budget)
            if n > 0 and rng.random() > 0.15:
                tokens[rid] = n
                budget -= n
        meta = m.prepare_step(tokens, min_tokens=T_PAD, min_new_blocks=16, min_resets=4)
        assert meta.num_tokens == T_PAD
        yield meta, step_inputs(cfg, T_PAD, rng)


def fresh_state(cfg, nan_accumulators=True):
    """Pools 0xA5, window positions 7777, accumulators NaN: a byte either
    path writes and the other does not shows. Comparisons across
    implementations (within rtol) keep the empty accumulators instead."""
    st = poison(dj.init_state(cfg))
    if nan_accumulators:
        return st
    empty = dj.init_state(cfg)
    return dataclasses.replace(st, csa=dataclasses.replace(st.csa, comp=empty.csa.comp,
                                                           icomp=empty.csa.icomp),
                               hca=dataclasses.replace(st.hca, comp=empty.hca.comp))


# The reference's write_layer calls its append and its flush with the operands
# the split path hands them, whatever the format: one format shows that
# wiring (each format's reference compiles two programs, this test's cost).
# The handlers' fused code is their own: they run every format.
@pytest.mark.parametrize("impl, fmt", [("reference", "ds_fp8")] + [
    pytest.param("cpu", fmt, marks=requires_cpu_ffi) for fmt in FORMATS])
def test_write_layer_is_append_then_flush(impl, fmt):
    cfg = C.CacheConfig.tiny(kv_format=fmt)
    params = layer_params(cfg, seed=11)
    split, fused = fresh_state(cfg), fresh_state(cfg)
    for step, (meta, x) in enumerate(workload(cfg, seed=3)):
        split = write_step(split, meta, x, params, impl=impl, fused=False)
        fused = write_step(fused, meta, x, params, impl=impl, fused=True)
        assert_trees_bytes_equal(fused, split, f"{impl} {fmt} step {step}: ")
    assert not np.asarray(fused.errors).any()


@requires_cpu_ffi
@pytest.mark.slow(reason="five steps through the reference; test_write_layer_is_append_then_flush "
                  "(the CPU handlers) and append's and flush's parity with the reference stay")
def test_cpu_write_layer_matches_reference_append_then_flush():
    cfg = C.CacheConfig.tiny(kv_format="ds_fp8")
    params = layer_params(cfg, seed=5)
    ref, cpu = fresh_state(cfg, False), fresh_state(cfg, False)
    flips = Flips()
    for step, (meta, x) in enumerate(workload(cfg, seed=8, steps=5)):
        ref = write_step(ref, meta, x, params, impl="reference", fused=False)
        cpu = write_step(cpu, meta, x, params, impl="cpu", fused=True)
        compare_states(cpu, ref, flips, f"step {step} ")
    assert flips.fraction <= 1e-3, flips


# ---- bad input: counted exactly as append + flush count it --------------------------------
CFG = C.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16)
R, MAXCTX = CFG.max_requests, CFG.max_context
T = 48


@functools.cache         # built once: the calls below take it and do not donate it
def base_state():
    """Slots 0-2 hold requests with blocks for 512, 256 and 128 tokens; slot 3
    none (its compressor tokens meet MISSING_BLOCK, its window tokens are
    valid). Pools 0xA5, accumulators NaN."""
    m = dj.CacheManager(CFG)
    for _ in range(3):
        m.admit()
    st = dj.apply_step(dj.init_state(CFG), m.prepare_step({0: 512, 1: 256, 2: 128}),
                       impl="reference")
    p = poison(st)
    return dataclasses.replace(p, block_table=st.block_table, swa=st.swa,
                               csa=dataclasses.replace(p.csa, comp=st.csa.comp,
                                                       icomp=st.csa.icomp),
                               hca=dataclasses.replace(p.hca, comp=st.hca.comp))


def bad_rows(seed):
    """Rows of every kind: per request contiguous positions from 0 (over 128
    for slot 0, so ring slots repeat), padding, bad slots, bad positions,
    slot 3 (no blocks), and NaN/Inf in the window row, the compressor row or
    both. Returns slot, pos, window kv, comp kv/score, index kv/score, and
    the counts the two calls make together on a CSA layer. A bad position
    takes its request's next position (flush's expected one,
    docs/design/semantics.md) and is never the request's first row, whose position sets the
    expected ones; bad there, it would make all the request's rows bad."""
    rng = np.random.default_rng(seed)
    slot, pos = np.full(T, -1, np.int32), np.zeros(T, np.int32)
    nxt = {0: 120, 1: 0, 2: 0, 3: 0}
    kinds = rng.choice(["ok", "ok", "ok", "pad", "slot", "pos", "block", "nan_win", "nan_comp",
                        "nan_both"], T)
    seen = set()
    for t, k in enumerate(kinds):
        s = int(rng.integers(0, 3))
        if k == "pad":
            continue
        if k == "slot":
            slot[t], pos[t] = rng.choice([R, R + 7, -2, -100]), rng.integers(0, 50)
            continue
        if k == "block":
            s = 3
        if k == "pos" and s not in seen:
            kinds[t] = k = "ok"
        seen.add(s)
        if k == "pos":
            slot[t], pos[t] = s, rng.choice([-1, -50, MAXCTX, MAXCTX + 9])
            nxt[s] += 1
            continue
        slot[t], pos[t] = s, nxt[s]
        nxt[s] += 1
    win = rng.normal(0, 2, (T, 512)).astype(ml_dtypes.bfloat16)
    f = lambda w: rng.normal(0, 2, (T, w)).astype(np.float32)
    ckv, csc, ikv, isc = f(1024), f(1024), f(256), f(256)
    for t in np.flatnonzero(np.isin(kinds, ["nan_win", "nan_both"])):
        win[t, rng.integers(512)] = rng.choice([np.nan, np.inf, -np.inf])
    for t in np.flatnonzero(np.isin(kinds, ["nan_comp", "nan_both"])):
        a = [ckv, csc, ikv, isc][rng.integers(4)]
        a[t, rng.integers(a.shape[1])] = rng.choice([np.nan, np.inf, -np.inf])
    n = lambda *ks: int(np.isin(kinds, ks).sum())
    # each part counts the rows it drops: bad slots and positions twice,
    # slot 3 once (flush: no block), NaN once per part whose input holds it
    counts = {K.BAD_SLOT: 2 * n("slot"), K.BAD_POSITION: 2 * n("pos"),
              K.MISSING_BLOCK: n("block"),
              K.NONFINITE: n("nan_win") + n("nan_comp") + 2 * n("nan_both")}
    return slot, pos, win, (ckv, csc, ikv, isc), {k: v for k, v in counts.items() if v}


def meta_of(slot, pos):
    return dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(R, np.int32),
                             new_blocks=np.full((1, 3), -1), reset_slots=[-1])


@jax.jit
def _split_csa(st, meta, win, ckv, csc, ikv, isc, p, layer):
    st = dj.append(st, layer, meta, win)
    return dj.flush(st, layer, meta, ckv, csc, p, index_kv=ikv, index_score=isc)


@jax.jit
def _fused_csa(st, meta, win, ckv, csc, ikv, isc, p, layer):
    return dj.write_layer(st, layer, meta, win, ckv, csc, p, index_kv=ikv, index_score=isc)


@jax.jit
def _split_hca(st, meta, win, ckv, csc, p, layer):
    return dj.flush(dj.append(st, layer, meta, win), layer, meta, ckv, csc, p)


@jax.jit
def _fused_hca(st, meta, win, ckv, csc, p, layer):
    return dj.write_layer(st, layer, meta, win, ckv, csc, p)


def counts_delta(new, old):
    d = np.asarray(new.errors) - np.asarray(old.errors)
    return {K(i): int(v) for i, v in enumerate(d) if v}


@pytest.mark.usefixtures("impl_under_test")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bad_input_counted_as_append_then_flush(seed):
    base = base_state()
    params = layer_params(CFG, seed=4)
    slot, pos, win, (ckv, csc, ikv, isc), want_counts = bad_rows(seed)
    meta = meta_of(slot, pos)
    win = jnp.asarray(win)
    # CSA layer 1 (traced: the layer is an operand of the jitted functions)
    args = (base, meta, win, ckv, csc, ikv, isc, params[1], jnp.int32(1))
    got, want = _fused_csa(*args), _split_csa(*args)
    assert_trees_bytes_equal(got, want, "csa: ")
    assert counts_delta(got, base) == want_counts
    # HCA layer 2: the compressor is 512 wide and has no indexer
    args = (base, meta, win, ckv[:, 512:], csc[:, 512:], params[2], jnp.int32(2))
    got, want = _fused_hca(*args), _split_hca(*args)
    assert_trees_bytes_equal(got, want, "hca: ")
    # SWA layer 0: write_layer is append
    got = jax.jit(lambda s, m, w: dj.write_layer(s, 0, m, w))(base, meta, win)
    want = jax.jit(lambda s, m, w: dj.append(s, 0, m, w))(base, meta, win)
    assert_trees_bytes_equal(got, want, "swa: ")


@pytest.mark.usefixtures("impl_under_test")
@pytest.mark.parametrize("layer, bad_layer", [(-1, 2), (0, 1), (2, 1), (3, 0), (4, 2), (99, 2)])
def test_bad_traced_layer_counted_per_part(layer, bad_layer):
    """A traced layer out of range counts BAD_LAYER for append and for flush;
    one of another kind (0 is SWA, 2 HCA: CSA operands given) writes the
    window and counts BAD_LAYER once, for flush."""
    base = base_state()
    params = layer_params(CFG, seed=4)
    slot, pos, win, (ckv, csc, ikv, isc), _ = bad_rows(5)
    args = (base, meta_of(slot, pos), jnp.asarray(win), ckv, csc, ikv, isc, params[1],
            jnp.int32(layer))
    got, want = _fused_csa(*args), _split_csa(*args)
    assert_trees_bytes_equal(got, want)
    assert counts_delta(got, base).get(K.BAD_LAYER, 0) == bad_layer


# ---- the call itself ----------------------------------------------------------------------
@requires_cpu_ffi
def test_one_ffi_call_per_layer_in_place():
    cfg = C.CacheConfig.tiny()
    params = layer_params(cfg, seed=1)
    meta, x = next(workload(cfg, seed=2, steps=1))
    step = jax.jit(lambda s, m, xx: _fused(s, m, xx, params, "cpu"), donate_argnums=0)
    state = dj.apply_step(dj.init_state(cfg), meta)
    hlo = compiled_text(step, state, meta, x)
    targets = re.findall(r'custom_call_target="(dsv4_\w+)"', hlo)
    assert sorted(targets) == sorted(["dsv4_append", "dsv4_write_layer_csa",
                                      "dsv4_write_layer_hca", "dsv4_write_layer_csa"]), targets
    assert_in_place(step, state, meta, x)


def test_trace_time_errors_name_the_argument():
    cfg = C.CacheConfig.tiny()
    params = layer_params(cfg, seed=1)
    st = dj.init_state(cfg)
    meta, x = next(workload(cfg, seed=2, steps=1))
    kv, ckv, sc = x[1]["kv"], x[1]["ckv"], x[1]["score"]
    with pytest.raises(ValueError, match="comp_kv: layer 0 is SWA"):
        dj.write_layer(st, 0, meta, kv, ckv, sc, params[1])
    with pytest.raises(ValueError, match="comp_kv: layer 1 is CSA: it needs comp_kv"):
        dj.write_layer(st, 1, meta, kv)
    with pytest.raises(ValueError, match=r"comp_kv: expected shape \[512, 1024\], got \[512, 512\]"):
        dj.write_layer(st, 1, meta, kv, ckv[:, :512], sc, params[1],
                       index_kv=x[1]["ikv"], index_score=x[1]["iscore"])
    with pytest.raises(ValueError, match=r"kv: expected dtype bfloat16"):
        dj.write_layer(st, 2, meta, kv.astype(jnp.float32), x[2]["ckv"], x[2]["score"],
                       params[2])
    with pytest.raises(ValueError, match="index_kv: a CSA layer needs"):
        dj.write_layer(st, 1, meta, kv, ckv, sc, params[1])
    with pytest.raises(ValueError, match="layer"):
        dj.write_layer(st, 7, meta, kv)


def test_sharded_write_layer_is_append_then_flush():
    from jax.sharding import Mesh
    from dsv4_jax.sharding import ShardedCacheManager, init_sharded_state, shard_config
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(devices[:2]), ("data",))
    cfg = shard_config(C.CacheConfig.tiny(max_requests=4, num_blocks=16), mesh, "data")
    params = layer_params(cfg, seed=6)
    manager = ShardedCacheManager(cfg)
    rng = np.random.default_rng(9)
    for _ in range(3):
        manager.admit()
    split = fused = init_sharded_state(cfg, mesh)
    step = jax.jit(lambda s, m, xx, fu: (_fused if fu else _split)(
        dj.apply_step(s, m), m, xx, params, "auto"), static_argnums=3)
    for n in (150, 1):
        meta = manager.prepare_step({r: n for r in manager._shard_of})
        x = step_inputs(cfg, 2 * manager.tokens_per_shard, rng)
        with jax.set_mesh(mesh):
            split = step(split, meta, x, False)
            fused = step(fused, meta, x, True)
        assert_trees_bytes_equal(fused, split)


# ---- CUDA ----------------------------------------------------------------------------------
def _on(device, tree):
    return jax.device_put(tree, jax.devices(device)[0])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mark", [pytest.param(0, marks=CUDA)])
def test_cuda_write_layer_matches_split_and_reference(fmt, mark):
    """CUDA write_layer (one kernel per layer) against CUDA append + flush
    (the same device code: byte-identical) and against the reference run on
    the CPU device (the window exact, compressed entries within one code)."""
    cfg = C.CacheConfig.tiny(kv_format=fmt)
    params = layer_params(cfg, seed=11)
    split, fused = (_on("cuda", fresh_state(cfg, False)) for _ in range(2))
    ref = _on("cpu", fresh_state(cfg, False))
    flips = Flips()
    for step, (meta, x) in enumerate(workload(cfg, seed=3)):
        g = _on("cuda", (meta, x, params))
        split = write_step(split, *g, impl="cuda", fused=False)
        fused = write_step(fused, *g, impl="cuda", fused=True)
        ref = write_step(ref, *_on("cpu", (meta, x, params)), impl="reference", fused=False)
        assert_trees_bytes_equal(fused, split, f"{fmt} step {step}: ")
        assert_trees_bytes_equal(fused.swa, ref.swa, f"{fmt} step {step} window: ")
        compare_states(fused, ref, flips, f"step {step} ")
    assert flips.fraction <= 1e-3, flips


def _append_cases():
    """(name, R, slot, pos, nan_rows): the shapes the CUDA append kernel
    treats differently, each checked against the CPU handler."""
    rng = np.random.default_rng(0)
    cases = []
    # one request, 1000 consecutive positions: ring slots repeat ~8 times;
    # NaN in some top rows (an older finite token must win, two levels down
    # for row 900) and in every row of one ring slot (nothing written there)
    s = np.zeros(1000, np.int32)
    p = np.arange(3000, 4000, dtype=np.int32)
    nan = np.r_[999, 998, 998 - 128, 900, 900 - 128, 900 - 256, np.arange(5, 1000, 128)]
    cases.append(("one long run", 4, s, p, nan))
    # the same rows shuffled: no longer grouped, the general path
    perm = rng.permutation(1000)
    cases.append(("shuffled run", 4, s[perm], p[perm], np.flatnonzero(np.isin(perm, nan))))
    # the manager's shape at scale: 512 requests x 128 tokens, slots in any
    # order, padding at the end, a few NaN rows
    slots = rng.permutation(512).astype(np.int32)
    s = np.r_[np.repeat(slots, 128), np.full(40, -1)].astype(np.int32)
    p = np.r_[np.tile(np.arange(128), 512) + np.repeat(rng.integers(0, 5000, 512), 128),
              np.zeros(40)].astype(np.int32)
    cases.append(("512 x 128", 512, s, p, rng.choice(512 * 128, 50, replace=False)))
    # decode: one token per request, bad slots and positions mixed in
    s = np.array([3, -1, 7, 1, 0, 99, 2, -5, 4, 5], np.int32)
    p = np.array([9, 0, 77, 1000, 3, 1, -1, 2, 1 << 30, 128], np.int32)
    cases.append(("decode with bad rows", 8, s, p, np.array([4])))
    # grouped runs, but slot 0 in two runs: must take the general path
    s = np.r_[np.zeros(200), np.ones(50), np.zeros(100)].astype(np.int32)
    p = np.r_[np.arange(200), np.arange(50), np.arange(150, 250)].astype(np.int32)
    cases.append(("slot in two runs", 4, s, p, np.array([199, 120])))
    # a run whose positions skip: general path
    s = np.full(300, 1, np.int32)
    p = np.r_[np.arange(100), np.arange(101, 301)].astype(np.int32)
    cases.append(("gap in a run", 4, s, p, np.array([299])))
    # the same positions twice in one call (ties go to the later row)
    s = np.full(600, 2, np.int32)
    p = np.r_[np.arange(300), np.arange(300)].astype(np.int32)
    cases.append(("duplicate positions", 4, s, p, np.array([599, 10])))
    # a run crossing max_context: rows past it are dropped, the rows below
    # them win their ring slots
    s = np.full(400, 3, np.int32)
    p = np.arange(8192 - 250, 8192 + 150, dtype=np.int32)
    cases.append(("run past max_context", 4, s, p, np.array([249, 100])))
    # random rows, many requests, duplicates and padding: the general path at size
    s = rng.integers(-1, 64, 8192).astype(np.int32)
    p = rng.integers(0, 4096, 8192).astype(np.int32)
    cases.append(("random 8192", 64, s, p, rng.choice(8192, 100, replace=False)))
    # the manager's shape between the scan and the clustered check: 32 requests x
    # 128 tokens, slots in any order, a few NaN rows
    slots = rng.permutation(32).astype(np.int32)
    s = np.repeat(slots, 128).astype(np.int32)
    p = (np.tile(np.arange(128), 32) + np.repeat(rng.integers(0, 5000, 32), 128)).astype(np.int32)
    cases.append(("32 x 128", 32, s, p, rng.choice(32 * 128, 20, replace=False)))
    # a decode step of 64 one-token requests, one of them given a second row on
    # its cell (128 later, NaN: the first row keeps the cell) and one a row at
    # the same position (the later row wins)
    s = np.r_[np.arange(62), 5, 9].astype(np.int32)
    p = np.r_[rng.integers(0, 8000, 62), 0, 0].astype(np.int32)
    p[62], p[63] = p[5] + 128, p[9]
    cases.append(("decode 64, shared cells", 64, s, p, np.array([62])))
    # the scan at size, any order: bad slots and positions, padding, many rows
    # a cell, NaN rows; a row count off a multiple of 4 (the staged copy's last
    # group is partial)
    s = rng.integers(-2, 20, 777).astype(np.int32)
    p = rng.integers(-5, 8300, 777).astype(np.int32)
    cases.append(("random 777", 16, s, p, rng.choice(777, 40, replace=False)))
    # the largest scan and the smallest shape check, the manager's shape
    slots = rng.permutation(8).astype(np.int32)
    s = np.repeat(slots, 128).astype(np.int32)
    p = (np.tile(np.arange(128), 8) + np.repeat(rng.integers(0, 5000, 8), 128)).astype(np.int32)
    cases.append(("8 x 128", 8, s, p, rng.choice(1024, 10, replace=False)))
    cases.append(("8 x 128 and a row", 9, np.r_[s, 8].astype(np.int32),
                  np.r_[p, 77].astype(np.int32), np.array([1024, 3])))
    # grouped runs of odd lengths, padding and bad slots between them, NaN
    # rows, 3,001 rows (the 4-row loads' last group partial; runs starting
    # inside a group and at a group's first row)
    lengths = rng.integers(1, 200, 23)
    lengths[-1] = 3001 - 3 - lengths[:-1].sum()
    assert lengths[-1] > 0
    order = rng.permutation(23).astype(np.int32)
    s = np.repeat(order, lengths).astype(np.int32)
    p = np.concatenate([np.arange(n) + rng.integers(0, 7000) for n in lengths]).astype(np.int32)
    cuts = np.cumsum(lengths)[[3, 9, 15]]
    s = np.insert(s, cuts, [-1, 99, -7]).astype(np.int32)
    p = np.insert(p, cuts, [0, 5, 5]).astype(np.int32)
    cases.append(("grouped 3001", 23, s, p, rng.choice(3001, 30, replace=False)))
    # the check at size, any order, a row count off a multiple of 4
    s = rng.integers(-1, 40, 5003).astype(np.int32)
    p = rng.integers(-3, 8200, 5003).astype(np.int32)
    cases.append(("random 5003", 40, s, p, rng.choice(5003, 60, replace=False)))
    cases.append(("one row", 4, np.array([1], np.int32), np.array([5], np.int32),
                  np.array([], int)))
    cases.append(("no rows", 4, np.zeros(0, np.int32), np.zeros(0, np.int32), np.array([], int)))
    return cases


@pytest.mark.parametrize("case", _append_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mark", [pytest.param(0, marks=CUDA)])
def test_cuda_append_matches_cpu(case, fmt, mark):
    """The CUDA append kernel's paths (the per-token scan of a call of at most
    1024 rows, its metadata searched in global memory up to 64 rows and staged
    in shared memory above; above 1024, the shape check, 4 rows a load, with
    clusters from 16384 rows, then grouped runs or any order) and their edge
    cases, byte for byte against
    the CPU handler (called eagerly on CPU arrays); two layers, so layer 1
    of the first call stays as the second call finds it."""
    _, nreq, slot, pos, nan_rows = case
    cfg = C.CacheConfig.tiny(max_requests=nreq, max_context=8192, num_blocks=8, kv_format=fmt)
    rng = np.random.default_rng(len(slot))
    kv = rng.normal(0, 2, (len(slot), 512)).astype(ml_dtypes.bfloat16)
    for t in nan_rows:
        kv[t, rng.integers(512)] = rng.choice([np.nan, np.inf, -np.inf])
    meta = dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(nreq, np.int32))
    outs = {}
    for impl in ("cuda", "cpu"):
        st, m, x = _on(impl, (fresh_state(cfg), meta, jnp.asarray(kv)))
        for layer in (1, 3):
            st = dj.append(st, layer, m, x, impl=impl)
        outs[impl] = jax.device_get(st)
    assert_trees_bytes_equal(outs["cuda"], outs["cpu"])
    good_slot = (slot >= 0) & (slot < nreq)
    good = good_slot & (pos >= 0) & (pos < 8192)
    want = {K.BAD_SLOT: np.sum((slot != -1) & ~good_slot),
            K.BAD_POSITION: np.sum(good_slot & ~good),
            K.NONFINITE: np.sum(good[np.asarray(nan_rows, int)])}
    got = np.asarray(outs["cpu"].errors)
    assert {k: int(got[k]) for k in want} == {k: 2 * int(v) for k, v in want.items()}


@requires_cpu_ffi
def test_ffi_operands_checked_as_append_and_flush_check_them():
    """The FFI target itself: a missing aliased buffer is named by count, a
    bad window row by append's check, a bad projection by flush's (as comp_kv)."""
    cfg = C.CacheConfig.tiny()
    st = dj.init_state(cfg)
    p = layer_params(cfg, seed=1)[2]
    n = 4
    z = lambda *s: jnp.zeros(s, jnp.float32)

    def call(kv=None, ckv=None, cscore=None, drop_leaf=False):
        aliased = [st.swa.pos, *jax.tree_util.tree_leaves(st.swa.kv), st.hca.comp, st.errors,
                   *jax.tree_util.tree_leaves(st.hca.kv)][:-1 if drop_leaf else None]
        meta = jnp.concatenate([jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32)])
        args = [jnp.int32(0), jnp.int32(0), meta,
                jnp.zeros((n, 512), jnp.bfloat16) if kv is None else kv,
                z(n, 512) if ckv is None else ckv, z(n, 512) if cscore is None else cscore,
                p.ape, p.norm, p.inv_freq,
                st.block_table, *aliased]
        f = jax.ffi.ffi_call("dsv4_write_layer_hca",
                             [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased],
                             input_output_aliases={10 + i: i for i in range(len(aliased))})
        return jax.block_until_ready(f(*args, kv_format=np.int64(0),
                                       max_context=np.int64(cfg.max_context),
                                       max_rows_per_slot=np.int64(0)))

    out = call()
    assert np.asarray(out[0])[0, 0, :4].tolist() == [0, 1, 2, 3]
    with pytest.raises(Exception, match=r"write_layer_hca: expected 9 aliased buffers .* "
                                        r"got 8 inputs and 8 results"):
        call(drop_leaf=True)
    with pytest.raises(Exception, match=r"kv: expected shape \[\*, 512\], got \[4, 448\]"):
        call(kv=jnp.zeros((n, 448), jnp.bfloat16))
    with pytest.raises(Exception, match=r"comp_kv: expected dtype float32, got bfloat16"):
        call(ckv=jnp.zeros((n, 512), jnp.bfloat16))
    # append's rows are kv's, flush's comp_kv's: one step's rows
    with pytest.raises(Exception, match=r"comp_kv: expected 4 rows \(as kv\), got 3"):
        call(ckv=z(n - 1, 512), cscore=z(n - 1, 512))
