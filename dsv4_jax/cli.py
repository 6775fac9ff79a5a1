"""`python -m dsv4_jax [demo|plan|info]`."""
from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from . import _ffi
from .config import CacheConfig
from .manager import CacheManager
from .memory import MIB, memory_report
from .ops.apply_step import apply_step
from .state import init_state

_PRESETS = {"tiny": CacheConfig.tiny, "flash": CacheConfig.flash, "pro": CacheConfig.pro}


def _config(args) -> CacheConfig:
    return _PRESETS[args.model](max_requests=args.requests, max_context=args.context,
                                kv_format=args.kv_format)


def cmd_demo(args) -> int:
    """Build a cache, admit requests with different prompt lengths and run
    jitted, donated steps of apply_step (the full decode loop arrives with the
    remaining ops)."""
    cfg = _config(args)
    print(f"dsv4_jax demo: model {cfg.model}, {cfg.num_layers} layers, R={cfg.max_requests}, "
          f"N={cfg.num_blocks} blocks, kv_format {cfg.kv_format}, backend {jax.default_backend()}")
    print(f"FFI modules: {_ffi.module_status()}")
    state = init_state(cfg)
    manager = CacheManager(cfg)
    rng = np.random.default_rng(0)
    prompts = {manager.admit(): int(n) for n in rng.integers(1, cfg.max_context // 2,
                                                            cfg.max_requests)}
    step = jax.jit(apply_step, donate_argnames=("state",))
    state = step(state, manager.prepare_step(prompts))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state = step(state, manager.prepare_step({r: 1 for r in prompts}))
    jax.block_until_ready(state)
    dt = time.perf_counter() - t0
    table = np.asarray(state.block_table)
    ok = all(list(table[manager.slot_of(r)][:len(manager.blocks_of(r))]) ==
             list(manager.blocks_of(r)) for r in prompts)
    rep = memory_report(cfg)
    print(f"steps {args.steps}, {dt / max(args.steps, 1) * 1e3:.2f} ms/step, "
          f"pool memory {rep.total / MIB:.1f} MiB, blocks in use "
          f"{cfg.num_blocks - manager.free_blocks}/{cfg.num_blocks}")
    print("block table matches the manager:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def cmd_plan(args) -> int:
    cfg = _config(args)
    rep = memory_report(cfg)
    print(f"model {cfg.model}: {cfg.num_layers} layers ({cfg.num_csa} CSA, {cfg.num_hca} HCA), "
          f"{cfg.max_requests} requests x {cfg.max_context} tokens, kv_format {cfg.kv_format}")
    print(rep.table())
    return 0


def cmd_info(args) -> int:
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    for platform, status in _ffi.module_status().items():
        print(f"  {platform}: {status}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv4_jax",
                                     description="DeepSeek-V4 KV cache for JAX")
    sub = parser.add_subparsers(dest="command")
    for name, fn, model, requests, context in (("demo", cmd_demo, "tiny", 4, 512),
                                               ("plan", cmd_plan, "flash", 8, 65536)):
        p = sub.add_parser(name, help=fn.__doc__.split("\n")[0] if fn.__doc__ else None)
        p.add_argument("--model", choices=sorted(_PRESETS), default=model)
        p.add_argument("--requests", type=int, default=requests)
        p.add_argument("--context", type=int, default=context)
        p.add_argument("--kv-format", default="ds_fp8", choices=["ds_fp8", "fp8_token", "bf16"])
        if name == "demo":
            p.add_argument("--steps", type=int, default=20)
        p.set_defaults(fn=fn)
    sub.add_parser("info", help="versions and which FFI modules loaded").set_defaults(fn=cmd_info)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo"] + list(argv or sys.argv[1:]))
    return args.fn(args)
