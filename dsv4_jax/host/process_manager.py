"""The sharded cache across processes (docs/design/sharding.md, "Across processes").

Under `jax.distributed` every process drives its own devices; the mesh spans
the devices of every process and the state is a set of global arrays whose
shards live on their owners' devices (`init_sharded_state` makes it so, on
every process). The ops are the same and the jitted step is the same: each
shard still runs alone, so the step has no collectives. What changes is the
host side: a process holds the tables of its own shards only.

    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    cfg = shard_config(CacheConfig.flash(max_requests=128), mesh, "data")
    state = init_sharded_state(cfg, mesh)
    manager = ProcessCacheManager(cfg, mesh)      # this process's shards
    rid = manager.admit()                           # on one of them
    with jax.set_mesh(mesh):
        meta = manager.prepare_step({rid: 1})       # every process, every step
        state, out = step(state, meta, manager.put_rows(kv), ...)
    mine = manager.local_rows(out)                  # this process's rows

Per-token (and per-request) operands are built by each process from its own
data: the rows of its shards, shard after shard in shard order
(`manager.shards`); `put_rows` makes the global array of them and
`local_rows` reads this process's rows of an output back.
"""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..config import CacheConfig
from ..meta import StepMeta, bucket
from .manager import CacheFullError, CacheManager


def shard_processes(mesh: jax.sharding.Mesh, axis: str) -> list[int]:
    """The process that holds each shard of mesh axis `axis` (ValueError if
    a shard's devices belong to several processes: a shard's tables live in
    one process)."""
    devices = np.moveaxis(mesh.devices, tuple(mesh.axis_names).index(axis), 0)
    owners = []
    for k, row in enumerate(devices.reshape(devices.shape[0], -1)):
        processes = sorted({d.process_index for d in row})
        if len(processes) != 1:
            raise ValueError(f"mesh: the devices of shard {k} on axis {axis!r} belong to "
                             f"processes {processes}; each shard's devices must be one "
                             f"process's")
        owners.append(processes[0])
    return owners


