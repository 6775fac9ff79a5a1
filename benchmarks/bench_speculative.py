"""Speculative steps on the GPU (docs/design/speculative.md): a V4-Flash verify +
commit step against a plain decode step's cache-and-attention work, and the
commit alone per layer.

    python benchmarks/bench_speculative.py --json speculative.json   # B 64, k 3, 64k
    python benchmarks/bench_speculative.py --indexer-rows 1          # a CTA a verify row
    python benchmarks/bench_speculative.py --quick                   # CPU-sized smoke run

Every request holds `context` tokens (filled_state: random valid entries, a
full ring); the plain step's token and the speculative step's first row sit
at position context - 1, so both close a CSA and an HCA window. Per layer:

  plain        write_layer (B rows), indexer_topk (CSA, k = top-k), attention
               (B queries of H heads; CSA on the picks, HCA on every entry)
  speculative  verify_begin; per layer verify_layer, indexer_topk and
               attention with chunk_kv (B (1 + k) rows; indexer_topk's
               rows_per_request `--indexer-rows`, default min(1 + k, 8): a
               request's rows scored by one CTA); verify_commit (a random
               1 .. 1 + k kept a request); per layer write_layer of the kept
               rows
  commit       verify_commit and the kept rows' write_layer on every layer,
               from a VerifyStep taken once (the copy written back each call)
  restore      verify_commit alone (the copy back and the block-table rows)
  begin        verify_begin alone (the copy out)

Every call of a program starts from the state the last one left, at the same
positions: after the first speculative call the ring holds the kept rows from
p0 on, so the next call's first rows find up to 3 of their 128 window rows
holding later positions, and attention counts them STALE_WINDOW (the error
counts printed) and skips them: a rewind, as docs/design/bad-input.md counts
it, not a fault of the verify pass, and a few rows less work a query.

Layers 3 .. 42 run as a `lax.scan` over the (HCA, CSA) pair with a traced
layer index, as a model keeps its compile time down; one jit a program, the
state donated. Times come from the device timeline (span of one call's
kernels, the median over `--reps` traced calls; dispatch left out), on the
CPU from the host; on the GPU each row also gives the busy time of each op
family (`family_us`) and indexer_topk's own time (`indexer_span_us`: each
call's score start to its select's end, summed over the step's CSA layers;
the family's busy time overstates it, as the overlapped select's CTAs count
while they wait), printed for the plain and the speculative step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax as dj  # noqa: E402
from dsv4_jax.app.arguments import output_path  # noqa: E402
from dsv4_jax.app.bench.device_timeline import kernel_events, timeline_summary  # noqa: E402
from dsv4_jax.app.bench.filled_state import filled_state  # noqa: E402
from dsv4_jax.ops.indexer import MAX_ROWS_PER_REQUEST  # noqa: E402

F32 = jnp.float32
HEAD_DIM, INDEX_HEADS, INDEX_DIM = 512, 64, 128
SWA, CSA, HCA = "swa", "csa", "hca"


# ---- inputs ----------------------------------------------------------------------------------
def step_rows(B, rows, context, seed):
    """The operands of `rows` tokens a request at positions context - 1 ...:
    metadata (no new blocks: the filled table maps every block) and what the
    model hands the cache and attention, the same for every layer."""
    rng = np.random.default_rng(seed)
    normal = lambda shape, dtype=F32: jnp.asarray(rng.standard_normal(shape), dtype)
    slot = np.repeat(np.arange(B, dtype=np.int32), rows)
    pos = np.tile(np.arange(rows, dtype=np.int32), B) + context - 1
    lengths = np.full(B, context - 1 + rows, np.int32)
    T = B * rows
    return {"meta": dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=lengths),
            "kv": normal((T, HEAD_DIM), jnp.bfloat16),
            "csa_kv": normal((T, 2 * HEAD_DIM)), "csa_score": normal((T, 2 * HEAD_DIM)),
            "hca_kv": normal((T, HEAD_DIM)), "hca_score": normal((T, HEAD_DIM)),
            "index_kv": normal((T, 2 * INDEX_DIM)), "index_score": normal((T, 2 * INDEX_DIM)),
            "iq": normal((T, INDEX_HEADS, INDEX_DIM), jnp.bfloat16),
            "iw": normal((T, INDEX_HEADS)),
            "params": {CSA: dj.CompressorParams.neutral(CSA), HCA: dj.CompressorParams.neutral(HCA)},
            "inv_freq": jnp.asarray(dj.yarn_inv_freq())}


def queries(T, H, seed):
    rng = np.random.default_rng(seed + 1)
    q = rng.standard_normal((T, H, HEAD_DIM)).astype(np.float32)
    q /= np.sqrt(np.mean(q * q, axis=-1, keepdims=True))
    return jnp.asarray(q, jnp.bfloat16), jnp.asarray(rng.normal(0, 1, H), F32)


def compressor(x, kind):
    """write_layer's / verify_layer's compressor operands of a layer kind."""
    if kind == SWA:
        return (), {}
    extra = {"index_kv": x["index_kv"], "index_score": x["index_score"]} if kind == CSA else {}
    name = "csa" if kind == CSA else "hca"
    return (x[f"{name}_kv"], x[f"{name}_score"], x["params"][kind]), extra


# ---- the layer loop --------------------------------------------------------------------------
def layer_plan(kinds):
    """(prefix, unit, repeats): kinds = kinds[:prefix] + unit * repeats."""
    unit, n, L = tuple(kinds[-2:]), 0, len(kinds)
    while 2 * (n + 1) <= L and tuple(kinds[L - 2 * (n + 1):L - 2 * n]) == unit:
        n += 1
    return L - 2 * n, unit, n


def over_layers(kinds, carry, per_layer):
    """per_layer(carry, layer, kind) -> carry on every layer: the prefix
    unrolled, the repeated pair in a lax.scan (traced layer index)."""
    prefix, unit, repeats = layer_plan(kinds)
    for layer in range(prefix):
        carry = per_layer(carry, layer, kinds[layer])

    def body(c, i):
        for j, kind in enumerate(unit):
            c = per_layer(c, jnp.int32(prefix + j) + len(unit) * i, kind)
        return c, None
    if repeats:
        carry, _ = jax.lax.scan(body, carry, jnp.arange(repeats, dtype=jnp.int32))
    return carry


def attend(s, h, layer, kind, x, m, q, sink, topk, chunk_kv, indexer_rows=1):
    """indexer_topk (CSA; `indexer_rows` its rows_per_request) and attention
    of the rows of `m`; folds the output into h so XLA keeps it."""
    idx = None
    if kind == CSA:
        idx, s = dj.indexer_topk(s, layer, m.token_slot, m.token_pos, x["iq"], x["iw"], topk,
                                 rows_per_request=indexer_rows)
    out, lse, s = dj.attention(s, layer, q, m.token_slot, m.token_pos, sink=sink, topk=idx,
                               chunk_kv=chunk_kv, rope_inv_freq=x["inv_freq"], kind=kind)
    return s, h + jnp.sum(out[:, 0, :8].astype(F32))


# ---- the programs ----------------------------------------------------------------------------
def programs(cfg, drafts, indexer_rows):
    kinds, topk = cfg.layer_kinds, cfg.index_topk

    def plain(s, x, q, sink):
        def layer_fn(c, layer, kind):
            s, h = c
            comp, extra = compressor(x, kind)
            s = dj.write_layer(s, layer, x["meta"], x["kv"], *comp, **extra)
            return attend(s, h, layer, kind, x, x["meta"], q, sink, topk, None)
        return over_layers(kinds, (s, F32(0)), layer_fn)

    def write_kept(s, kept, x):
        def layer_fn(s, layer, kind):
            comp, extra = compressor(x, kind)
            return dj.write_layer(s, layer, kept, x["kv"], *comp, **extra)
        return over_layers(kinds, s, layer_fn)

    def speculative(s, x, q, sink, accepted):
        spec = dj.verify_begin(s, x["meta"], drafts=drafts)

        def layer_fn(c, layer, kind):
            s, h = c
            comp, extra = compressor(x, kind)
            s = dj.verify_layer(s, layer, spec, *comp, **extra)
            return attend(s, h, layer, kind, x, spec.verified, q, sink, topk, x["kv"],
                          indexer_rows)
        s, h = over_layers(kinds, (s, F32(0)), layer_fn)
        s, kept = dj.verify_commit(s, spec, accepted)
        return write_kept(s, kept, x), h

    def commit(s, spec, accepted, x):
        s, kept = dj.verify_commit(s, spec, accepted)
        return write_kept(s, kept, x), kept.data[0]

    def restore(s, spec, accepted):
        s, kept = dj.verify_commit(s, spec, accepted)
        return s, kept.data[0]

    donate = dict(donate_argnums=0)
    return {"plain": jax.jit(plain, **donate), "speculative": jax.jit(speculative, **donate),
            "commit": jax.jit(commit, **donate), "restore": jax.jit(restore, **donate),
            "begin": jax.jit(lambda s, m: dj.verify_begin(s, m, drafts=drafts))}


# ---- timing ----------------------------------------------------------------------------------
def timed(call, reps, layers):
    """{host_ms, and on a GPU the timeline summary of `reps` calls} of call()."""
    jax.block_until_ready(call())
    samples = []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        samples.append(time.perf_counter() - t0)
    row = {"host_ms": statistics.median(samples) * 1e3}
    events = kernel_events(call, runs=reps)
    if events:
        summary = timeline_summary(events, reps, layers)
        row.update({k: summary[k] for k in ("span_us", "busy_us", "family_us", "indexer_span_us",
                                            "kernels_per_step", "split")})
        row["kernels"] = summary["kernels"][:12]
    return row


def run_case(args, B, context, drafts):
    preset = {"flash": dj.CacheConfig.flash, "pro": dj.CacheConfig.pro,
              "tiny": dj.CacheConfig.tiny}[args.model]
    # room for the drafts past the filled context: one more block a request
    cfg = preset(max_requests=B, max_context=context + dj.config.BLOCK_TOKENS)
    box = [filled_state(cfg, context, args.seed)]
    L = cfg.num_layers
    indexer_rows = args.indexer_rows or min(1 + drafts, MAX_ROWS_PER_REQUEST)
    progs = programs(cfg, drafts, indexer_rows)
    one = step_rows(B, 1, context, args.seed)
    many = step_rows(B, 1 + drafts, context, args.seed)
    q1, sink = queries(B, args.heads, args.seed)
    qk, _ = queries(B * (1 + drafts), args.heads, args.seed)
    rng = np.random.default_rng(args.seed)
    accepted = jnp.asarray(rng.integers(1, 2 + drafts, B), jnp.int32)
    base = dict(model=cfg.model, B=B, context=context, drafts=drafts, heads=args.heads,
                kept_tokens=int(np.sum(accepted)), verified_tokens=B * (1 + drafts),
                indexer_rows=indexer_rows)
    rows = []

    def record(name, call, per_layer=False):
        row = dict(base, program=name, **timed(call, args.reps, L))
        if per_layer and "span_us" in row:
            row["span_us_per_layer"] = row["span_us"] / L
        row["errors"] = [int(e) for e in np.asarray(box[0].errors)]
        rows.append(row)
        span = f", span {row['span_us']:.1f} us" if "span_us" in row else ""
        if "family_us" in row and name in ("plain", "speculative"):
            span += f", indexer {row['indexer_span_us']:.1f} us"
        print(f"B={B} context={context} k={drafts} {name}: host {row['host_ms']:.3f} ms{span}"
              + (" ERROR COUNTS " + str(row["errors"]) if any(row["errors"]) else ""),
              flush=True)

    def plain():
        box[0], h = progs["plain"](box[0], one, q1, sink)
        return h

    def speculative():
        box[0], h = progs["speculative"](box[0], many, qk, sink, accepted)
        return h
    record("plain", plain)
    record("speculative", speculative)
    spec = progs["begin"](box[0], many["meta"])
    record("begin", lambda: progs["begin"](box[0], many["meta"]).ids)

    def commit():
        box[0], out = progs["commit"](box[0], spec, accepted, many)
        return out

    def restore():
        box[0], out = progs["restore"](box[0], spec, accepted)
        return out
    record("commit", commit, per_layer=True)
    record("restore", restore, per_layer=True)
    by = {r["program"]: r for r in rows}
    key = "span_us" if "span_us" in by["plain"] else "host_ms"
    ratio = by["speculative"][key] / by["plain"][key]
    per_layer = (by["commit"][key] / L) * (1 if key == "span_us" else 1e3)
    indexer = ({f"indexer_us_{p}": by[p]["indexer_span_us"] for p in ("plain", "speculative")}
               if "family_us" in by["plain"] else {})
    rows.append(dict(base, program="summary", measure=key, speculative_over_plain=ratio,
                     commit_us_per_layer=per_layer, **indexer,
                     target_ratio=1.5, target_commit_us_per_layer=10.0))
    print(f"  speculative / plain: {ratio:.2f}x (target <= 1.5x); commit "
          f"{per_layer:.2f} us a layer (target <= 10) [{key}]", flush=True)
    box.clear()
    gc.collect()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny layers, small sizes (a smoke run)")
    ap.add_argument("--model", default=None, choices=["flash", "pro", "tiny"])
    ap.add_argument("--batch", type=int, nargs="*", default=None, help="B (default 64)")
    ap.add_argument("--context", type=int, nargs="*", default=None, help="default 65536")
    ap.add_argument("--drafts", type=int, nargs="*", default=None, help="k (default 3)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (V4-Flash: 64)")
    ap.add_argument("--indexer-rows", type=int, default=None,
                    help="indexer_topk's rows_per_request in the verify step (default min(1 + k, "
                         f"{MAX_ROWS_PER_REQUEST}); 1: a CTA a row, as before it existed)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=output_path, help="write the rows to this file")
    args = ap.parse_args(argv)
    quick = args.quick
    args.model = args.model or ("tiny" if quick else "flash")
    args.heads = args.heads or (4 if quick else 64)
    args.reps = args.reps or (2 if quick else 10)
    rows = []
    for B in args.batch or ([2] if quick else [64]):
        for context in args.context or ([256] if quick else [65536]):
            for drafts in args.drafts or [3]:
                rows += run_case(args, B, context, drafts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": jax.default_backend(), "devices": str(jax.devices()),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
