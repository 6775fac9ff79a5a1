"""The request-state benchmark: moving one request's cache.

    python benchmarks/bench_request_state.py --json request_state.json   # flash, 4k and 64k
    python benchmarks/bench_request_state.py --model tiny --contexts 512,1024 --reps 2

For each context, one request holding that many tokens (its blocks and slot
filled with random bits; a move copies bits, so their values do not matter):

- slot (device): `snapshot` of its slot (windows of every layer, compressor
  accumulators) and `restore` into another slot, on the device.
- request (device / pinned_host): the whole request out (`read_request`: the
  snapshot and its blocks, as `offload` does) and back into another slot and
  other blocks (`write_request`, as `resume` does), with the copy on the
  device or in pinned host memory.

Every move is one jitted program given `RequestIds` made once per place
(`request_ids`), so no index travels from the host inside a timed call.
- prefix hit: admitting a request on a cached prefix of the whole context is
  a `restore` of the snapshot plus a block-table row (the "restore" of the
  slot row); set against the cache writes of prefilling those tokens through
  every layer (bench_prefill.py, chunks of up to 8192 tokens; the
  cache's share of a prefill only, the model's compute comes on top).

Each move is timed twice. Device time (on a GPU): the span of one call on
the GPU's own timeline (CUPTI through jax.profiler, `device_timeline`), from
its first kernel or memcpy's start to its last one's end, the median over
`reps` calls; "busy" sums the durations alone, and the launches of one call
are listed by name (what XLA emitted for the move). Host time: the median of
`reps` synced calls from Python, after two warm-up calls (dispatch, argument
placement and the final sync included); it is the only time on the CPU.

Rates: bytes of the request (snapshot + its blocks, `OffloadedRequest.nbytes`)
a second, one way. On the device a copy reads and writes each byte, so
"% of copy" sets 2 x bytes / time against the device's copy rate (bytes read +
written a second): on a GPU one jitted `x + 1` over 1 GiB on the timeline
(device.py's `copy_bandwidth`), on the CPU the same host-timed over 64 MiB.
To and from host memory it sets bytes / time against the host-device rate
measured here over the same bytes (`jax.device_put` into pinned host memory
and back): device time against the memcpy's own time on the timeline, host
time against the host-timed `device_put`. Every round trip is checked: the
request's snapshot and blocks back equal to the bits that left.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.app.arguments import output_path
from dsv4_jax.app.bench.device_timeline import device_time
from dsv4_jax.config import PRESETS
from dsv4_jax.requests.moves import host_memory_kind
from dsv4_jax.requests.transfer import read_request, request_ids, restore, snapshot, write_request
from dsv4_jax.state import state_shapes

import bench_prefill as prefill
from device import copy_bandwidth



def bench_config(model: str, context: int, kv_format: str = "ds_fp8") -> dj.CacheConfig:
    """Two slots and blocks for two copies of a request of `context` tokens."""
    return PRESETS[model](max_requests=2, max_context=context,
                          num_blocks=2 * C.blocks_for_tokens(context), kv_format=kv_format)


def random_state(cfg, seed=0):
    """A state of random bits, made on the device."""
    shapes = state_shapes(cfg)
    key = jax.random.key(seed)

    def fill(path, sds):
        k = jax.random.fold_in(key, hash(jax.tree_util.keystr(path)) & 0x7FFFFFFF)
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[np.dtype(sds.dtype).itemsize]
        return jax.lax.bitcast_convert_type(jax.random.bits(k, sds.shape, width), sds.dtype)
    return jax.jit(lambda: jax.tree_util.tree_map_with_path(fill, shapes))()


def timed(call, reps, warm=2):
    """Median seconds of `reps` synced calls after `warm` warm-up calls (two:
    the second call of a donated program sees the state it returned itself,
    placed as its outputs are, and may compile again)."""
    for _ in range(warm):
        jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bits_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    raw = lambda x: np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
    return all(np.array_equal(raw(x), raw(y)) for x, y in zip(la, lb))


def host_rates(nbytes, reps, device):
    """GB/s of `nbytes` device -> pinned host and back: {"d2h", "h2d"} host-
    timed `jax.device_put`, and on a GPU {"d2h_dev", "h2d_dev"} the same
    copies' time on its timeline."""
    dev = jax.sharding.SingleDeviceSharding(device)
    host = dev.with_memory_kind("pinned_host")
    x = jax.device_put(jnp.zeros(nbytes, jnp.uint8), dev)
    h = jax.device_put(x, host)
    to_host, to_dev = lambda: jax.device_put(x, host), lambda: jax.device_put(h, dev)
    rates = {"d2h": nbytes / timed(to_host, reps) / 1e9,
             "h2d": nbytes / timed(to_dev, reps) / 1e9}
    for key, call in (("d2h_dev", to_host), ("h2d_dev", to_dev)):
        t = device_time(call, reps)
        if t is not None:
            rates[key] = nbytes / t["us"] / 1e3
    return rates


