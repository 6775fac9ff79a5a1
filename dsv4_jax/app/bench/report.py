"""A benchmark run's rows for people: the summary tables (through the
command line's UI), the markdown tables of docs/perf/ops.md, and the plot of
bandwidth against rows."""
from __future__ import annotations

# A fixed copy rate the markdown's second % column sets every op against (bytes
# read + written a second): an H100's measured device-to-device copy, so that
# runs on other days or cards compare on one scale.
COPY_TBPS = 3.0


def size_detail(r):
    """What made an op row's size: the flush case, or the shape behind the rows."""
    if "case" in r:
        t = r.get("rows", r.get("T"))     # runs saved before rows were kept for flush: T
        return r["case"] if f"T={t}" in r["case"] else f"{r['case']} T={t}"
    return ", ".join(f"{k}={r[k]}" for k in ("R", "B", "T", "k", "E", "ctx") if k in r)


def size_label(r):
    """The size column of the markdown tables."""
    if "case" in r:
        return size_detail(r)
    made = size_detail(r)
    return f"{r['rows']} rows" + (f" ({made})" if made else "")


def _empty(rows):
    return next((r for r in rows if r["op"] == "empty"), None)


# The decode-step columns: (heading, value of a row, format); the timeline's
# exist on a GPU only (a run saved before a column existed shows –)
def _family(name):
    return lambda r: (r.get("family_us") or {}).get(name)


STEP_COLUMNS = (("ms/step", lambda r: r.get("ms"), ".3f"),
                ("span µs", lambda r: r.get("span_us"), ".1f"),
                ("busy µs", lambda r: r.get("busy_us"), ".1f"),
                ("attention µs", _family("attention"), ".1f"),
                ("indexer µs", _family("indexer"), ".1f"),
                ("writes µs", _family("writes"), ".1f"),
                ("kernels/layer", lambda r: r.get("kernels_per_layer"), ".2f"),
                ("copies/layer", lambda r: r.get("copy_kernels_per_layer"), ".2f"))


def _step_rows(rows):
    """The decode-step rows, one a (B, context, impl): [B, context, impl, cells]."""
    def cell(r, get, fmt):
        v = get(r)
        return format(v, fmt) if v is not None else "–"
    return [[r["B"], r["ctx"], r["impl"]] + [cell(r, g, f) for _, g, f in STEP_COLUMNS]
            for r in rows if r["op"] == "flash_decode_step" and "ms" in r]


def tables(data, ui):
    """The per-op table and the decode-step table of a run (`data` as the
    JSON holds it)."""
    rows = data["rows"]
    empty = _empty(rows)
    floor = f"x {empty['what']} ({empty['us']:.2f} us)" if empty else "no empty call timed"
    ui.table(f"ops on {data['device']} ({data['platform']}, jax {data['jax']}): % of the in-run "
             f"copy of as many bytes; {floor}", ["op", "rows", "made of", "impl", "us/call", "GB/s", "% of copy", "x empty"],
             [[r["op"], r["rows"], size_detail(r), r["impl"], f"{r['us']:,.2f}",
               f"{r['GBps']:,.2f}", f"{r['copy_pct']:.1f}", f"{r['vs_empty']:,.1f}"]
              for r in rows if "GBps" in r])
    steps = _step_rows(rows)
    if steps:
        ui.table("V4-Flash decode step as a model calls the library (43 layers: write_layer, "
                 "indexer_topk, attention)", ["B", "context", "impl"]
                 + [h for h, _, _ in STEP_COLUMNS], steps)


def markdown(rows):
    """The per-op table and the decode-step table of docs/perf/ops.md, as lines."""
    empty = _empty(rows)
    what = empty["what"] if empty else "empty FFI call"
    lines = [f"| op | size | µs / call | GB/s | % of in-run XOR | % of {COPY_TBPS:.1f} TB/s "
             f"| × {what} |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["op"] == "empty":
            lines.append(f"| {r['what']} | | {r['us']:.2f} | | | | 1.0 |")
        elif "us" in r:
            gb = f"{r['GBps']:.0f}" if "GBps" in r else ""
            cp = f"{r['copy_pct']:.0f}" if "copy_pct" in r else ""
            share = f"{r['GBps'] / (10 * COPY_TBPS):.0f}" if "GBps" in r else ""
            lines.append(f"| {r['op']} | {size_label(r)} | {r['us']:.2f} | {gb} | {cp} | {share} "
                         f"| {r['vs_empty']:.1f} |")
    steps = _step_rows(rows)
    if steps:
        lines += ["", "| B | context | impl | " + " | ".join(h for h, _, _ in STEP_COLUMNS) + " |",
                  "|---:|---:|---|" + "---:|" * len(STEP_COLUMNS)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in steps]
    return lines


def plot(data, path, ui) -> None:
    """GB/s against rows, a line per op (and impl), the run's fastest copy
    as the ceiling; a PNG at `path` (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        ui.line("matplotlib is not installed: no plot (pip install 'dsv4-jax[cli]')")
        return
    rows = [r for r in data["rows"] if "GBps" in r]
    impls = {r["impl"] for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, impl in dict.fromkeys((r["op"], r["impl"]) for r in rows):
        pts = sorted((r["rows"], r["GBps"]) for r in rows if (r["op"], r["impl"]) == (op, impl))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=op if len(impls) == 1 else f"{op} ({impl})")
    ceiling = data.get("copy_gbps")
    if ceiling:
        ax.axhline(ceiling, color="k", linestyle="--", label=f"copy ceiling {ceiling:,.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens, gathered rows or entries per call)")
    ax.set_ylabel("GB/s (bytes moved / time)")
    ax.set_title(f"dsv4_jax ops on {data['device']}: bandwidth against rows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    ui.line(f"plot written to {path}")
