"""A multi-step workload of every op on a sharded cache, run the same way by
one process driving every shard (ShardedCacheManager) and by each process of
a jax.distributed run driving its own shards (ProcessCacheManager), so the
two runs' shards can be compared byte for byte (tests/properties/
test_multiprocess.py; the processes run tests/support/multiprocess_worker.py).

Every input is drawn in its global shape from one seed, in both runs, and
each run hands the ops only the rows of the shards it drives. The schedule
pins every request to a shard, so both runs place it alike.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.errors import shard_error_counts
from dsv4_jax.multiprocess import ProcessCacheManager
from dsv4_jax.sharding import ShardedCacheManager, init_sharded_state, shard_config, state_specs
from dsv4_jax.app.workload import layer_params
from support.workload import step_inputs

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
K = 8            # indexer_topk's k
BAD_STEP = 3     # the step whose inputs hold bad rows on the last shard


def config(mesh):
    """tiny (SWA, CSA, HCA, CSA): 2 requests and 8 blocks a shard."""
    S = mesh.shape["data"]
    return shard_config(dj.CacheConfig.tiny(max_requests=2 * S, num_blocks=8 * S), mesh, "data")


@dataclasses.dataclass
class Step:
    admit: list      # (request id, shard)
    release: list    # request ids
    tokens: dict     # request id -> new tokens


def schedule(S, seed=11):
    """Prefill chunks of 60..199 tokens, a release and an admission that
    reuses the freed blocks, then single-token decode steps."""
    rng = np.random.default_rng(seed)
    shard = {r: r % S for r in range(S + 2)}          # S + 2 requests over S shards
    live, steps = [], []
    for i in range(5):
        admit = [(r, shard[r]) for r in range(S + 1)] if i == 0 else \
            [(S + 1, shard[S + 1])] if i == 2 else []
        release = [1] if i == 2 else []
        live = [r for r in live + [a for a, _ in admit] if r not in release]
        tokens = {r: int(rng.integers(60, 200)) if i < 2 or r == S + 1 else 1 for r in live}
        steps.append(Step(admit, release, tokens))
    return steps, shard


class SingleHost:
    """One process, every shard: global operands as they are."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.manager = ShardedCacheManager(cfg)
        self.shards = tuple(range(cfg.num_shards))

    def shard_manager(self, k):
        return self.manager.shards[k]

    def put(self, tree):
        return jax.tree_util.tree_map(jnp.asarray, tree)

    def rows(self, x):
        """{shard: its rows of an output}"""
        x = np.asarray(x)
        return dict(zip(self.shards, np.split(x, len(self.shards))))


