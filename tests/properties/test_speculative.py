"""Speculative steps (docs/design/speculative.md): after verify_commit and the kept
rows' write_layer, every byte a request holds — its block-table row, window,
accumulators and the pool entries of its blocks — and every read of it equal
a twin cache fed only the kept tokens; the verify pass's indexer picks and
attention outputs equal those of a prefill chunk of the same tokens; a bad
count is counted once and keeps nothing; rejected rows leave no count."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind
from dsv4_jax.meta import bucket
from dsv4_jax.sharding import ShardedCacheManager, init_sharded_state, shard_config
from support.marks import CUDA, requires_cpu_ffi
from support.speculative import SpecDriver, assert_same_cache
from support.sharding import data_mesh
from support.streams import Driver, stream

IMPLS = ["reference", pytest.param("cpu", marks=requires_cpu_ffi),
         pytest.param("cuda", marks=CUDA)]


def pads_of(cfg) -> dict:
    """prepare_step minimums every step of `cfg` fits (new blocks: at most
    the pool's; resets: at most one a slot), so a step's shape varies only
    with its rows: fewer programs to compile, the reference's being this
    file's cost."""
    return dict(min_new_blocks=bucket(cfg.num_blocks), min_resets=bucket(cfg.max_requests))


def drivers(cfg, streams, drafts, impl, mesh=None, read=None, min_tokens=16):
    """(speculative cache, twin) over the same streams, both fresh; unsharded,
    with `pads_of(cfg)`."""
    pads = pads_of(cfg) if mesh is None else {}

    def parts():
        if mesh is None:
            return cfg, dj.CacheManager(cfg), dj.init_state(cfg)
        scfg = shard_config(cfg, mesh, "data")
        return scfg, ShardedCacheManager(scfg), init_sharded_state(scfg, mesh)
    x = SpecDriver(*parts(), streams, mesh=mesh, impl=impl, min_tokens=min_tokens,
                   drafts=drafts, read=read, pads=pads)
    y = Driver(*parts(), streams, mesh=mesh, impl=impl, min_tokens=min_tokens, pads=pads)
    return x, y


def admit_both(x, y, name, **kw):
    return x.admit(name, **kw), y.admit(name, **kw)


def step_both(x, y, pairs, tokens):
    """The same plain step (prefill) in both caches."""
    x.step({rx: n for (rx, _), n in zip(pairs, tokens)})
    y.step({ry: n for (_, ry), n in zip(pairs, tokens)})


def spec_both(x, y, pairs, drafts, accepted):
    """A speculative step in x, its kept tokens as a plain step in y."""
    x.spec_step({rx: k for (rx, _), k in zip(pairs, drafts)},
                {rx: a for (rx, _), a in zip(pairs, accepted)})
    y.step({ry: a for (_, ry), a in zip(pairs, accepted)})


# ---- the twin ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [k if k in (1, 4, 7) else pytest.param(k, marks=pytest.mark.slow(
    reason="a draft count between the ends; k = 1, 4 and 7 stay")) for k in range(1, 8)])
def test_commit_equals_a_cache_fed_only_the_kept_tokens(k, impl):
    """2 + k requests verify k drafts a step, each keeping a different count
    of 0 .. 1 + k (rotating over three steps), from lengths that put their
    rows across the ring's wrap, CSA windows, the HCA window and the block
    at 128; one more request runs on a shared 128-token prefix."""
    if impl == "reference" and k != 7:
        pytest.skip("the reference runs the widest k, whose kept counts span 0 .. 8 (the CPU "
                    "handlers run every k; write_layer and copy_rows hold the two equal)")
    B = 2 + k
    cfg = dj.CacheConfig.tiny(max_requests=B + 2, max_context=512, num_blocks=4 * (B + 2))
    streams = {i: stream(cfg, 512, seed=10 * k + i) for i in range(B + 1)}
    x, y = drivers(cfg, streams, k, impl)
    pairs = [admit_both(x, y, i) for i in range(B)]
    step_both(x, y, pairs, [128] + [126 - 2 * i for i in range(B - 1)])
    with x.ctx():
        key = dj.share_prefix(x.state, x.manager, pairs[0][0])
        x.state, px = dj.admit_on_prefix(x.state, x.manager, key)
    with y.ctx():
        key = dj.share_prefix(y.state, y.manager, pairs[0][1])
        y.state, py = dj.admit_on_prefix(y.state, y.manager, key)
    x.source[px] = y.source[py] = B              # its own tokens after the prefix
    pairs.append((px, py))
    for step in range(3):
        accepted = [(i + step) % (B + 1) for i in range(B)] + [(step * 5) % (k + 2)]
        accepted = [min(a, k + 1) for a in accepted]
        spec_both(x, y, pairs, [k] * len(pairs), accepted)
        assert_same_cache(x, y, pairs, f"k={k} step {step}: ", reads=step == 2 and k == 3)
    assert x.manager.free_blocks == y.manager.free_blocks


