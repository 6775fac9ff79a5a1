"""`python -m dsv4_jax [demo|plan|bench|info]`.

demo   build a cache, run chunked prefill and a jitted decode loop over several
       requests, print throughput and memory, check the cache against the jnp
       reference (PASS / FAIL, exit code 1 on FAIL)
plan   memory plan of a model at a context length and number of requests
bench  time every op and a V4-Flash decode step on the default device: a table,
       a JSON of the numbers and a PNG plot (dsv4_jax/bench)
info   versions and which FFI modules loaded

Tables and progress bars use `rich` and the plot `matplotlib` when installed
(`pip install "dsv4-jax[cli]"`); without them the output is plain text and
the plot is skipped.
"""
from __future__ import annotations

import argparse
import json
import sys

from .. import _ffi
from .. import config as C
from ..config import PRESETS, CacheConfig
from ..memory import MIB, memory_report
from .arguments import nonnegative_int, output_path, positive_float, positive_int
from .ui import UI

GIB = 1024 ** 3
# DeepSeek-V3.2's MLA cache: 512 fp8 values + 4 fp32 scales + 64 bf16 RoPE
# channels per token per layer.
MLA_BYTES_PER_TOKEN_LAYER = 656


class CliError(Exception):
    """An error the command line reports in one line (exit code 2)."""


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.2f} B"


# ---- demo -------------------------------------------------------------------------------
# The demo replays every step through the jnp reference: beyond this many
# steps it stops being a demo (hours on a CPU).
DEMO_MAX_STEPS = 4096
# ... and every token of every layer: beyond this many token-layers (requests
# x context x layers) a run and its replay take many minutes. The CPU's is 32
# times the default demo's (128 requests of 512 tokens: about 75 s on 2
# cores), the GPU's 48 times.
DEMO_MAX_WORK = {"cpu": 2 ** 18, "gpu": 2 ** 25}


def _demo_defaults(args) -> set:
    """Fill options left unset: tiny on the CPU, the flash layer pattern
    (with fewer, shorter requests than in serving) on an accelerator.
    Returns the names filled."""
    import jax
    on_cpu = jax.default_backend() == "cpu"
    defaults = (dict(model="tiny", requests=4, context=512, steps=32, chunk=64) if on_cpu else
                dict(model="flash", requests=4, context=4096, steps=64, chunk=128))
    filled = set()
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            filled.add(name)
    return filled


def _memory_budget() -> tuple[int, str] | None:
    """(bytes the demo may use, where) on the default device: the GPU's
    memory limit, or the host's available memory on the CPU; None if unknown."""
    import jax
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return (int(limit), f"{device.platform.upper()} memory") if limit else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory"
    except OSError:
        pass
    return None


