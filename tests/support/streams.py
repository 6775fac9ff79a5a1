"""Requests as token streams: each request's projections are fixed per
position (drawn once from a seed), so the same request can be run through
different caches, slots, blocks and schedules and must leave the same bytes.

`Driver` runs steps {request: new tokens} through a manager (plain or
sharded) and a jitted, donated write step (apply_step, then append + flush on
every layer), and reads a request back (snapshot, blocks, every gather,
indexer_topk) for byte comparisons.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.app.workload import layer_params
from support.workload import write_step



def stream(cfg, length: int, seed: int) -> dict:
    """Per layer the projections of positions [0, length): never zeros."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        x = {"kv": rng.normal(0, 2, (length, C.HEAD_DIM)).astype(jnp.bfloat16)}
        if kind != C.SWA:
            w = (2 if kind == C.CSA else 1) * C.HEAD_DIM
            x["ckv"] = rng.normal(0, 1.5, (length, w)).astype(np.float32)
            x["score"] = rng.normal(0, 2, (length, w)).astype(np.float32)
        if kind == C.CSA:
            x["ikv"] = rng.normal(0, 1.5, (length, 2 * C.INDEX_DIM)).astype(np.float32)
            x["iscore"] = rng.normal(0, 2, (length, 2 * C.INDEX_DIM)).astype(np.float32)
        out[layer] = x
    return out


class Driver:
    """One cache (state + manager) fed from token streams."""

    def __init__(self, cfg, manager, state, streams: dict, *, mesh=None, impl="auto",
                 min_tokens=256, seed=0, pads=None):
        self.cfg, self.manager, self.state = cfg, manager, state
        self.streams = streams               # stream name -> stream
        self.source = {}                     # request id -> stream name
        self.mesh, self.impl, self.min_tokens = mesh, impl, min_tokens
        self.pads = pads or {}               # more prepare_step minimums (fewer shapes)
        self.params = layer_params(cfg, seed=seed)
        self._step = jax.jit(lambda s, m, x: write_step(s, m, x, self.params, impl),
                             donate_argnums=0)

    def ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def admit(self, name, rid=None, **kw):
        rid = self.manager.admit(rid, **kw)
        self.source[rid] = name
        return rid

    def step(self, tokens: dict):
        """One step appending tokens[r] positions of each request's stream."""
        m = self.manager
        before = {r: m.length_of(r) for r in tokens}
        with self.ctx():
            meta = m.prepare_step(tokens, min_tokens=self.min_tokens, **self.pads)
            self.state = self._step(self.state, meta, self.inputs(meta, tokens, before))

    def inputs(self, meta, tokens: dict, before: dict) -> dict:
        """Per layer the projections of the step's rows: request r's rows
        hold positions before[r] ... before[r] + tokens[r] - 1 of its
        stream, padding rows zeros."""
        T = meta.token_slot.shape[0]
        inputs = {}
        for layer, kind in enumerate(self.cfg.layer_kinds):
            first = self.streams[next(iter(self.streams))][layer]
            x = {k: np.zeros((T,) + v.shape[1:], v.dtype) for k, v in first.items()}
            for r, n in tokens.items():
                rows = self.manager.token_rows(r)
                src = self.streams[self.source[r]][layer]
                for k in x:
                    x[k][rows] = src[k][before[r]:before[r] + n]
            inputs[layer] = {k: jnp.asarray(v) for k, v in x.items()}
        return inputs

    def read(self, rid, seed=0):
        """Everything the cache holds or returns for request `rid`: its
        snapshot, its blocks in logical order, every layer's gathers for it
        and indexer_topk of random queries at its current length."""
        m, cfg = self.manager, self.cfg
        state = self.state
        with self.ctx():
            snap = dj.snapshot(state, m.global_slot(rid))
            blocks = dj.read_blocks(state, list(m.global_blocks(rid)))
            out = {"snapshot": snap, "blocks": blocks}
            length = m.length_of(rid)
            rng = np.random.default_rng(seed)
            S = cfg.num_shards
            shard = m.shard_of(rid) if S > 1 else 0
            local_slot = m.slot_of(rid)

            def rows(values, dtype, fill):
                """Per-request operand of one row on the request's shard
                (padding rows on the others)."""
                a = np.full((S,) + np.shape(values), fill, dtype)
                a[shard] = values
                return jnp.asarray(a)
            slots = rows(local_slot, np.int32, -1)
            lengths = rows(length, np.int32, 0)
            pos = rows(length - 1, np.int32, 0)
            visible = length // C.CSA_RATIO
            # one query, the same on every shard's row: reads on any shard compare
            idx = np.repeat(rng.integers(-1, max(visible, 1), (1, 8)).astype(np.int32), S, 0)
            q = jnp.asarray(np.repeat(rng.normal(0, 1, (1, C.INDEX_HEADS, C.INDEX_DIM)), S, 0),
                            jnp.bfloat16)
            w = jnp.asarray(np.repeat(rng.normal(0, 1, (1, C.INDEX_HEADS)), S, 0), jnp.float32)
            for layer, kind in enumerate(cfg.layer_kinds):
                out[f"window{layer}"] = dj.gather_window(state, layer, slots, impl=self.impl,
                                                         return_state=False)
                if kind == C.CSA:
                    out[f"topk{layer}"] = dj.gather_topk(state, layer, slots, pos,
                                                         jnp.asarray(idx), impl=self.impl,
                                                         return_state=False)
                    out[f"indexer{layer}"] = dj.indexer_topk(state, layer, slots, pos, q, w, 8,
                                                             impl=self.impl, return_state=False)
                elif kind == C.HCA:
                    out[f"all{layer}"] = dj.gather_all(state, layer, slots, lengths,
                                                       cfg.max_blocks_per_request,
                                                       impl=self.impl, return_state=False)
        # the request's own row of the per-request outputs (one row a shard)
        own = lambda x: np.asarray(x)[shard:shard + 1]
        return {k: jax.tree_util.tree_map(np.asarray if k in ("snapshot", "blocks") else own, v)
                for k, v in out.items()}


def assert_same_request(got: dict, want: dict, what=""):
    """Byte-identical reads of one request (snapshot, blocks, gathers, top-k)."""
    from support.trees import assert_trees_bytes_equal
    assert got.keys() == want.keys()
    for k in want:
        assert_trees_bytes_equal(got[k], want[k], f"{what}{k}")