def device_copy_gbps() -> float:
    """The device's copy rate in GB/s (bytes read + written): `x + 1` over
    1 GiB on a GPU's timeline; host-timed over 64 MiB on the CPU."""
    gpu = jax.default_backend() == "gpu"
    return copy_bandwidth(1 << 30 if gpu else 1 << 26) / 1e9


class Mover:
    """The state and the request (slot 0, blocks [0, n)); moves go into slot
    1 and blocks [n, 2n), then back, so every timed call moves real bytes.
    Each place's ids are on the device once (`request_ids`)."""

    def __init__(self, cfg, context, seed=0):
        self.cfg, self.context = cfg, context
        self.n = C.blocks_for_tokens(context)
        self.state = random_state(cfg, seed)
        homes = [(0, np.arange(self.n, dtype=np.int32)),
                 (1, np.arange(self.n, 2 * self.n, dtype=np.int32))]
        self.homes = [request_ids(self.state, slot, blocks, blocks) for slot, blocks in homes]
        self.turn = 0

    def out(self, memory_kind, slot_only=False):
        """The request where it is now: its snapshot (`slot_only`), or
        (snapshot, blocks) by one `read_request`."""
        here = self.homes[self.turn]
        if slot_only:
            return snapshot(self.state, here, memory_kind=memory_kind), None
        return read_request(self.state, here, memory_kind=memory_kind)

    def into(self, parked, slot_only=False):
        """Write `parked` into the other home; returns what is now there."""
        self.turn ^= 1
        there = self.homes[self.turn]
        snap, data = parked
        if slot_only:
            self.state = restore(self.state, there, snap)
        else:
            self.state = write_request(self.state, there, snap, data)
        return self.state


MOVES = (("slot_snapshot", "slot snapshot"), ("slot_restore", "slot restore"),
         ("device_out", "request out, device"), ("device_in", "request in, device"),
         ("host_out", "request out, to host"), ("host_in", "request in, from host"))


