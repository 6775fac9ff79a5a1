"""snapshot / restore / read_blocks / write_blocks (dsv4_jax/requests/transfer.py)
on a state of random bytes: exact copies of the slot's and the blocks' bytes,
nothing else touched, in place; bad input raises before anything changes."""
import copy
import re

import jax
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax.requests import transfer as rs
from dsv4_jax.sharding import init_sharded_state, shard_config, state_sharding
from support.inplace import assert_in_place
from support.marks import CUDA, cpu_target_built, requires_cpu_ffi
from support.sharding import data_mesh
from support.trees import as_bytes, assert_trees_bytes_equal, poison

CFG = dj.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=12)


def random_state(cfg=CFG, seed=0):
    return poison(dj.init_state(cfg), seed)


def host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def slot_leaves(st):
    return (st.swa, st.csa.comp, st.csa.icomp, st.hca.comp)


def pools(st):
    return (st.csa.kv, st.csa.index, st.hca.kv)


def assert_snapshot_of(snap, before, slot):
    """`snap` holds the bytes of `slot` in the state `before` (numpy)."""
    for got, full in zip(jax.tree_util.tree_leaves((snap.window, snap.csa_comp, snap.csa_icomp,
                                                    snap.hca_comp)),
                         jax.tree_util.tree_leaves(slot_leaves(before))):
        assert np.array_equal(as_bytes(got), as_bytes(np.ascontiguousarray(full[:, slot])))
    assert int(snap.length) == int(before.swa.pos[:, slot].max()) + 1


def assert_blocks_of(data, before, blocks):
    """`data` holds the bytes of `blocks` in `before`, zero bytes for -1."""
    for got, full in zip(jax.tree_util.tree_leaves(data), jax.tree_util.tree_leaves(pools(before))):
        shape = (full.shape[0], len(blocks)) + full.shape[2:]
        want = np.zeros(int(np.prod(shape)) * full.dtype.itemsize, np.uint8).view(full.dtype)
        want = want.reshape(shape)
        for j, b in enumerate(blocks):
            if b >= 0:
                want[:, j] = full[:, b]
        assert np.array_equal(as_bytes(got), as_bytes(want))


def assert_moved(after, before, slots=(2, 0), row=(5, 9, 1), blocks=((7, 10), (3, 4))):
    """`after` is `before` with slot `slots[0]` restored into `slots[1]` with
    block-table row `row` and the blocks (from, to) of `blocks` copied; every
    other byte the same."""
    src, dst = slots
    for a, b in zip(jax.tree_util.tree_leaves(slot_leaves(after)),
                    jax.tree_util.tree_leaves(slot_leaves(before))):
        want = b.copy()
        want[:, dst] = b[:, src]
        assert np.array_equal(as_bytes(a), as_bytes(want))
    want_table = before.block_table.copy()
    want_table[dst] = -1
    want_table[dst, :len(row)] = row
    assert np.array_equal(after.block_table, want_table)
    for a, b in zip(jax.tree_util.tree_leaves(pools(after)), jax.tree_util.tree_leaves(pools(before))):
        want = b.copy()
        for f, t in blocks:
            want[:, t] = b[:, f]
        assert np.array_equal(as_bytes(a), as_bytes(want))
    assert np.array_equal(after.errors, before.errors)


@pytest.mark.parametrize("kv_format", ["ds_fp8", "fp8_token", "bf16"])
def test_snapshot_restore_and_blocks_copy_exact_bytes_and_touch_nothing_else(kv_format,
                                                                             impl_under_test):
    # every implementation of copy_rows: the jnp reference, its CPU handler
    # and its CUDA kernel (`-m gpu`)
    cfg = CFG.replace(kv_format=kv_format)
    st = random_state(cfg)
    before = host(st)
    snap = dj.snapshot(st, 2)
    assert_snapshot_of(snap, before, 2)
    data = dj.read_blocks(st, [7, -1, 3])
    assert_blocks_of(data, before, [7, -1, 3])
    st = dj.restore(st, 0, snap, block_row=[5, 9, 1])
    st = dj.write_blocks(st, [10, -1, 4], data)
    assert_moved(host(st), before)