def test_requests_with_fewer_drafts_than_the_bound(impl="cpu"):
    """drafts bounds the step; requests verify 0 .. drafts drafts each."""
    cfg = dj.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16)
    streams = {i: stream(cfg, 512, seed=40 + i) for i in range(4)}
    x, y = drivers(cfg, streams, 5, impl)
    pairs = [admit_both(x, y, i) for i in range(4)]
    step_both(x, y, pairs, [125, 3, 60, 128])
    for step, (drafts, accepted) in enumerate([([0, 2, 5, 1], [1, 3, 0, 2]),
                                               ([5, 0, 3, 4], [6, 0, 4, 5])]):
        spec_both(x, y, pairs, drafts, accepted)
        assert_same_cache(x, y, pairs, f"step {step}: ")


def test_sharded_commit_equals_the_sharded_twin():
    mesh = data_mesh(4)
    cfg = dj.CacheConfig.tiny(max_requests=8, max_context=512, num_blocks=32)
    streams = {i: stream(cfg, 512, seed=60 + i) for i in range(6)}
    x, y = drivers(cfg, streams, 3, "auto", mesh=mesh)
    pairs = [admit_both(x, y, i) for i in range(6)]
    step_both(x, y, pairs, [126, 127, 2, 60, 124, 7])
    for step in range(2):
        spec_both(x, y, pairs, [3] * 6, [(i + 2 * step) % 5 for i in range(6)])
        assert_same_cache(x, y, pairs, f"step {step}: ")


# ---- bad counts and counters ----------------------------------------------------------------------
# the rule is jnp shared by every implementation: the handlers' runs suffice
@pytest.mark.parametrize("impl", IMPLS[1:])
def test_bad_counts_are_counted_once_and_keep_nothing(impl):
    """A negative count, one above the slot's rows, and a slot with more rows
    than 1 + drafts: BAD_LENGTH once each, the slot as if it kept nothing; a
    count for a slot without rows is not read."""
    cfg = dj.CacheConfig.tiny(max_requests=6, max_context=512, num_blocks=24)
    streams = {i: stream(cfg, 512, seed=70 + i) for i in range(4)}
    x, y = drivers(cfg, streams, 2, impl)
    pairs = [admit_both(x, y, i) for i in range(4)]
    step_both(x, y, pairs, [126, 40, 127, 10])
    m = x.manager
    device = np.zeros(cfg.max_requests, np.int32)
    device[m.slot_of(pairs[0][0])] = -1
    device[m.slot_of(pairs[1][0])] = 4            # above its 3 verified rows
    device[m.slot_of(pairs[2][0])] = 2
    device[m.slot_of(pairs[3][0])] = 1            # 4 rows: more than 1 + 2
    free = [s for s in range(cfg.max_requests) if s not in [m.slot_of(r) for r, _ in pairs]]
    device[free[0]] = 99                          # no rows: not read
    kept = {pairs[0][0]: 0, pairs[1][0]: 0, pairs[2][0]: 2, pairs[3][0]: 0}
    x.spec_step({r: (3 if i == 3 else 2) for i, (r, _) in enumerate(pairs)}, kept,
                device_accepted=device)
    y.step({ry: kept[rx] for rx, ry in pairs})
    counts = dj.errors.error_counts(x.state)
    assert counts == {ErrorKind.BAD_LENGTH: 3}, counts
    errors = np.asarray(x.state.errors).copy()
    errors[int(ErrorKind.BAD_LENGTH)] = 0
    x.state = _with_errors(x.state, errors)
    assert_same_cache(x, y, pairs)


def _with_errors(state, errors):
    import dataclasses
    return dataclasses.replace(state, errors=jnp.asarray(errors, jnp.int32))