def measure(model, context, *, reps=5, kv_format="ds_fp8", prefill_impl="auto",
            with_prefill=True, copy_gbps=None, emit=print) -> dict:
    cfg = bench_config(model, context, kv_format)
    mv = Mover(cfg, context)
    kind = host_memory_kind(mv.state)
    first = mv.out(None)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(first))
    slot_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(first[0]))
    copy = copy_gbps or device_copy_gbps()
    rates = host_rates(nbytes, reps, next(iter(mv.state.block_table.devices())))
    row = {"model": model, "context": context, "kv_format": kv_format, "bytes": nbytes,
           "slot_bytes": slot_bytes, "copy_GBps": copy, "d2h_GBps": rates["d2h"],
           "h2d_GBps": rates["h2d"], "platform": jax.default_backend(),
           "host_memory_kind": kind}
    if "d2h_dev" in rates:
        row.update(d2h_dev_GBps=rates["d2h_dev"], h2d_dev_GBps=rates["h2d_dev"])
    exact = True

    def record(key, moved, host_s, dev, ref_gbps, factor):
        """Row entries of one move: host ms (and GB/s, % of the reference),
        device µs, GB/s and % where there is a timeline."""
        row[f"{key}_ms"] = host_s * 1e3
        if dev is None:
            return
        gbps = moved / dev["us"] / 1e3
        row.update({f"{key}_dev_us": dev["us"], f"{key}_dev_busy_us": dev["busy_us"],
                    f"{key}_dev_GBps": gbps, f"{key}_dev_pct": 100 * factor * gbps / ref_gbps,
                    f"{key}_launches": dev["launches"], f"{key}_kernels": dev["kernels"],
                    f"{key}_split": dev["split"]})

    def round_trip(where, memory_kind, moved, slot_only=False):
        nonlocal exact
        parked = mv.out(memory_kind, slot_only)
        out_call = lambda: mv.out(memory_kind, slot_only)  # noqa: E731
        in_call = lambda: mv.into(parked, slot_only)       # noqa: E731
        t_out, t_in = timed(out_call, reps), timed(in_call, reps)
        d_out, d_in = device_time(out_call, reps), device_time(in_call, reps)
        back = mv.out(None)
        exact = exact and _bits_equal(back[0], parked[0]) and \
            (slot_only or _bits_equal(back[1], parked[1]))
        if where == "host":
            refs, factor = (row.get("d2h_dev_GBps"), row.get("h2d_dev_GBps")), 1
        else:
            refs, factor = (copy, copy), 2
        keys = ("slot_snapshot", "slot_restore") if slot_only else (f"{where}_out", f"{where}_in")
        for key, t, d, ref in zip(keys, (t_out, t_in), (d_out, d_in), refs):
            record(key, moved, t, d, ref, factor)
        return t_out, t_in

    t_snap, t_restore = round_trip("device", None, slot_bytes, slot_only=True)
    row.update(slot_GBps=slot_bytes / t_restore / 1e9,
               slot_copy_pct=100 * 2 * slot_bytes / t_restore / 1e9 / copy)
    emit(f"  {model} {context}: slot snapshot {t_snap * 1e3:.3f} ms, restore "
         f"{t_restore * 1e3:.3f} ms ({slot_bytes / 1e6:.2f} MB)" + _device_note(row, "slot"))
    for where, memory_kind in (("device", None), ("host", kind)):
        if where == "host" and kind is None:
            continue
        t_out, t_in = round_trip(where, memory_kind, nbytes)
        gbps_out, gbps_in = nbytes / t_out / 1e9, nbytes / t_in / 1e9
        ref_out, ref_in = (copy / 2, copy / 2) if where == "device" else \
            (rates["d2h"], rates["h2d"])
        row.update({f"{where}_out_GBps": gbps_out, f"{where}_in_GBps": gbps_in,
                    f"{where}_out_pct": 100 * gbps_out / ref_out,
                    f"{where}_in_pct": 100 * gbps_in / ref_in})
        emit(f"  {model} {context}: request {where}: out {t_out * 1e3:.2f} ms "
             f"({gbps_out:.1f} GB/s), in {t_in * 1e3:.2f} ms ({gbps_in:.1f} GB/s) of "
             f"{nbytes / 1e6:.1f} MB" + _device_note(row, where))
    row["exact"] = bool(exact)
    row["prefix_hit_ms"] = row["slot_restore_ms"]
    if with_prefill:
        sc = prefill.Scenario(1, context, min(context, 8192))
        pcfg = prefill.prefill_config(model, sc, kv_format)
        prow, _ = prefill.measure(pcfg, sc, impl=prefill_impl, reps=max(1, reps // 2),
                                  copy_gbps=copy, emit=lambda line: None)
        row["prefill_ms"] = prow["ms_total"]
        row["prefix_hit_speedup"] = prow["ms_total"] / row["prefix_hit_ms"]
        emit(f"  {model} {context}: prefix hit {row['prefix_hit_ms']:.3f} ms against "
             f"{prow['ms_total']:.1f} ms of prefill writes")
    return row


def _device_note(row, where):
    """"; device: a µs, b µs" for the pair of moves of `where`, if timed on a GPU."""
    keys = ("slot_snapshot", "slot_restore") if where == "slot" else \
        (f"{where}_out", f"{where}_in")
    if f"{keys[0]}_dev_us" not in row:
        return ""
    return "; device " + ", ".join(f"{row[k + '_dev_us']:.1f} us" for k in keys)


# (key, header, format) of the table's columns after model, context and move
COLUMNS = (("MB", "MB", ".2f"), ("dev_us", "device us", ".1f"), ("dev_busy_us", "busy us", ".1f"),
           ("dev_GBps", "device GB/s", ".1f"), ("dev_pct", "% of ref", ".0f"),
           ("ref", "ref", "s"), ("launches", "launches", ".0f"), ("ms", "host ms", ".3f"),
           ("GBps", "host GB/s", ".1f"), ("pct", "host % of ref", ".0f"))


def _move_cells(r, key):
    """One move's cells: device µs, GB/s, % of its reference (the copy rate;
    D2H or H2D for the host moves) and host ms, GB/s, %."""
    moved = r["slot_bytes"] if key.startswith("slot") else r["bytes"]
    host = key.startswith("host")
    ref = ("D2H" if key.endswith("out") else "H2D") if host else "copy"
    host_pct = {"slot_restore": "slot_copy_pct"}.get(key, f"{key}_pct")
    c = {"MB": moved / 1e6, "ref": ref, "ms": r.get(f"{key}_ms"),
         "GBps": moved / r[f"{key}_ms"] / 1e6 if f"{key}_ms" in r else None,
         "pct": r.get(host_pct)}
    if c["pct"] is None and c["GBps"] is not None and not host:
        c["pct"] = 100 * 2 * c["GBps"] / r["copy_GBps"]
    for k in ("dev_us", "dev_busy_us", "dev_GBps", "dev_pct", "launches"):
        c[k] = r.get(f"{key}_{k}")
    return c


def markdown(rows) -> str:
    head = "| model | context | move | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    kernels = []
    for r in rows:
        for key, label in MOVES:
            if f"{key}_ms" not in r:
                continue
            c = _move_cells(r, key)
            cells = ["-" if c[k] is None else format(c[k], f) for k, _, f in COLUMNS]
            lines.append(f"| {r['model']} | {r['context']} | {label} | " + " | ".join(cells) + " |")
            if f"{key}_kernels" in r:
                names = ", ".join(f"{n} x{v:g}" for n, v in r[f"{key}_kernels"].items())
                kernels.append(f"- {r['model']} {r['context']} {label}: {names}")
    notes = []
    for r in rows:
        hit = f"  {r['model']} {r['context']}: exact {r['exact']}"
        if "prefill_ms" in r:
            hit += (f"; prefix hit {r['prefix_hit_ms']:.3f} ms (host) against "
                    f"{r['prefill_ms']:.1f} ms of prefill writes ({r['prefix_hit_speedup']:,.0f}x)")
        notes.append(hit)
    if kernels:
        notes += ["", "launches of one call (kernels and memcpys, by name):"] + kernels
    if rows:
        r = rows[0]
        dev = "" if "d2h_dev_GBps" not in r else \
            f" ({r['d2h_dev_GBps']:.1f} / {r['h2d_dev_GBps']:.1f} GB/s on the timeline)"
        notes.append(f"\ncopy {r['copy_GBps']:.0f} GB/s (read + write), device to pinned host "
                     f"{r['d2h_GBps']:.1f} GB/s, pinned host to device {r['h2d_GBps']:.1f} GB/s"
                     f" host-timed{dev} ({r['platform']})")
    return "\n".join(lines + [""] + notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="flash")
    p.add_argument("--contexts", default="4096,65536",
                   help="comma-separated request lengths in tokens (default 4096,65536)")
    p.add_argument("--kv-format", default="ds_fp8", choices=list(C.KV_FORMATS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--impl", default="auto", help="implementation of the prefill reference")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill comparison")
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="the device's copy rate (GB/s, read + write) instead of measuring it")
    p.add_argument("--json", type=output_path, metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        p.error(f"--contexts: expected comma-separated ints, got {args.contexts!r}")
    if any(c <= 0 or c % C.BLOCK_TOKENS for c in contexts):
        p.error(f"--contexts: expected positive multiples of {C.BLOCK_TOKENS}, got {contexts}")
    copy = args.copy_gbps or device_copy_gbps()
    rows = [measure(args.model, c, reps=args.reps, kv_format=args.kv_format,
                    prefill_impl=args.impl, with_prefill=not args.no_prefill,
                    copy_gbps=copy) for c in contexts]
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
