"""GPU kernels of a jitted call as they ran: start, duration and name of each
(CUPTI activity records read back through jax.profiler), so that a timing
can leave out what the host adds (dispatch, the final sync) and a kernel's
time can be told from its neighbours'; and what a run of identical steps
spent where (cache kernels, the copies XLA adds between calls, the rest).

    events = kernel_events(fn, *args)     # [] where there is no GPU
"""
from __future__ import annotations

import glob
from collections import Counter
import os
import shutil
import statistics
import tempfile

import jax
from jax.profiler import ProfileData

KINDS = ("cache", "copy", "other")


def kernel_name(demangled):
    """AppendKernel of 'dsv4::(anonymous namespace)::AppendKernel(
    dsv4::(anonymous namespace)::AppendArgs)': the parameter list ends at
    the parenthesis matching the final one (the last '(' can sit inside it,
    as in '(anonymous namespace)'), the name is what follows the last '::'
    before it, a template's arguments kept whole ('AttentionKernel<
    dsv4::cuda::wgmma::Products>')."""
    cut = _matching_open(demangled, "(", ")") if demangled.endswith(")") else len(demangled)
    head = demangled[:cut]
    args = _matching_open(head, "<", ">") if head.endswith(">") else len(head)
    return head[:args].split("::")[-1] + head[args:]


