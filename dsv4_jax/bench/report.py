"""A benchmark run's rows for people: the summary tables (through the
command line's UI), the markdown tables of benchmarks/RESULTS.md, and the
plot of bandwidth against rows."""
from __future__ import annotations

COPY_TBPS = 3.0   # device-to-device copy rate of the lent H100s (KINDS.md), bytes read + written


def size_detail(r):
    """What made an op row's size: the flush case, or the shape behind the rows."""
    if "case" in r:
        t = r.get("rows", r.get("T"))     # runs saved before rows were kept for flush: T
        return r["case"] if f"T={t}" in r["case"] else f"{r['case']} T={t}"
    return ", ".join(f"{k}={r[k]}" for k in ("B", "T", "k", "E") if k in r)


def size_label(r):
    """The size column of the markdown tables."""
    if "case" in r:
        return size_detail(r)
    made = size_detail(r)
    return f"{r['rows']} rows" + (f" ({made})" if made else "")


def _empty(rows):
    return next((r for r in rows if r["op"] == "empty"), None)


# The decode-step columns: (row key, heading, format); the timeline's exist on a GPU only
STEP_COLUMNS = (("ms", "ms/step", ".3f"), ("span_us", "span µs", ".1f"),
                ("busy_us", "busy µs", ".1f"), ("cache_busy_us", "cache+copy busy µs", ".1f"),
                ("kernels_per_layer", "kernels/layer", ".2f"),
                ("cache_kernels_per_layer", "cache+copy kernels/layer", ".2f"))


def _step_rows(rows):
    """The decode-step rows, one a (B, context, impl): [B, context, impl, cells]."""
    return [[r["B"], r["ctx"], r["impl"]] + [format(r[k], f) if r.get(k) is not None else "–"
                                              for k, _, f in STEP_COLUMNS]
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
        ui.table("V4-Flash decode step as a model runs it (43 layers of cache work, outputs "
                 "consumed)", ["B", "context", "impl"] + [h for _, h, _ in STEP_COLUMNS], steps)


def markdown(rows):
    """The per-op table and the decode-step table of benchmarks/RESULTS.md, as lines."""
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
        lines += ["", "| B | context | impl | " + " | ".join(h for _, h, _ in STEP_COLUMNS) + " |",
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