@pytest.mark.parametrize("kv_format", ["ds_fp8", "fp8_token", "bf16"])
def test_moves_by_resident_ids_copy_exact_bytes_and_touch_nothing_else(kv_format,
                                                                       impl_under_test):
    # read_request / write_request (one program each) and the four moves
    # given RequestIds made once: the same bytes as numpy's rows
    cfg = CFG.replace(kv_format=kv_format)
    st = random_state(cfg, seed=3)
    before = host(st)
    here = dj.request_ids(st, 2, [7, -1, 3])
    there = dj.request_ids(st, 0, [10, -1, 4], block_row=[5, 9, 1])
    snap, data = dj.read_request(st, here)
    assert_snapshot_of(snap, before, 2)
    assert_blocks_of(data, before, [7, -1, 3])
    assert_snapshot_of(dj.snapshot(st, here), before, 2)
    assert_blocks_of(dj.read_blocks(st, here), before, [7, -1, 3])
    assert_moved(host(dj.write_request(st, there, snap, data)), before)
    st = random_state(cfg, seed=3)
    st = dj.write_blocks(dj.restore(st, there, snap), there, data)
    assert_moved(host(st), before)


def test_sharded_moves_copy_exact_bytes_across_shards(impl_under_test):
    # sharded over 2 devices each move is the copy op on every shard with
    # shard-local ids: slot 3 (shard 1) restored into slot 0 (shard 0),
    # blocks 7 (shard 1) and 3 (shard 0) read in one call and written to 4
    # (shard 0) and 10 (shard 1); every other byte as it was
    mesh = data_mesh(2)
    cfg = shard_config(CFG, mesh, "data")
    st = jax.device_put(poison(init_sharded_state(cfg, mesh), 5), state_sharding(cfg, mesh))
    before = host(st)
    with jax.set_mesh(mesh):
        snap, data = dj.read_request(st, dj.request_ids(st, 3, [7, -1, 3]))
        assert_snapshot_of(snap, before, 3)
        assert_blocks_of(data, before, [7, -1, 3])
        st = dj.write_request(st, dj.request_ids(st, 0, [4, -1, 10], block_row=[5, 0]),
                              snap, data)
    assert_moved(host(st), before, slots=(3, 0), row=(5, 0), blocks=((7, 4), (3, 10)))


def test_pinned_host_placement_and_back():
    st = random_state()
    snap = dj.snapshot(st, 1, memory_kind="pinned_host")
    data = dj.read_blocks(st, [2, 3], memory_kind="pinned_host")
    for x in jax.tree_util.tree_leaves((snap, data)):
        assert x.sharding.memory_kind == "pinned_host"
    want_snap, want_data = dj.snapshot(st, 1), dj.read_blocks(st, [2, 3])
    assert_trees_bytes_equal(snap, want_snap)
    assert_trees_bytes_equal(data, want_data)
    st = dj.write_blocks(dj.restore(st, 3, snap), [8, 9], data)   # host copies go back
    assert_trees_bytes_equal(dj.snapshot(st, 3), want_snap)
    assert_trees_bytes_equal(dj.read_blocks(st, [8, 9]), want_data)


def test_writes_run_in_place(impl_under_test):
    # every write program (jnp scatters, or one put_rows call) aliases each
    # state leaf and copies none
    st = random_state()
    snap, data = dj.snapshot(st, 1), dj.read_blocks(st, [2, 3])
    where = dj.request_ids(st, 0, [5, 6], [5, 6])
    for kind, args in (("restore", (snap,)), ("write_blocks", (data,)),
                       ("write_request", (snap, data))):
        st = assert_in_place(rs._program(kind, CFG, None), st, where, *args)


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=[requires_cpu_ffi,
                                                              cpu_target_built("dsv4_put_rows")]),
                                  pytest.param("cuda", marks=CUDA)])
def test_fused_moves_compile_to_one_copy_call_and_nothing_else(impl):
    # through copy_rows' handlers, each move's program is its one FFI call:
    # no fusion, copy or transfer around it (the leaves go in and out as they
    # are, the put aliased); a snapshot has no leaf the call does not fill
    st = random_state()
    here = dj.request_ids(st, 1, [2, 3])
    there = dj.request_ids(st, 0, [5, 6], [5, 6])
    jax.clear_caches()
    with dj.default_impl(impl):
        snap, data = dj.read_request(st, here)
        for kind, args in (("snapshot", (here,)), ("read_blocks", (here,)),
                           ("read_request", (here,)), ("restore", (there, snap)),
                           ("write_blocks", (there, data)), ("write_request", (there, snap, data))):
            out = rs._replicated(st, None) if kind in rs.READS else None
            hlo = rs._program(kind, CFG, out).lower(st, *args).compile().as_text()
            # every computation of the module (a backend may wrap the call in
            # one of its own, a command buffer)
            ops = re.findall(r"\s([a-z][a-z\-]*)\(", hlo)
            work = [op for op in ops if op not in ("parameter", "get-tuple-element", "tuple",
                                                   "bitcast", "call")]
            assert work == ["custom-call"], (kind, work)
            assert ("input_output_alias" in hlo.split("\n", 1)[0]) == (kind not in rs.READS)
    jax.clear_caches()