# counting is the ops' own (held equal across implementations by their tests)
@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=requires_cpu_ffi)])
def test_rejected_rows_leave_no_count_and_kept_rows_count_as_written(impl):
    """NaN in a rejected draft's rows counts nothing; in a kept row, what a
    plain step of the kept rows counts (append and flush: NONFINITE twice)."""
    cfg = dj.CacheConfig.tiny(max_requests=3, max_context=512, num_blocks=12)
    streams = {i: stream(cfg, 512, seed=80 + i) for i in range(2)}
    for i in range(2):                            # request 0 draft 3, request 1 row 1
        pos = 50 + 3 if i == 0 else 20 + 1
        for layer, x_ in streams[i].items():
            for name, v in x_.items():
                v[pos, 5] = np.nan
    x, y = drivers(cfg, streams, 3, impl)
    pairs = [admit_both(x, y, i) for i in range(2)]
    step_both(x, y, pairs, [50, 20])
    spec_both(x, y, pairs, [3, 3], [2, 3])       # request 0 rejects its row 3, request 1 keeps row 1
    counts = dj.errors.error_counts(x.state)
    assert counts and set(counts) == {ErrorKind.NONFINITE}, counts
    assert_same_cache(x, y, pairs)


# ---- the verify pass reads what a prefill chunk reads ----------------------------------------------
H, TOPK = 4, 8


def _queries(cfg, T, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(cfg.num_layers):
        out[layer] = dict(q=jnp.asarray(rng.normal(0, 1, (T, H, C.HEAD_DIM)), jnp.bfloat16),
                          iq=jnp.asarray(rng.normal(0, 1, (T, C.INDEX_HEADS, C.INDEX_DIM)),
                                         jnp.bfloat16),
                          w=jnp.asarray(rng.normal(0, 1, (T, C.INDEX_HEADS)), jnp.float32),
                          sink=jnp.asarray(rng.normal(0, 1, (H,)), jnp.float32))
    return out


def _reads(state, layer, token_slot, token_pos, chunk_kv, qs, impl):
    """indexer_topk (CSA) and attention with the rows as a chunk."""
    cfg = state.config
    kind = cfg.layer_kinds[layer]
    q = qs[layer]
    idx = None
    if kind == C.CSA:
        idx, state = dj.indexer_topk(state, layer, token_slot, token_pos, q["iq"], q["w"], TOPK,
                                     impl=impl)
    out, lse, state = dj.attention(state, layer, q["q"], token_slot, token_pos, sink=q["sink"],
                                   topk=idx, chunk_kv=chunk_kv, impl=impl)
    return state, (idx, out, lse)


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_reads_equal_a_prefill_chunk_of_the_same_tokens(impl):
    """Every draft's indexer picks and attention output (and lse) in the
    verify pass equal those of the same rows run as a prefill chunk:
    flush, indexer_topk, attention with chunk_kv, then append."""
    cfg = dj.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16)
    streams = {i: stream(cfg, 512, seed=90 + i) for i in range(3)}
    k = 6
    T = 32
    qs = _queries(cfg, T, 3)

    def read(state, layer, spec, x):
        m = spec.verified
        return _reads(state, layer, m.token_slot, m.token_pos, x["kv"], qs, impl)
    x, _ = drivers(cfg, streams, k, impl, read=read, min_tokens=T)
    chunk = Driver(cfg, dj.CacheManager(cfg), dj.init_state(cfg), streams, impl=impl,
                   min_tokens=T, pads=pads_of(cfg))
    pairs = [(x.admit(i), chunk.admit(i)) for i in range(3)]
    step_both(x, chunk, pairs, [126, 61, 200])

    def chunk_step(state, meta, inputs):
        from dsv4_jax.app.demo import compressor_operands
        state = dj.apply_step(state, meta, impl=impl)
        outs = {}
        for layer, kind in enumerate(cfg.layer_kinds):
            comp, extra = compressor_operands(kind, inputs[layer], chunk.params.get(layer))
            if comp:
                state = dj.flush(state, layer, meta, *comp, impl=impl, **extra)
            state, outs[layer] = _reads(state, layer, meta.token_slot, meta.token_pos,
                                        inputs[layer]["kv"], qs, impl)
            state = dj.append(state, layer, meta, inputs[layer]["kv"], impl=impl)
        return state, outs
    tokens = {ry: 1 + k for _, ry in pairs}
    before = {ry: chunk.manager.length_of(ry) for ry in tokens}
    meta = chunk.manager.prepare_step(tokens, min_tokens=T)
    _, want = jax.jit(chunk_step)(chunk.state, meta, chunk.inputs(meta, tokens, before))
    x.spec_step({rx: k for rx, _ in pairs}, {rx: 2 for rx, _ in pairs})
    got = x.outputs
    for layer in range(cfg.num_layers):
        for name, a, b in zip(("indexer picks", "attention out", "lse"), got[layer], want[layer]):
            if b is None:
                continue
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"layer {layer} {name}"
        if want[layer][0] is not None:               # the drafts do see entries they close
            assert (np.asarray(want[layer][0]) >= 0).sum() > 0