def _demo_limits(args, preset) -> None:
    """Refuse, before anything runs, a demo that cannot fit in memory or
    would take more than DEMO_MAX_STEPS steps; name the largest context that
    would do."""
    steps_room = DEMO_MAX_STEPS - args.steps
    if steps_room < 1:
        raise CliError(f"--steps {args.steps:,}: the demo runs at most {DEMO_MAX_STEPS:,} steps")
    # prefill steps: ceil(longest prompt / chunk), the longest prompt being
    # at most context - steps tokens
    by_steps = steps_room * args.chunk + args.steps * (1 + args.speculative)
    budget = _memory_budget()

    def state_bytes(context):
        cfg = preset(max_requests=args.requests, max_context=context, kv_format=args.kv_format)
        return memory_report(cfg).total

    # Two states live at once: the run's and the reference replay's.
    fits = (lambda ctx: True) if budget is None else (lambda ctx: 2 * state_bytes(ctx) <= budget[0])
    if args.context <= by_steps and fits(args.context):
        return
    lo, hi = 0, min(args.context, by_steps) // C.BLOCK_TOKENS   # largest whole-block context that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * C.BLOCK_TOKENS) else (lo, mid - 1)
    largest = lo * C.BLOCK_TOKENS
    if args.context > by_steps:
        steps = -(-(args.context - args.steps) // args.chunk) + args.steps
        reason = (f"with --chunk {args.chunk} it takes up to {steps:,} steps, more than the "
                  f"demo's {DEMO_MAX_STEPS:,}")
    else:
        reason = (f"the run and its reference replay need 2 x {_bytes(state_bytes(args.context))} "
                  f"of cache, more than the {_bytes(budget[0])} of {budget[1]}")
    hint = (f"the largest that fits is {largest:,}" if largest >= 2 * C.CSA_RATIO else
            "fewer --requests would help")
    raise CliError(f"--context {args.context:,}: {reason}; {hint}")


def _demo_work(args, preset) -> None:
    """Refuse, before anything runs, a demo whose run and reference replay
    would take many minutes: more token-layers than DEMO_MAX_WORK allows on
    this platform; name the most requests that fit."""
    import jax
    platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
    layers = preset(max_requests=1, max_context=C.BLOCK_TOKENS).num_layers
    per_request = args.context * layers
    work, budget = (args.requests + args.preempt) * per_request, DEMO_MAX_WORK[platform]
    if work <= budget:
        return
    largest = budget // per_request - args.preempt
    hint = (f"the most that fit are --requests {largest:,} (or a shorter --context)"
            if largest >= 1 else "a shorter --context would help")
    raise CliError(f"--requests {args.requests:,}: {args.requests + args.preempt:,} requests of "
                   f"up to {args.context:,} tokens through {layers} layers are {work:,} "
                   f"token-layers for the run and its reference replay, more than the demo's "
                   f"{budget:,} on a {platform.upper()} (it would take many minutes); {hint}")


def cmd_demo(args, parser) -> int:
    """Chunked prefill and a jitted decode loop over several requests, checked
    against the jnp reference."""
    if args.model == "hf-tiny":     # the attention block against Hugging Face's outputs
        from ..block.demo import run_demo
        return run_demo(args.impl)
    filled = _demo_defaults(args)
    if args.context < 2 * C.CSA_RATIO:
        parser.error(f"--context: expected at least {2 * C.CSA_RATIO} tokens, got {args.context}")
    if args.context > C.MAX_CONTEXT:
        parser.error(f"--context: positions are int32, expected at most {C.MAX_CONTEXT:,} "
                     f"tokens, got {args.context:,}")
    from ..speculative import MAX_DRAFTS
    if args.speculative > MAX_DRAFTS:
        parser.error(f"--speculative: expected at most {MAX_DRAFTS} drafts, got {args.speculative}")
    verified = 1 + args.speculative          # positions a decode step takes at most
    if args.steps * verified >= args.context:
        if "steps" not in filled:
            per_step = f" / {verified} positions a step" if args.speculative else ""
            parser.error(f"--steps: expected fewer decode steps than --context "
                         f"({args.context}){per_step}, got {args.steps}")
        args.steps = args.context // (2 * verified)   # the default leaves room for the prompts
    import jax
    from . import demo
    from ..ops.dispatch import auto_means, resolve_impl

    try:
        impl = resolve_impl(args.impl, "dsv4_flush_csa")
    except ValueError as e:
        parser.error(f"--impl {args.impl}: {str(e).removeprefix('impl: ')}")
    asked_reference = args.impl == "reference" or (args.impl == "auto" and auto_means() == "reference")
    if impl == "reference" and not asked_reference:
        # The demo exists to check the compiled handlers: running the
        # reference against itself would PASS and test nothing.
        platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
        raise CliError(f"no FFI handlers to check on {platform}: "
                       f"{_ffi.missing_module_reason(platform)} "
                       f"(--impl reference checks the jnp reference against itself)")
    _demo_limits(args, PRESETS[args.model])
    _demo_work(args, PRESETS[args.model])

    ui = UI(plain=args.plain)
    # a slot per preempted request beyond the running ones: each comes back
    # into a slot it never held, so the check covers the whole move
    cfg = PRESETS[args.model](max_requests=args.requests + args.preempt,
                               max_context=args.context, kv_format=args.kv_format)
    prompts = demo.prompt_lengths(cfg, args.requests, args.steps, args.seed, args.speculative)
    if args.preempt > args.requests:
        parser.error(f"--preempt: expected at most --requests ({args.requests}), got {args.preempt}")
    if args.preempt and args.steps < 2:
        parser.error("--preempt: needs at least 2 decode steps (--steps) to preempt mid-decode")
    settings = demo.DemoSettings(prompts, args.chunk, args.steps, args.seed, args.corrupt_at_step,
                                 args.preempt, args.speculative)
    plan = demo.schedule(settings)
    if args.corrupt_at_step is not None and args.corrupt_at_step >= len(plan):
        parser.error(f"--corrupt-at-step: expected a step < {len(plan)}, got {args.corrupt_at_step}")
    ui.line(f"dsv4_jax demo: model {cfg.model} ({cfg.num_layers} layers: {len(cfg.layers_of(C.SWA))} "
            f"SWA, {cfg.num_csa} CSA, {cfg.num_hca} HCA), kv_format {cfg.kv_format}, "
            f"backend {jax.default_backend()}, ops: {impl}")
    ui.line(f"{args.requests} requests, prompts {list(prompts)} tokens, prefill chunks of "
            f"{args.chunk}, then {args.steps} decode steps (context {cfg.max_context})")

    if args.speculative:
        ui.line(f"each decode step verifies {args.speculative} random draft"
                f"{'s' if args.speculative > 1 else ''} a request (verify_begin, verify_layer, "
                f"verify_commit) and keeps a random 0 .. {1 + args.speculative} of its "
                f"{1 + args.speculative} tokens")
    parked = settings.parked_steps()
    if parked:
        ui.line(f"the first {args.preempt} request{'s' if args.preempt > 1 else ''} preempted to "
                f"host memory before decode step {parked.start} and resumed into other slots "
                f"and blocks before step {parked.stop}")

    with ui.progress(f"run ({impl})", len(plan)) as advance:
        ours = demo.run(cfg, settings, impl=args.impl, progress=advance)
    with ui.progress("reference replay", len(plan)) as advance:
        ref = demo.run(cfg, settings, impl="reference", metas=ours.metas, progress=advance,
                       moves=ours.moves, accepted=ours.accepted)

    rows = []
    for name, ph in ours.phases.items():
        if ph.steps:
            rows.append([name, ph.steps, f"{ph.tokens:,}", f"{ph.seconds:.3f}",
                         f"{ph.steps / ph.seconds:,.1f}", f"{ph.seconds / ph.steps * 1e3:.2f}",
                         f"{ph.tokens / ph.seconds:,.0f}"])
    ui.table(f"throughput ({impl}, compile {ours.compile_seconds:.1f} s not included)",
             ["phase", "steps", "tokens", "seconds", "steps/s", "ms/step", "tokens/s"], rows)
    rep = memory_report(cfg)
    lengths = [ours.manager.length_of(r) for r in ours.manager.requests]
    emitted = demo.entries_emitted(cfg, lengths)
    used = cfg.num_blocks - ours.manager.free_blocks
    ui.table("cache", ["", "value"], [
        ["pool memory (whole state)", _bytes(rep.total)],
        ["blocks in use", f"{used} / {cfg.num_blocks}"],
        ["tokens cached", f"{sum(lengths):,} ({', '.join(map(str, lengths[:8]))}"
                          f"{', ...' if len(lengths) > 8 else ''})"],
        ["CSA entries emitted (all CSA layers)", f"{emitted['csa']:,}"],
        ["indexer keys emitted", f"{emitted['index']:,}"],
        ["HCA entries emitted (all HCA layers)", f"{emitted['hca']:,}"],
    ], numeric=False)
    check = demo.check_against(ours.state, ref.state)
    if impl == "reference":
        ui.line("note: --impl reference: both runs used the jnp reference, so no FFI handler "
                "was checked")
    ui.line(f"check against the reference: {'PASS' if check.ok else 'FAIL'} ({check.message})")
    return 0 if check.ok else 1


# ---- plan -------------------------------------------------------------------------------
def plan_numbers(cfg: CacheConfig, context: int, gpu_memory_gib: float) -> dict:
    """Every number `plan` prints, from memory_report (the JSON of --json)."""
    rep = memory_report(cfg)
    R = cfg.max_requests
    blocks = cfg.blocks_for_context(context)
    table_row = cfg.max_blocks_per_request * 4          # one block-table row, int32
    per_request = rep.per_request(context) + table_row
    mla = MLA_BYTES_PER_TOKEN_LAYER * cfg.num_layers * context
    budget = gpu_memory_gib * GIB
    layers = {k: len(cfg.layers_of(k)) for k in (C.SWA, C.CSA, C.HCA)}
    return {
        "model": cfg.model, "layers": cfg.num_layers, "layers_by_kind": layers,
        "context": context, "requests": R, "kv_format": cfg.kv_format,
        "pools": dict(rep.pools), "by_kind": dict(rep.by_kind), "total": rep.total,
        "window_per_request": rep.window_per_request,
        "compressor_per_request": rep.compressor_per_request,
        "per_block": rep.per_block, "per_token": rep.per_token,
        "blocks_per_request": blocks, "blocks_total": cfg.num_blocks,
        "block_table_per_request": table_row,
        "per_request": per_request, "per_token_all_in": per_request / context,
        "mla_per_request": mla, "mla_per_token": MLA_BYTES_PER_TOKEN_LAYER * cfg.num_layers,
        "mla_ratio": mla / per_request,
        "gpu_memory_gib": gpu_memory_gib,
        "fit_requests": int(budget // per_request), "fit_requests_mla": int(budget // mla),
    }


def cmd_plan(args, parser) -> int:
    """Memory plan: bytes per pool and layer kind, per request and per token;
    blocks; a V3.2-style MLA cache for comparison; requests that fit."""
    if args.context > C.MAX_CONTEXT:
        parser.error(f"--context: positions are int32, expected at most {C.MAX_CONTEXT:,} "
                     f"tokens, got {args.context:,}")
    try:
        cfg = PRESETS[args.model](max_requests=args.requests, max_context=args.context,
                                   kv_format=args.kv_format)
    except ValueError as e:   # num_blocks beyond int32: too many requests of that context
        parser.error(f"--requests {args.requests:,} x --context {args.context:,}: {e}")
    ui = UI(plain=args.plain)
    n = plan_numbers(cfg, args.context, args.gpu_memory)
    R, ctx = n["requests"], n["context"]
    lk = n["layers_by_kind"]
    ui.line(f"model {cfg.model}: {cfg.num_layers} layers ({lk['swa']} SWA, {lk['csa']} CSA, "
            f"{lk['hca']} HCA), {R} requests x {ctx:,} tokens, kv_format {cfg.kv_format}")
    rows = [[name, f"{b:,}", f"{b / MIB:,.2f}", f"{b / R:,.0f}", f"{b / (R * ctx):,.2f}"]
            for name, b in n["pools"].items()]
    rows.append(["total", f"{n['total']:,}", f"{n['total'] / MIB:,.2f}", f"{n['total'] / R:,.0f}",
                 f"{n['total'] / (R * ctx):,.2f}"])
    ui.table("state by pool", ["pool", "bytes", "MiB", "per request", "per token"], rows)
    # Every layer has a sliding window: those are one row over all layers,
    # and the csa / hca rows hold the compressed pools of their layers.
    label = {C.SWA: ("windows", cfg.num_layers), C.CSA: ("csa", lk[C.CSA]),
             C.HCA: ("hca", lk[C.HCA])}
    rows = [[*label[kind], f"{b:,}", f"{b / MIB:,.2f}", f"{b / R:,.0f}", f"{b / (R * ctx):,.2f}"]
            for kind, b in n["by_kind"].items()]
    ui.table("state by layer kind (windows: the sliding window of every layer; csa, hca: "
             "their compressed pools)",
             ["kind", "layers", "bytes", "MiB", "per request", "per token"], rows)
    ui.table(f"one request of {ctx:,} tokens", ["", "value"], [
        ["sliding windows (all layers)", f"{n['window_per_request']:,} B ({_bytes(n['window_per_request'])})"],
        ["compressor state", f"{n['compressor_per_request']:,} B ({_bytes(n['compressor_per_request'])})"],
        ["compressed pools", f"{n['blocks_per_request']:,} blocks x {n['per_block']:,} B "
                             f"= {_bytes(n['blocks_per_request'] * n['per_block'])}"],
        ["block table row", f"{n['block_table_per_request']:,} B"],
        ["total per request", f"{n['per_request']:,} B ({_bytes(n['per_request'])})"],
        ["per token of context", f"{n['per_token_all_in']:,.2f} B all in; "
                                 f"{n['per_token']:,.2f} B of compressed pools"],
        ["blocks needed", f"{n['blocks_per_request']:,} per request, {n['blocks_total']:,} "
                          f"for {R} requests"],
        [f"V3.2-style MLA cache ({MLA_BYTES_PER_TOKEN_LAYER} B/token/layer x {cfg.num_layers})",
         f"{n['mla_per_request']:,} B ({_bytes(n['mla_per_request'])}); "
         f"{n['mla_ratio']:.2f}x this cache"],
        [f"requests that fit in {args.gpu_memory:g} GiB",
         f"{n['fit_requests']:,} (MLA: {n['fit_requests_mla']:,}); cache only, "
         f"no weights or activations"],
    ], numeric=False)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(n, f, indent=1)
        except OSError as e:
            raise CliError(f"--json {args.json}: cannot write it ({e.strerror})") from None
        ui.line(f"numbers written to {args.json}")
    return 0


# ---- info -------------------------------------------------------------------------------
def cmd_info(args, parser) -> int:
    """Versions and which FFI modules loaded."""
    import jax
    ui = UI(plain=args.plain)
    ui.line(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    for platform, status in _ffi.module_status().items():
        if status.startswith("loaded") and not _has_devices(platform):
            status = status.replace("loaded", "built", 1) + f", but no {platform.upper()} device is visible"
        elif not status.startswith("loaded"):
            status = "not loaded: " + _ffi.missing_module_reason(platform)
        ui.line(f"  {platform}: {status}")
    return 0


def _has_devices(platform: str) -> bool:
    import jax
    try:
        return bool(jax.devices(platform))
    except RuntimeError:     # no backend of that platform here
        return False


# ---- bench (in dsv4_jax/app/bench/) --------------------------------------------------------
def cmd_bench(args, parser) -> int:
    """Time every op at several sizes (µs per call, GB/s of the bytes it must
    move, % of a device copy of as many bytes) and a V4-Flash decode step as
    a model calls the library (--with-reference: the jnp reference's too); a
    table, a JSON and a PNG plot."""
    from .bench import suite
    return suite.command(args, UI(plain=args.plain))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dsv4_jax",
                                     description="DeepSeek-V4 KV cache for JAX. Without a "
                                     "command: demo.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--plain", action="store_true",
                        help="plain-text output even when rich is installed")
    sub = parser.add_subparsers(dest="command", metavar="{demo,plan,bench,info}")

    p = sub.add_parser("demo", parents=[common], help="run a checked decode loop (default)",
                       description=cmd_demo.__doc__)
    p.add_argument("--model", choices=sorted(PRESETS) + ["hf-tiny"],
                   help="layer pattern (default: tiny on the CPU, flash on a GPU); hf-tiny: "
                        "the attention block (dsv4_jax.block) against Hugging Face's outputs")
    p.add_argument("--requests", type=positive_int, help="requests (default 4)")
    p.add_argument("--context", type=positive_int,
                   help="maximum context per request (default 512 on the CPU, 4096 on a GPU)")
    p.add_argument("--steps", type=positive_int, help="decode steps after the prefill")
    p.add_argument("--chunk", type=positive_int, help="prefill tokens per request per step")
    p.add_argument("--kv-format", default="ds_fp8", choices=list(C.KV_FORMATS))
    p.add_argument("--impl", default="auto", choices=["auto", "cpu", "cuda", "reference"],
                   help="implementation of the checked run (the replay is always reference)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--preempt", type=nonnegative_int, default=0, metavar="N",
                   help="preempt the first N requests to host memory mid-decode and resume "
                        "them into other slots and blocks (the check still covers every byte)")
    p.add_argument("--speculative", type=nonnegative_int, default=0, metavar="K",
                   help="speculative decode: every decode step verifies K random drafts a "
                        "request and keeps a random prefix (the check still covers every byte)")
    # Test hook: damage one stored byte after this step; the check must then FAIL.
    p.add_argument("--corrupt-at-step", type=nonnegative_int, default=None,
                   help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("plan", parents=[common], help="memory plan of a model, context and batch",
                       description=cmd_plan.__doc__)
    p.add_argument("--model", choices=sorted(PRESETS), default="flash")
    p.add_argument("--context", type=positive_int, default=65536, help="tokens per request")
    p.add_argument("--requests", type=positive_int, default=8)
    p.add_argument("--kv-format", default="ds_fp8", choices=list(C.KV_FORMATS))
    p.add_argument("--gpu-memory", type=positive_float, default=80.0, metavar="GIB",
                   help="memory to fill with requests of --context tokens (default 80 GiB)")
    p.add_argument("--json", type=output_path, metavar="PATH",
                   help="also write the numbers as JSON")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("bench", parents=[common], help="time the ops: table, JSON, plot",
                       description=cmd_bench.__doc__)
    from .bench.options import add_options
    add_options(p, json_default="bench.json", plot_default="bench.png")
    p.set_defaults(fn=cmd_bench)

    sub.add_parser("info", parents=[common], help="versions and which FFI modules loaded",
                   description=cmd_info.__doc__).set_defaults(fn=cmd_info)
    # -h lists every command's options (`python -m dsv4_jax COMMAND -h`: one's)
    parser.epilog = "\n".join(f"---- {name} ----\n{p.format_help()}"
                               for name, p in sub.choices.items())
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("demo", "plan", "bench", "info", "-h", "--help"):
        argv = ["demo"] + argv          # demo is the default command
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]
    try:
        return args.fn(args, sub)
    except CliError as e:
        print(f"{sub.prog}: error: {e}", file=sys.stderr)
        return 2