def test_inside_a_jitted_step():
    st = random_state()
    want = host(dj.restore(random_state(), 2, dj.snapshot(random_state(), 0)))
    step = jax.jit(lambda s: dj.restore(s, 2, dj.snapshot(s, 0)), donate_argnums=0)
    assert_trees_bytes_equal(host(step(st)), want)


def test_bad_input_raises_and_changes_nothing():
    st = random_state()
    before = host(st)
    snap = dj.snapshot(st, 0)
    for bad in (4, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 4\)"):
            dj.snapshot(st, bad)
        with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 4\)"):
            dj.restore(st, bad, snap)
    other = dj.snapshot(dj.init_state(CFG.replace(kv_format="bf16")), 0)
    with pytest.raises(ValueError, match="snapshot: taken from a cache of another layout"):
        dj.restore(st, 1, other)
    flash = dj.snapshot(dj.init_state(dj.CacheConfig((0, 4), 1, 1, 1)), 0)
    with pytest.raises(ValueError, match="another layout .* 2 layers"):
        dj.restore(st, 1, flash)
    with pytest.raises(ValueError, match="block_row: expected block ids in"):
        dj.restore(st, 1, snap, block_row=[12])
    with pytest.raises(ValueError, match="block_row: expected at most 4"):
        dj.restore(st, 1, snap, block_row=[0] * 5)
    with pytest.raises(ValueError, match=r"blocks: expected ids in \[0, 12\)"):
        dj.read_blocks(st, [12])
    data = dj.read_blocks(st, [1, 2])
    with pytest.raises(ValueError, match="blocks: ids must be distinct"):
        dj.write_blocks(st, [3, 3], data)
    with pytest.raises(ValueError, match=r"data.csa_kv.nope: expected float8_e4m3fn\[2, 3,"):
        dj.write_blocks(st, [3, 4, 5], data)
    # RequestIds: checked when made, and against the cache a move is given
    with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 4\)"):
        dj.request_ids(st, 4, [1])
    with pytest.raises(ValueError, match=r"blocks: expected ids in \[0, 12\)"):
        dj.request_ids(st, 1, [12])
    with pytest.raises(ValueError, match="blocks: ids must be distinct"):
        dj.request_ids(st, 1, [3, 3])
    with pytest.raises(ValueError, match="block_row: expected at most 4"):
        dj.request_ids(st, 1, [3], [0] * 5)
    blocks_only = dj.request_ids(st, None, [1, 2])
    with pytest.raises(ValueError, match="slot: this RequestIds was made without a slot"):
        dj.snapshot(st, blocks_only)
    with pytest.raises(ValueError, match="slot: this RequestIds was made without a slot"):
        dj.write_request(st, blocks_only, snap, data)
    where = dj.request_ids(st, 1, [1, 2])
    with pytest.raises(ValueError, match="block_row: a RequestIds carries its block-table row"):
        dj.restore(st, where, snap, block_row=[1])
    with pytest.raises(ValueError, match="where: expected a RequestIds"):
        dj.read_request(st, 1)
    with pytest.raises(ValueError, match=r"data.csa_kv.nope: expected float8_e4m3fn\[2, 1,"):
        dj.write_request(st, dj.request_ids(st, 1, [5]), snap, data)
    bigger = dj.request_ids(dj.init_state(CFG.replace(max_requests=8)), 6, [1])
    with pytest.raises(ValueError, match=r"where: made for a cache of \(R, N, MB\) = \(8, 12, 4\)"):
        dj.snapshot(st, bigger)
    with pytest.raises(ValueError, match=r"where: made for a cache of"):
        dj.write_blocks(st, bigger, dj.read_blocks(st, [1]))
    assert_trees_bytes_equal(host(st), before)      # nothing was donated or written


def manager_state(m):
    return (list(m._free_slots), list(m._free_blocks), dict(m._refs),
            {k: copy.deepcopy(v) for k, v in m._requests.items()}, list(m._pending_resets),
            {k: (p.tokens, p.blocks) for k, p in m._prefixes.items()})