# ---- in place ------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=requires_cpu_ffi),
                                  pytest.param("cuda", marks=CUDA)])
def test_speculative_step_is_in_place(impl):
    """The whole step (apply_step, verify, commit, write_layer) aliases every
    pool and copies none (docs/design/in-place.md): the copy of verify_begin is
    ordered before the verify writes through the metadata it returns."""
    from dsv4_jax.app.workload import layer_params
    from support.workload import speculative_step, step_inputs
    from support.inplace import assert_in_place
    cfg = dj.CacheConfig.tiny(max_requests=2, max_context=256)
    params = layer_params(cfg, seed=2)
    manager = dj.CacheManager(cfg)
    a = manager.admit()
    step = jax.jit(lambda s, m, xs, acc: speculative_step(s, m, xs, acc, params, 3, impl)[0],
                   donate_argnums=0)
    state = dj.init_state(cfg)
    rng = np.random.default_rng(0)
    for kept in (2, 4):
        meta = manager.prepare_step({a: 4}, speculative=True)
        acc = jnp.zeros((cfg.max_requests,), jnp.int32).at[manager.slot_of(a)].set(kept)
        state = assert_in_place(step, state, meta, step_inputs(cfg, meta.num_tokens, rng), acc)
        manager.commit_speculative({a: kept})
    dj.check_errors(state)


# ---- accepted counts from draft matches ---------------------------------------------------------
def test_accepted_counts_from_draft_matches_and_back_to_request_ids():
    """accepted_counts on the device against a walk over each request's rows:
    its first row is kept, then its drafts up to the first mismatch, at most
    its verified rows (1 + drafts; a request with more rows keeps as many as
    verified, verify_commit counting the excess); padding rows and rows of
    requests without drafts read nothing. accepted_of maps the counts back to
    the request ids commit_speculative takes."""
    cfg = dj.CacheConfig.tiny(max_requests=6, max_context=512, num_blocks=24)
    m = dj.CacheManager(cfg)
    ids = [m.admit(name) for name in ("a", "b", "c", "d", "e")]
    state = dj.init_state(cfg)
    m.prepare_step({r: 40 + 7 * i for i, r in enumerate(ids)})
    rng = np.random.default_rng(3)
    drafts = 4
    begin = jax.jit(lambda st, meta: dj.verify_begin(dj.apply_step(st, meta), meta, drafts=drafts))
    count = jax.jit(dj.accepted_counts)
    for trial in range(6):
        tokens = {r: int(rng.integers(0, 1 + drafts + (r == "e"))) for r in ids}
        meta = m.prepare_step(tokens, min_tokens=32, min_new_blocks=8, min_resets=8,
                              speculative=True)
        spec = begin(state, meta)
        ok = rng.random(meta.num_tokens) < 0.7
        got = np.asarray(count(spec, jnp.asarray(ok)))
        want = np.zeros(cfg.max_requests, np.int32)
        for r, n in tokens.items():
            rows = range(m.token_rows(r).start, m.token_rows(r).stop)
            kept = 0
            for j, row in enumerate(list(rows)[:1 + drafts]):
                if j > 0 and not ok[row]:
                    break
                kept += 1
            want[m.slot_of(r)] = kept
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}: {tokens}")
        by_request = m.accepted_of(got)
        assert by_request == {r: int(want[m.slot_of(r)]) for r, n in tokens.items() if n}
        m.commit_speculative({r: min(a, tokens[r]) for r, a in by_request.items()})