class ProcessCacheManager:
    """The host bookkeeping of this process's shards of a sharded cache.

    One `CacheManager` per shard this process holds (`shards`); requests are
    admitted, stepped and released only here, and no process needs another's
    tables. Every process calls `prepare_step` once per step, as it calls the
    jitted step, even with no tokens of its own: the step's padded sizes are
    agreed across processes there (see `prepare_step`).

    Request ids need only be unique within a process; ids this class makes
    are (process index + number of processes * n), unique across processes.
    A request routed to another process than the one that admitted it is
    refused (KeyError naming this process and its shards), nothing changed.
    When this process's shards are full, `admit` raises CacheFullError
    naming them: the router sends the request to another process."""

    def __init__(self, config: CacheConfig, mesh: jax.sharding.Mesh):
        if config.shard_axis is None:   # one shard is a valid mesh too
            raise ValueError("config: expected a config split over a mesh axis by "
                             "dsv4_jax.sharding.shard_config, got an unsharded one")
        axis = config.shard_axis
        if mesh.shape.get(axis) != config.num_shards:
            raise ValueError(f"mesh: expected axis {axis!r} of {config.num_shards} shards, "
                             f"got mesh axes {dict(mesh.shape)}")
        self.config = config
        self.mesh = mesh
        self.process = jax.process_index()
        self.owners = shard_processes(mesh, axis)
        self.shards = tuple(k for k, p in enumerate(self.owners) if p == self.process)
        self.managers = {k: CacheManager(config.local(), shard=k) for k in self.shards}
        self._shard_of: dict[Hashable, int] = {}
        self._next_id = 0
        self._tokens_per_shard = 0
        self._rows = NamedSharding(mesh, P(axis))

    def _where(self) -> str:
        return f"process {self.process} (shards {', '.join(map(str, self.shards))})"

    # ---- requests ----------------------------------------------------------------------------
    def admit(self, request_id: Hashable | None = None, shard: int | None = None) -> Hashable:
        """Admit on `shard` (one of this process's) or on this process's shard
        with the most free slots (then blocks). CacheFullError when all of
        this process's shards are full; ValueError for a shard of another
        process."""
        if shard is not None and shard not in self.managers:
            if not 0 <= shard < self.config.num_shards:
                raise ValueError(f"shard: expected one of 0..{self.config.num_shards - 1}, "
                                 f"got {shard}")
            raise ValueError(f"shard: shard {shard} is process {self.owners[shard]}'s, this is "
                             f"{self._where()}; admit the request on process "
                             f"{self.owners[shard]}")
        if request_id is None:
            n = jax.process_count()
            while self.process + n * self._next_id in self._shard_of:
                self._next_id += 1
            request_id = self.process + n * self._next_id
        if request_id in self._shard_of:
            raise ValueError(f"request_id: {request_id!r} is already admitted on {self._where()}")
        if shard is None:
            open_ = [k for k in self.shards if self.managers[k].free_slots]
            if not open_:
                raise CacheFullError(f"no free request slot on {self._where()}: route the "
                                     f"request to another process")
            shard = max(open_, key=lambda k: (self.managers[k].free_slots,
                                              self.managers[k].free_blocks, -k))
        self.managers[shard].admit(request_id)
        self._shard_of[request_id] = shard
        return request_id

    def release(self, request_id) -> None:
        """Return the request's slot and blocks on its shard."""
        self.managers[self.shard_of(request_id)].release(request_id)
        del self._shard_of[request_id]

    @property
    def requests(self) -> tuple:
        """Ids of the requests this process holds, in order of admission."""
        return tuple(self._shard_of)

    def shard_of(self, request_id) -> int:
        """The shard that holds the request; KeyError if this process did not
        admit it (it may be another process's)."""
        try:
            return self._shard_of[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not admitted on {self._where()}: each "
                           f"process steps only the requests it admitted; route its tokens "
                           f"to the process that admitted it") from None

    def slot_of(self, request_id) -> int:
        """The request's shard-local slot (what per-request operands hold)."""
        return self.managers[self.shard_of(request_id)].slot_of(request_id)

    def length_of(self, request_id) -> int:
        """Tokens of the request in the cache."""
        return self.managers[self.shard_of(request_id)].length_of(request_id)

    def global_slot(self, request_id) -> int:
        """Row of the request in the global R axis."""
        return (self.shard_of(request_id) * self.config.local().max_requests
                + self.slot_of(request_id))

    # ---- steps -------------------------------------------------------------------------------
    @property
    def tokens_per_shard(self) -> int:
        """T of the last step: token rows per shard."""
        return self._tokens_per_shard

    def token_rows(self, request_id) -> slice:
        """Rows of the request's tokens in this process's per-token operand of
        the last step (`len(shards) * T` rows, shard after shard)."""
        k = self.shard_of(request_id)
        local = self.managers[k].token_rows(request_id)
        off = self.shards.index(k) * self._tokens_per_shard
        return slice(local.start + off, local.stop + off)

    def prepare_step(self, tokens: Mapping[Hashable, int], *, min_tokens: int = 1,
                     min_new_blocks: int = 1, min_resets: int = 1,
                     sizes: Sequence[int] | None = None, speculative: bool = False) -> StepMeta:
        """The step's global metadata, built from this process's shards only.

        Every shard's metadata is padded to sizes common to all shards of all
        processes (T, NB, NR: the jitted step is one program). With `sizes`
        None they are agreed here: each process's padded sizes are gathered
        (`multihost_utils.process_allgather`: a separate tiny all-gather
        of four integers a process, outside the step) and the largest taken, so every process must call
        this for every step. `sizes=(T, NB, NR)`, powers of two and the same
        on every process, fixes them instead, with no exchange; a step that
        needs more on one of this process's shards raises CacheFullError.

        A request this process did not admit raises KeyError (it may be
        another process's: route its tokens there). When the call fails on
        one process, the exchange tells the others, whose calls raise
        StepAbandoned; nothing changes on any shard of any process, and every
        process calls again. `speculative` as in `CacheManager.prepare_step`."""
        try:
            plans, local = self._plan(tokens, min_tokens, min_new_blocks, min_resets)
        except Exception:
            if sizes is None:
                _agree(None)        # the others learn this step is off, then so do we
            raise
        if sizes is None:
            agreed = _agree(local)
            if agreed is None:
                raise StepAbandoned("another process could not plan its part of this step "
                                    "(it raised there); nothing changed on any shard: call "
                                    "prepare_step again, on every process")
        else:
            agreed = [int(s) for s in sizes]
            if len(agreed) != 3 or any(s < 1 or s & (s - 1) for s in agreed):
                raise ValueError(f"sizes: expected (T, NB, NR), powers of two, got {sizes!r}")
            for what, size, need in zip(("token rows", "new blocks", "resets"), agreed, local):
                for k, n in need.items():
                    if n > size:
                        raise CacheFullError(f"the step needs {n} {what} on shard {k} "
                                             f"(process {self.process}), the fixed size is "
                                             f"{size}")
        T, NB, NR = agreed
        metas = [self.managers[k].commit_step(plans[k], min_tokens=T, min_new_blocks=NB,
                                              min_resets=NR, device_put=False,
                                              speculative=speculative)
                 for k in self.shards]
        self._tokens_per_shard = T
        data = self.put_rows(np.concatenate([np.asarray(m.data) for m in metas]))
        first = metas[0]
        return StepMeta(data, first.num_tokens, first.num_requests, first.num_new_blocks,
                        first.num_resets)

    def commit_speculative(self, accepted: Mapping[Hashable, int]) -> np.ndarray:
        """`CacheManager.commit_speculative` on this process's shards (all
        checked before any changes; a request this process did not admit is
        a KeyError). Returns this process's rows of the counts verify_commit
        takes (i32[len(shards) * R_local], shard after shard, by local
        slot): `put_rows` makes the global operand of them. No exchange
        between processes: each commits its own requests."""
        per_shard = {k: {} for k in self.shards}
        for rid, a in accepted.items():
            per_shard[self.shard_of(rid)][rid] = a
        for k, a in per_shard.items():
            self.managers[k].check_speculative(a)
        return np.concatenate([self.managers[k].commit_speculative(per_shard[k])
                               for k in self.shards])

    def accepted_of(self, accepted) -> dict:
        """`CacheManager.accepted_of` on this process's shards: {request:
        kept tokens} of this process's requests in the last step, what
        `commit_speculative` takes. `accepted` as verify_commit takes it:
        the global i32[S * R_local] (by local slot, shard after shard, e.g.
        the device's `dsv4_jax.accepted_counts`; only this process's shards
        are read), or this process's rows of it (i32[len(shards) * R_local],
        as `commit_speculative` returns them)."""
        R = self.config.local().max_requests
        S = self.config.num_shards
        if isinstance(accepted, jax.Array) and accepted.shape == (S * R,):
            if accepted.is_fully_addressable:
                counts = np.asarray(accepted).reshape(S, R)[list(self.shards)].reshape(-1)
            else:
                counts = self.local_rows(accepted)
        else:
            counts = np.asarray(accepted)
        mine = len(self.shards) * R
        if counts.shape != (mine,) or not np.issubdtype(counts.dtype, np.integer):
            raise ValueError(f"accepted: expected an integer array [{S * R}] (every shard) or "
                             f"[{mine}] ({self._where()}), by local slot, shard after shard, "
                             f"got {counts.dtype}{list(counts.shape)}")
        out = {}
        for i, k in enumerate(self.shards):
            out.update(self.managers[k].accepted_of(counts[i * R:(i + 1) * R]))
        return out

    def _plan(self, tokens, min_tokens, min_new_blocks, min_resets):
        """Every shard's checked plan, and per size (T, NB, NR) what each
        shard needs, padded as the managers pad."""
        per_shard = {k: {} for k in self.shards}
        for rid, n in tokens.items():
            per_shard[self.shard_of(rid)][rid] = n
        plans = {k: self.managers[k].plan_step(t) for k, t in per_shard.items()}
        need = [{k: bucket(getattr(p, field), least) for k, p in plans.items()}
                for field, least in (("num_tokens", min_tokens),
                                     ("num_new_blocks", min_new_blocks),
                                     ("num_resets", min_resets))]
        return plans, need

    # ---- operands ----------------------------------------------------------------------------
    def put_rows(self, tree):
        """Global arrays, split by shard along the first axis, from this
        process's rows: each leaf holds `len(shards) * n` rows, n per shard,
        shard after shard in `shards` order. Every process passes its own
        rows (the same n); no data crosses processes."""
        def one(x):
            x = np.asarray(x)
            mine = len(self.shards)
            if x.ndim == 0 or x.shape[0] % mine:
                raise ValueError(f"rows: expected {mine} shards' rows of {self._where()} "
                                 f"(a multiple of {mine}) along the first axis, got shape "
                                 f"{x.shape}")
            n = x.shape[0] // mine
            shape = (n * self.config.num_shards,) + x.shape[1:]
            where = {k: i for i, k in enumerate(self.shards)}

            def piece(index):
                i = where[(index[0].start or 0) // max(n, 1)]
                return x[i * n:(i + 1) * n]
            return jax.make_array_from_callback(shape, self._rows, piece)
        return jax.tree_util.tree_map(one, tree)

    def local_rows(self, tree):
        """This process's rows of global arrays split by shard along the first
        axis (outputs of a sharded op), as numpy: its shards' rows, shard after
        shard."""
        def one(x):
            n = x.shape[0] // self.config.num_shards
            pieces = {}
            for piece in x.addressable_shards:
                pieces.setdefault((piece.index[0].start or 0) // max(n, 1), piece.data)
            return np.concatenate([np.asarray(pieces[k]) for k in self.shards])
        return jax.tree_util.tree_map(one, tree)


class StepAbandoned(RuntimeError):
    """`ProcessCacheManager.prepare_step` on the other processes when one
    process's part of the step failed: nothing changed on any shard."""


def _agree(need: list[dict] | None) -> list[int] | None:
    """The sizes (T, NB, NR) every shard of every process fits, or None when
    some process could not plan (`need` None there). Every process calls
    this once per step: it is one small exchange among the processes."""
    mine = [0, 0, 0] if need is None else [max([1, *n.values()]) for n in need]
    mine = np.asarray([need is not None, *mine], np.int32)
    if jax.process_count() == 1:
        every = mine[None]
    else:
        from jax.experimental import multihost_utils
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 4)
    if not every[:, 0].all():
        return None
    return [int(v) for v in every[:, 1:].max(axis=0)]
