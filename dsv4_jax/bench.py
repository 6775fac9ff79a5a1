"""`python -m dsv4_jax bench`: benchmarks/run.py when the checkout has it, else a
built-in timing of every op on the default device; a table, a JSON of the
numbers and a PNG plot of bandwidth against rows with the copy ceiling.

Bandwidth of an op = the bytes it must move (inputs read + outputs written,
counted from the shapes, see `_op_bytes`) / its time: a lower bound on the
traffic, comparable with a plain device copy of a large array.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import numpy as np

from . import config as C

_SCRIPT = pathlib.Path("benchmarks") / "run.py"


def find_suite() -> pathlib.Path | None:
    """benchmarks/run.py of the working directory or of the source checkout."""
    here = pathlib.Path(__file__).resolve().parents[1]
    for root in (pathlib.Path.cwd(), here):
        if (root / _SCRIPT).is_file():
            return root / _SCRIPT
    return None


def main(args, ui) -> int:
    suite = None if args.builtin else find_suite()
    if suite is not None:
        out = str(pathlib.Path(args.json).resolve())       # the suite runs from its checkout
        ui.line(f"running {suite} --json {out}")
        rc = subprocess.call([sys.executable, str(suite), "--json", out], cwd=suite.parents[1])
        if rc != 0:
            ui.line(f"benchmarks/run.py exited with {rc}")
            return rc
        try:
            data = json.loads(pathlib.Path(args.json).read_text())
        except (OSError, ValueError) as e:
            ui.line(f"could not read {args.json}: {e}; no plot")
            return 0
        records, ceiling = records_from(data)
        if not records:
            ui.line(f"no (op, rows, GB/s) records recognized in {args.json}; no plot")
            return 0
    else:
        if not args.builtin:
            ui.line("benchmarks/run.py not found: built-in timing of the ops")
        data = builtin(quick=args.quick, progress=ui.progress)
        records, ceiling = data["results"], data["copy_gbps"]
        if data["errors"]:
            ui.line(f"warning: the ops counted bad input while timed: {data['errors']}")
        ui.table(f"ops on {data['device']} (impl {data['impl']}, copy ceiling "
                 f"{ceiling:,.1f} GB/s)", ["op", "rows", "us/call", "GB/s", "% of copy"],
                 [[r["op"], r["rows"], f"{r['seconds'] * 1e6:,.1f}", f"{r['gbps']:,.2f}",
                   f"{100 * r['gbps'] / ceiling:.1f}"] for r in records])
        pathlib.Path(args.json).write_text(json.dumps(data, indent=1))
        ui.line(f"numbers written to {args.json}")
    plot(records, ceiling, args.plot, ui)
    return 0


# ---- reading another suite's JSON ----------------------------------------------------------
_OP_KEYS = ("op", "name", "kernel", "bench")
_ROW_KEYS = ("rows", "tokens", "T", "n", "batch", "size")


def _bandwidth_key(d):
    for k, v in d.items():
        lk = k.lower()
        if isinstance(v, (int, float)) and ("gb/s" in lk or "gbps" in lk or "bandwidth" in lk
                                            or lk in ("bw", "gb_s")):
            return k
    return None


def records_from(data):
    """Best effort: every dict in `data` with an op name, a row count and a
    bandwidth in GB/s, and a copy ceiling if one is named."""
    records, ceiling = [], None

    def walk(x, parent_key=""):
        nonlocal ceiling
        if isinstance(x, dict):
            op = next((x[k] for k in _OP_KEYS if isinstance(x.get(k), str)), None)
            rows = next((x[k] for k in _ROW_KEYS if isinstance(x.get(k), (int, float))), None)
            bw = _bandwidth_key(x)
            if op and rows is not None and bw:
                if "copy" in op.lower():
                    ceiling = max(ceiling or 0.0, float(x[bw]))
                else:
                    records.append({"op": op, "rows": rows, "gbps": float(x[bw])})
            for k, v in x.items():
                lk = k.lower()
                if isinstance(v, (int, float)) and "copy" in lk and ("gb" in lk or "ceiling" in lk
                                                                    or "bw" in lk):
                    ceiling = max(ceiling or 0.0, float(v))
                walk(v, k)
        elif isinstance(x, list):
            for v in x:
                walk(v, parent_key)
    walk(data)
    return records, ceiling


# ---- plot -------------------------------------------------------------------------------------
def plot(records, ceiling, path, ui) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        ui.line("matplotlib is not installed: no plot (pip install 'dsv4-jax[cli]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r["op"] for r in records):
        pts = sorted((r["rows"], r["gbps"]) for r in records if r["op"] == op)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
    if ceiling:
        ax.axhline(ceiling, color="k", linestyle="--", label=f"copy ceiling {ceiling:,.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens or requests per call)")
    ax.set_ylabel("GB/s (bytes moved / time)")
    ax.set_title("dsv4_jax ops: bandwidth against rows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    ui.line(f"plot written to {path}")


# ---- built-in timing ------------------------------------------------------------------------
def _timeit(fn, repeat):
    """Median seconds of `fn()` (which blocks), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def builtin(quick: bool = False, progress=None) -> dict:
    """Time append, flush (CSA, HCA) and the three gathers at several row
    counts on the default device, and a device copy for the ceiling."""
    import jax
    import jax.numpy as jnp

    from .meta import StepMeta
    from .ops._dispatch import resolve_impl
    from .ops.append import append
    from .ops.apply_step import apply_step
    from .ops.flush import flush
    from .ops.gather import gather_all, gather_topk, gather_window
    from .state import init_state, tree_bytes, kv_entry_shapes
    from .workload import layer_params

    on_cpu = jax.default_backend() == "cpu"
    R, context, k = (16, 4096, 64) if on_cpu else (64, 16384, 512)
    rows_list = ([1, 64] if quick else [1, 16, 128, 512]) if on_cpu else \
        ([1, 256, 4096] if quick else [1, 16, 256, 1024, 4096])
    repeat = 3 if quick else 10
    from .config import CacheConfig
    cfg = CacheConfig.tiny(max_requests=R, max_context=context)
    MB = cfg.max_blocks_per_request
    params = layer_params(cfg)
    entry = tree_bytes(kv_entry_shapes(cfg.kv_format, (1,)))

    # every request owns every block of its context
    nb = np.array([(s, b, s * MB + b) for s in range(R) for b in range(MB)], np.int32)
    state = jax.jit(apply_step, donate_argnums=0)(init_state(cfg), StepMeta.build(
        token_slot=[-1], token_pos=[0], lengths=[context] * R, new_blocks=nb,
        reset_slots=np.arange(R)))
    rng = np.random.default_rng(0)
    results = []
    cur = [state]            # the live state: writers donate it and put back the new one

    def writer(fn, *inputs):
        f = jax.jit(fn, donate_argnums=0)

        def call():
            cur[0] = f(cur[0], *inputs)
            jax.block_until_ready(cur[0])
        return call

    def reader(fn, *inputs):
        f = jax.jit(fn)
        return lambda: jax.block_until_ready(f(cur[0], *inputs))

    total = len(rows_list) * 6 + 1
    ctx = progress("built-in benchmark", total) if progress else None
    advance = ctx.__enter__() if ctx else (lambda n=1: None)
    try:
        for T in rows_list:
            slot = np.arange(T) % R
            pos = 1024 + np.arange(T) // R          # contiguous per request, blocks present
            meta = StepMeta.build(token_slot=slot, token_pos=pos, lengths=[context] * R,
                                  new_blocks=-np.ones((1, 3)), reset_slots=[-1])
            f32 = lambda *s: jnp.asarray(rng.normal(0, 1, s), jnp.float32)
            kv = f32(T, C.HEAD_DIM).astype(jnp.bfloat16)
            csa_in = (f32(T, 2 * C.HEAD_DIM), f32(T, 2 * C.HEAD_DIM),
                      f32(T, 2 * C.INDEX_DIM), f32(T, 2 * C.INDEX_DIM))
            hca_in = (f32(T, C.HEAD_DIM), f32(T, C.HEAD_DIM))
            slots = jnp.asarray(slot, jnp.int32)
            visible = (pos + 1) // C.CSA_RATIO
            idx = jnp.asarray(rng.integers(0, visible[:, None], (T, k)), jnp.int32)
            lengths = jnp.full((T,), context, jnp.int32)
            acc = 2 * 3 * 4 * (2 * C.HEAD_DIM + 2 * C.INDEX_DIM)     # CSA accumulators r+w
            cases = [
                ("append", writer(lambda s, m, x: append(s, 0, m, x), meta, kv),
                 T * (2 * C.HEAD_DIM + entry + 8)),
                ("flush_csa", writer(lambda s, m, a, b, c, d: flush(
                    s, 1, m, a, b, params[1], index_kv=c, index_score=d), meta, *csa_in),
                 T * (4 * 2 * (2 * C.HEAD_DIM + 2 * C.INDEX_DIM)) + min(T, R) * acc
                 + T // C.CSA_RATIO * (entry + C.INDEX_PACKED + C.INDEX_SCALES)),
                ("flush_hca", writer(lambda s, m, a, b: flush(s, 2, m, a, b, params[2]),
                                     meta, *hca_in),
                 T * 4 * 2 * C.HEAD_DIM + min(T, R) * 2 * 3 * 4 * C.HEAD_DIM),
                ("gather_window", reader(lambda s, sl: gather_window(s, 0, sl), slots),
                 T * C.WINDOW * (entry + 2 * C.HEAD_DIM + 8)),
                ("gather_topk", reader(lambda s, sl, p, i: gather_topk(s, 1, sl, p, i), slots,
                                       jnp.asarray(pos, jnp.int32), idx),
                 T * k * (entry + 2 * C.HEAD_DIM + 4 + 1)),
                ("gather_all", reader(lambda s, sl, n: gather_all(s, 2, sl, n, MB), slots,
                                      lengths),
                 T * MB * (entry + 2 * C.HEAD_DIM + 4)),
            ]
            for name, call, nbytes in cases:
                sec = _timeit(call, repeat)
                results.append({"op": name, "rows": T, "seconds": sec, "bytes": int(nbytes),
                                "gbps": nbytes / sec / 1e9})
                advance()
        n = (64 << 20) // 4 if on_cpu else (1 << 30) // 4
        x = jnp.ones((n,), jnp.float32)
        copy = jax.jit(lambda a: a + 1)
        sec = _timeit(lambda: jax.block_until_ready(copy(x)), repeat)
        advance()
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    from .errors import error_counts
    errors = {k.name.lower(): v for k, v in error_counts(cur[0]).items()}
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "")
    return {"errors": errors,
            "device": dev.platform if kind in ("", dev.platform) else f"{dev.platform} ({kind})",
            "impl": resolve_impl("auto", "dsv4_append"), "config": {
                "model": cfg.model, "max_requests": R, "max_context": context, "topk": k,
                "kv_format": cfg.kv_format},
            "copy_gbps": 2 * 4 * n / sec / 1e9, "results": results}