def test_moves_with_bad_input_leave_manager_and_state_unchanged():
    m = dj.CacheManager(CFG)
    st = dj.init_state(CFG)
    a, b = m.admit("a"), m.admit("b")
    m.prepare_step({a: 256, b: 100})
    key = m.cache_prefix(a, dj.snapshot(st, m.slot_of(a)))
    parked = dj.offload(st, m, b)
    before, state_before = manager_state(m), host(st)

    def unchanged():
        assert manager_state(m) == before
        assert_trees_bytes_equal(host(st), state_before)

    with pytest.raises(KeyError, match="no cached prefix 'nope'"):
        dj.admit_on_prefix(st, m, "nope")
    with pytest.raises(KeyError, match="request 'ghost' is not admitted"):
        dj.share_prefix(st, m, "ghost")
    with pytest.raises(ValueError, match="holds 100 tokens: a prefix is a positive multiple"):
        dj.share_prefix(st, m, b)
    with pytest.raises(ValueError, match="a prefix of 384 tokens is longer than request 'a'"):
        m.cache_prefix(a, dj.snapshot(st, 0), tokens=384)
    with pytest.raises(ValueError, match="tokens: expected a positive multiple of 128"):
        m.cache_prefix(a, dj.snapshot(st, 0), tokens=100)
    with pytest.raises(ValueError, match="another layout"):
        m.cache_prefix(a, dj.snapshot(dj.init_state(CFG.replace(kv_format="bf16")), 0))
    occupied = m.slot_of(a)
    with pytest.raises(ValueError, match=f"slot: {occupied} is occupied by request 'a'"):
        dj.admit_on_prefix(st, m, key, slot=occupied)
    with pytest.raises(ValueError, match=f"slot: {occupied} is occupied by request 'a'"):
        dj.resume(st, m, parked, slot=occupied)
    with pytest.raises(ValueError, match="request_id: 'a' is already admitted"):
        dj.resume(st, m, parked, "a")
    other = dj.init_state(CFG.replace(kv_format="bf16"))
    bad = dj.OffloadedRequest(dj.snapshot(other, 0), parked.blocks, parked.num_blocks,
                              parked.length)
    with pytest.raises(ValueError, match="snapshot: taken from a cache of another layout"):
        dj.resume(st, m, bad)
    with pytest.raises(ValueError, match="parked: holds 1 of 1 blocks for 200 tokens, expected 2"):
        dj.resume(st, m, dj.OffloadedRequest(parked.snapshot, parked.blocks, 1, 200))
    arrays = dj.export_request(st, m, b)
    with pytest.raises(ValueError, match="exported from a cache of another layout"):
        dj.import_request(other, dj.CacheManager(CFG.replace(kv_format="bf16")),
                          {**arrays, "kv_format": np.asarray("ds_fp8"),
                           "compress_ratios": np.asarray([0, 4], np.int32)})
    with pytest.raises(ValueError, match=r"arrays\['snapshot.window.pos'\]: expected int32"):
        dj.import_request(st, m, {**arrays, "snapshot.window.pos": arrays["snapshot.window.pos"][:1]})
    unchanged()
    full = dj.CacheManager(CFG)
    for r in range(3):
        full.admit(r)
        full.prepare_step({r: 512 - 128 * (r == 2) * 2})   # 4 + 4 + 2 blocks
    was = manager_state(full)
    with pytest.raises(dj.CacheFullError, match="request of 512 tokens needs 4 blocks, only 2 of 12"):
        full.admit_restored(512)
    assert manager_state(full) == was


def test_resume_gives_a_preempted_request_its_id_back():
    """An engine keys its requests by id: resume brings a preempted request
    back under the id it left with (an int or any hashable), even when
    others were admitted meanwhile; a copy `offload` took of a request that
    stays admitted comes back as a new request; `request_id` overrides. The
    cache it comes back with is the one it left (its snapshot and blocks)."""
    cfg = CFG.replace(max_requests=6)
    m = dj.CacheManager(cfg)
    first, second, named = m.admit(), m.admit(), m.admit("req-a")
    state = jax.jit(dj.apply_step, donate_argnums=0)(
        random_state(cfg), m.prepare_step({first: 100, second: 200, named: 50}))
    want = host(dj.snapshot(state, m.slot_of(second)))
    parked = dj.preempt(state, m, second)
    newcomer = m.admit()                      # takes second's slot
    assert newcomer not in (first, second)
    state, rid = dj.resume(state, m, parked)
    assert rid == second and m.length_of(second) == 200
    assert_trees_bytes_equal(host(dj.snapshot(state, m.slot_of(second))), want)
    state, rid = dj.resume(state, m, dj.preempt(state, m, named))
    assert rid == "req-a" and m.length_of("req-a") == 50
    state, copy_id = dj.resume(state, m, dj.offload(state, m, first))
    assert copy_id not in (first, second, newcomer, "req-a") and first in m.requests
    state, rid = dj.resume(state, m, dj.preempt(state, m, second), "renamed")
    assert rid == "renamed" and second not in m.requests