def _matching_open(text, open_, close):
    """Index of the bracket that opens the one `text` ends with."""
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {close: 1, open_: -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def kernel_kind(demangled):
    """"cache" (a dsv4 kernel), "copy" (memcpy and copy kernels, what XLA
    adds between calls) or "other" (XLA's own fusions: the caller's work on
    what the ops return, index arithmetic)."""
    if "dsv4" in demangled:
        return "cache"
    low = demangled.lower()
    return "copy" if "copy" in low or "memcpy" in low else "other"


# Op families of the dsv4 kernels, by the start of their names (cuda/): what
# a step's device time is spent on. Anything else is a copy or "other".
FAMILIES = (("attention", ("Attention",)),
            ("indexer", ("ScoreKernel", "SelectKernel")),
            ("writes", ("WriteLayer", "Append", "Flush", "BlockTable", "ResetAndScrub")),
            ("gathers", ("Gather",)))
FAMILY_NAMES = tuple(f for f, _ in FAMILIES) + ("copies", "other")


def kernel_family(demangled):
    """The op family of a kernel: attention, indexer (score and select),
    writes (write_layer, append, flush, apply_step), gathers, copies, or
    other (XLA's own fusions, and a dsv4 kernel of none of these)."""
    kind = kernel_kind(demangled)
    if kind == "copy":
        return "copies"
    if kind == "cache":
        name = kernel_name(demangled)
        for family, starts in FAMILIES:
            if name.startswith(starts):
                return family
    return "other"


def kernel_events(fn, *args, runs=1):
    """[(start_ns, duration_ns, demangled name)] of the GPU activity of
    `runs` calls of fn(*args), sorted by start (fn is called once before, so
    compiling is not traced). Only the streams' lines: the profiler's "XLA
    Modules" and "XLA Ops" lines of the same device repeat the kernels' time
    spans."""
    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(d):
            for _ in range(runs):
                jax.block_until_ready(fn(*args))
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        events = []
        for f in files:
            for plane in ProfileData.from_file(f).planes:
                if not plane.name.startswith("/device:GPU"):
                    continue
                for line in plane.lines:
                    if line.name.startswith("XLA"):
                        continue
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return sorted(events)


def kernel_spans(events, name):
    """(start, end) in µs of each kernel whose name holds `name`, in order."""
    return [(s / 1e3, (s + d) / 1e3) for s, d, n in events if name in n]


def two_kernel_phases(events, first, second):
    """Medians in µs over the calls of a two-kernel op traced in a loop (the
    kernel whose name holds `first`, then the one holding `second`, once a
    call): the first kernel's duration, the second's tail (its end less the
    first's end: what it adds once the first is done), the span (the first's
    start to the second's end) and the period (one first start to the next).
    None where a kernel is missing."""
    def med(xs):
        return statistics.median(xs) if xs else None

    a, b = kernel_spans(events, first), kernel_spans(events, second)
    pairs = list(zip(a, b))
    return {"first_us": med([e - s for s, e in a]),
            "tail_us": med([be - ae for (_, ae), (_, be) in pairs]),
            "span_us": med([be - as_ for (as_, _), (_, be) in pairs]),
            "period_us": med([y[0] - x[0] for x, y in zip(a, a[1:])])}


def split_steps(events, steps):
    """The events of `steps` identical calls traced back to back, one list a
    call: each launches the same kernels, so they split by count. None if
    the count does not divide."""
    if not events or len(events) % steps:
        return None
    per = len(events) // steps
    return [events[i * per:(i + 1) * per] for i in range(steps)]


def timeline_summary(events, steps, layers):
    """Per step, from the events of `steps` identical steps of `layers`
    layers: kernel counts (all, per layer; per layer cache kernels with the
    copies, and the others; copies a step and a layer), busy time (sum of
    durations: all, cache kernels with copies, and per op family:
    `family_us`, kernel_family) and span (first start to last end, the median
    over the steps), and per kernel name: kind, count, total and mean
    microseconds. If the events do not split into steps, the span is that of
    the whole trace over `steps` and `split` says so."""
    chunks = split_steps(events, steps)
    if chunks:
        span = statistics.median((max(s + d for s, d, _ in c) - c[0][0]) / 1e3 for c in chunks)
    else:
        span = (max(s + d for s, d, _ in events) - events[0][0]) / 1e3 / steps
    names = {}
    for _, d, raw in events:
        row = names.setdefault(kernel_name(raw), {"kind": kernel_kind(raw), "count": 0, "ns": 0})
        row["count"] += 1
        row["ns"] += d
    table = sorted(({"name": k, "kind": v["kind"], "count": v["count"] / steps,
                     "total_us": v["ns"] / 1e3 / steps, "mean_us": v["ns"] / 1e3 / v["count"]}
                    for k, v in names.items()), key=lambda r: -r["total_us"])
    count = {kind: sum(r["count"] for r in table if r["kind"] == kind) for kind in KINDS}
    family_us = dict.fromkeys(FAMILY_NAMES, 0.0)
    for _, d, raw in events:
        family_us[kernel_family(raw)] += d / 1e3 / steps
    # indexer_topk's own time: each call's score start to its select's end.
    # Its busy time (family_us) overstates it: the select is launched
    # overlapped, and its CTAs count as busy while they wait for the score.
    calls = zip(kernel_spans(events, "ScoreKernel"), kernel_spans(events, "SelectKernel"))
    indexer_span = sum(select[1] - score[0] for score, select in calls) / steps
    n = len(events) / steps
    return {"kernels_per_step": n, "kernels_per_layer": n / layers,
            "indexer_span_us": indexer_span,
            "cache_kernels_per_layer": (count["cache"] + count["copy"]) / layers,
            "other_kernels_per_layer": count["other"] / layers,
            "copy_kernels_per_step": count["copy"],
            "copy_kernels_per_layer": count["copy"] / layers,
            "busy_us": sum(d for _, d, _ in events) / 1e3 / steps,
            "cache_busy_us": sum(r["total_us"] for r in table if r["kind"] != "other"),
            "family_us": family_us,
            "span_us": span, "split": chunks is not None, "kernels": table}


def kernel_sequence(step, layers, first, count=2):
    """The kernels of layers first .. first+count-1 of one step's events, in
    order: name, kind, start (µs from the first), duration and gap (µs from
    the previous kernel's end; the first one's from the kernel before it).
    A layer starts where the step's first cache kernel (its write) launches
    again: each layer writes its token once, so that kernel launches
    `layers` times a step. Each layer's window thus ends with the XLA work
    that sits before the next layer's write. ([], reason) where the step does
    not have that shape, (rows, None) otherwise."""
    writer = next((kernel_name(n) for _, _, n in step if kernel_kind(n) == "cache"), None)
    starts = [i for i, (_, _, n) in enumerate(step)
              if kernel_kind(n) == "cache" and kernel_name(n) == writer]
    if writer is None or len(starts) != layers:
        return [], (f"{len(starts)} launches of {writer} for {layers} layers: no layer "
                    "boundaries")
    if first + count > layers:
        return [], f"layers {first}..{first + count - 1} of {layers}"
    lo = starts[first]
    hi = starts[first + count] if first + count < layers else len(step)
    t0 = step[lo][0]
    rows = []
    for i in range(lo, hi):
        start, dur, raw = step[i]
        prev_end = step[i - 1][0] + step[i - 1][1] if i else start
        rows.append({"name": kernel_name(raw), "kind": kernel_kind(raw),
                     "start_us": (start - t0) / 1e3, "us": dur / 1e3,
                     "gap_us": (start - prev_end) / 1e3})
    return rows, None


def device_time(call, reps):
    """One call of `call` on the GPU's timeline, over `reps` traced calls
    (after one untraced): {"us": span from its first launch's start to its
    last one's end, "busy_us": the launches' summed durations (medians over
    the calls), "launches": kernels and memcpys a call, "kernels": {name:
    count a call}, "split": whether the events split into identical calls
    (if not, "us" is the whole trace's span over `reps`, gaps between calls
    included)}. None where there is no GPU."""
    events = kernel_events(call, runs=reps)
    if not events:
        return None
    calls = split_steps(events, reps)
    if calls:
        us = statistics.median((max(t + d for t, d, _ in c) - c[0][0]) / 1e3 for c in calls)
        busy = statistics.median(sum(d for _, d, _ in c) / 1e3 for c in calls)
    else:
        us = (max(t + d for t, d, _ in events) - events[0][0]) / 1e3 / reps
        busy = sum(d for _, d, _ in events) / 1e3 / reps
    names = Counter(kernel_name(n) for _, _, n in events)
    return {"us": us, "busy_us": busy, "launches": len(events) / reps,
            "kernels": {k: v / reps for k, v in names.most_common()}, "split": calls is not None}