class ProcessHost:
    """This process's shards: operands from this process's rows only."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.manager = ProcessCacheManager(cfg, mesh)
        self.shards = self.manager.shards

    def shard_manager(self, k):
        return self.manager.managers[k]

    def put(self, tree):
        S = self.cfg.num_shards

        def mine(x):
            x = np.asarray(x)
            parts = np.split(x, S)
            return np.concatenate([parts[k] for k in self.shards])
        return self.manager.put_rows(jax.tree_util.tree_map(mine, tree))

    def rows(self, x):
        return dict(zip(self.shards, np.split(self.manager.local_rows(x), len(self.shards))))


def make_step(cfg, params):
    """One jitted step, the state donated: apply_step; per layer append +
    flush (even layers) or write_layer (odd layers); gather_window; on CSA
    layers indexer_topk feeding gather_topk, on HCA layers gather_all."""
    def step(state, meta, x, q):
        state = dj.apply_step(state, meta)
        out = {}
        for layer, kind in enumerate(cfg.layer_kinds):
            xi = x[layer]
            comp = (xi["ckv"], xi["score"], params[layer]) if kind != C.SWA else ()
            index = {"index_kv": xi["ikv"], "index_score": xi["iscore"]} if kind == C.CSA else {}
            if layer % 2:
                state = dj.write_layer(state, layer, meta, xi["kv"], *comp, **index)
            else:
                state = dj.append(state, layer, meta, xi["kv"])
                if comp:
                    state = dj.flush(state, layer, meta, *comp, **index)
            w, pos, state = dj.gather_window(state, layer, q["slots"])
            out[f"window{layer}"] = (w, pos)
            if kind == C.CSA:
                idx, state = dj.indexer_topk(state, layer, q["token_slot"], q["token_pos"],
                                             q["iq"], q["iw"], K)
                e, valid, state = dj.gather_topk(state, layer, q["token_slot"], q["token_pos"],
                                                 idx)
                out[f"topk{layer}"] = (idx, e, valid)
            elif kind == C.HCA:
                e, count, state = dj.gather_all(state, layer, q["slots"], q["lengths"],
                                                cfg.max_blocks_per_request)
                out[f"all{layer}"] = (e, count)
        return state, out
    return jax.jit(step, donate_argnums=0)


def shard_states(state, cfg, shards):
    """{shard: [(leaf path, its bytes)]} of the given shards, from the
    addressable pieces of every state leaf."""
    specs = jax.tree_util.tree_leaves(state_specs(cfg))
    out = {k: [] for k in shards}
    for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(state), specs):
        axis = 0 if spec[0] == "data" else 1
        size = x.shape[axis] // cfg.num_shards
        seen = set()
        for piece in x.addressable_shards:
            k = (piece.index[axis].start or 0) // size
            if k in out and k not in seen:
                seen.add(k)
                out[k].append((jax.tree_util.keystr(path), _bytes(piece.data)))
    return out


def _bytes(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(-1)


def run(host, *, checks=None, seed=5):
    """The workload on `host`; returns ({"<shard>/<name>": bytes} of the
    state and every step's outputs for the host's shards, info) where info
    holds the compiled step's collectives, whether it kept the state in
    place, and the error counters this process reads per shard.
    `checks(host, state, step_fn, meta, x, q, i)` runs before step i's call
    (the bad-routing checks of a multi-process run)."""
    from support.inplace import assert_in_place, compiled_text
    cfg, mesh = host.cfg, host.mesh
    S = cfg.num_shards
    R = cfg.local().max_requests
    params = layer_params(cfg, seed=3)
    fn = make_step(cfg, params)
    steps, shard_of = schedule(S)
    rng = np.random.default_rng(seed)
    state = init_sharded_state(cfg, mesh)
    saved, info = {}, {}
    for i, plan in enumerate(steps):
        for rid, k in plan.admit:
            if k in host.shards:
                host.manager.admit(rid, shard=k)
        for rid in plan.release:
            if shard_of[rid] in host.shards:
                host.manager.release(rid)
        meta = host.manager.prepare_step({r: n for r, n in plan.tokens.items()
                                          if shard_of[r] in host.shards})
        T = host.manager.tokens_per_shard
        x = jax.tree_util.tree_map(np.array, step_inputs(cfg, S * T, rng))
        slots = np.full((S, R), -1, np.int32)
        lengths = np.zeros((S, R), np.int32)
        for k in host.shards:
            m = host.shard_manager(k)
            slots[k, :len(m.requests)] = [m.slot_of(r) for r in m.requests]
            lengths[k, :len(m.requests)] = [m.length_of(r) for r in m.requests]
        token_slot = np.full((S, T), -1, np.int32)
        token_pos = np.zeros((S, T), np.int32)
        for k in host.shards:
            local = host.rows(meta.data)[k]
            token_slot[k], token_pos[k] = local[:T], local[T:2 * T]
        q = {"slots": slots.reshape(-1), "lengths": lengths.reshape(-1),
             "token_slot": token_slot.reshape(-1), "token_pos": token_pos.reshape(-1),
             "iq": rng.normal(0, 1, (S * T, C.INDEX_HEADS, C.INDEX_DIM)).astype(jnp.bfloat16),
             "iw": rng.normal(0, 1, (S * T, C.INDEX_HEADS)).astype(np.float32)}
        if i == BAD_STEP and S - 1 in host.shards:   # bad rows on the last shard only
            m = host.shard_manager(S - 1)
            row = (S - 1) * T + m.token_rows(m.requests[0]).start
            x[0]["kv"][row] = np.nan                   # NONFINITE, in append of layer 0
            q["slots"][(S - 1) * R + R - 1] = 99       # BAD_SLOT, in every gather_window
        x, q = host.put(x), host.put(q)
        if checks:
            checks(host, state, fn, meta, x, q, i)
        with jax.set_mesh(mesh):
            if i == 0:
                hlo = compiled_text(fn, state, meta, x, q)
                info["collectives"] = [c for c in COLLECTIVES if c in hlo]
                state, out = assert_in_place(fn, state, meta, x, q)   # runs the step
            else:
                state, out = fn(state, meta, x, q)
        for name, leaf in jax.tree_util.tree_leaves_with_path(out):
            for k, rows in host.rows(leaf).items():
                saved[f"{k}/step{i}{jax.tree_util.keystr(name)}"] = _bytes(rows)
    for k, leaves in shard_states(state, cfg, host.shards).items():
        for path, b in leaves:
            saved[f"{k}/state{path}"] = b
    info["errors"] = {str(k): [p, {kind.name: n for kind, n in counts.items()}]
                      for k, (p, counts) in shard_error_counts(state).items()}
    try:
        dj.check_errors(state)
        info["check_errors"] = None
    except dj.CacheInputError as e:
        info["check_errors"] = str(e)
    return saved, info
