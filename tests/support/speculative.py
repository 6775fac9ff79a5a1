"""Speculative steps driven from token streams (docs/design/speculative.md), and the
views two caches are compared by.

`SpecDriver` is a `Driver` whose `spec_step({request: drafts},
{request: accepted})` verifies 1 + drafts positions of each request's
stream and keeps `accepted` of them (verify_begin, verify_layer,
verify_commit, write_layer of the kept rows: `workload.speculative_step`),
then tells the manager (`commit_speculative`). Its twin is a plain `Driver`
fed only the kept tokens (`Driver.step({request: accepted})`): after every
step each request must read back the same bytes from both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from support.streams import Driver, assert_same_request
from support.workload import speculative_step


class SpecDriver(Driver):
    """A Driver with speculative steps of at most `drafts` drafts a request."""

    def __init__(self, *args, drafts: int, read=None, **kw):
        super().__init__(*args, **kw)
        self.drafts = drafts
        self.outputs = None                  # the verify pass's reads of the last step

        def run(s, m, x, a):
            return speculative_step(s, m, x, a, self.params, drafts, self.impl, read=read)
        self._spec = jax.jit(run, donate_argnums=0)

    def spec_step(self, drafts: dict, accepted: dict, *, device_accepted=None,
                  host_accepted=None, poison=None):
        """Request r verifies positions length .. length + drafts[r] of its
        stream and keeps the first accepted[r]. `device_accepted` (an i32
        array by global slot) replaces what verify_commit is given and
        `host_accepted` what the manager is told (bad-count cases);
        `poison(inputs)` may change the step's rows before they run."""
        m = self.manager
        before = {r: m.length_of(r) for r in drafts}
        tokens = {r: 1 + k for r, k in drafts.items()}
        with self.ctx():
            meta = m.prepare_step(tokens, min_tokens=self.min_tokens, speculative=True,
                                  **self.pads)
            inputs = self.inputs(meta, tokens, before)
            if poison is not None:
                inputs = poison(inputs)
            if device_accepted is None:
                device_accepted = np.zeros(self.cfg.max_requests, np.int32)
                for r, a in accepted.items():
                    device_accepted[m.global_slot(r)] = a
            self.state, kept, self.outputs = self._spec(self.state, meta, inputs,
                                                        jnp.asarray(device_accepted, jnp.int32))
        m.commit_speculative(accepted if host_accepted is None else host_accepted)
        return meta, kept


def table_row(driver: Driver, rid) -> np.ndarray:
    """The request's block-table row on the device, checked against the
    manager's (its blocks, then -1)."""
    row = np.asarray(driver.state.block_table)[driver.manager.global_slot(rid)]
    np.testing.assert_array_equal(row, driver.manager.block_row(rid),
                                  err_msg=f"block-table row of request {rid!r}")
    return row


SLOT_LEAVES = (".swa.", ".csa.comp", ".csa.icomp", ".hca.comp")
BLOCK_LEAVES = (".csa.kv.", ".csa.index.", ".hca.kv.")


def holdings(driver: Driver, host: dict, rid) -> dict:
    """What request `rid` holds, as bytes from `host` (the state's leaves as
    numpy, by path): its slot's rows of the window and accumulators in every
    layer, and its blocks' rows of every pool in logical order."""
    m = driver.manager
    slot, blocks = m.global_slot(rid), list(m.global_blocks(rid))
    out = {}
    for name, x in host.items():
        if name.startswith(SLOT_LEAVES):
            out[name] = x[:, slot]
        elif name.startswith(BLOCK_LEAVES):
            out[name] = x[:, blocks]
    return {k: np.ascontiguousarray(v).view(np.uint8) for k, v in out.items()}


def _host(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state)}


def assert_same_cache(x: Driver, y: Driver, pairs, what="", reads=False):
    """Every request of `pairs` ((id in x, id in y), ...) holds the same in
    both caches: its length, its number of blocks and its block-table row
    (as the managers have it), its window, accumulators and blocks byte for
    byte (with `reads`, every read of it too); both caches' error counters
    equal."""
    hx, hy = _host(x.state), _host(y.state)
    for rx, ry in pairs:
        assert x.manager.length_of(rx) == y.manager.length_of(ry), f"{what}length of {rx!r}"
        rowx, rowy = table_row(x, rx), table_row(y, ry)
        assert np.array_equal(rowx >= 0, rowy >= 0), f"{what}blocks of {rx!r}: {rowx} {rowy}"
        got, want = holdings(x, hx, rx), holdings(y, hy, ry)
        for name in want:
            if not np.array_equal(got[name], want[name]):
                n = int(np.sum(got[name] != want[name]))
                raise AssertionError(f"{what}request {rx!r}: {name}: {n} bytes differ")
        if reads:
            assert_same_request(x.read(rx), y.read(ry), f"{what}request {rx!r}: ")
    np.testing.assert_array_equal(np.asarray(x.state.errors), np.asarray(y.state.errors),
                                  err_msg=f"{what}error counters")
