"""The ops benchmark's options (shared by `python -m dsv4_jax bench` and
benchmarks/run.py) and the defaults of each platform. Imports nothing heavy:
the command line builds its parser from it."""
from __future__ import annotations

import argparse

from ... import config as C
from ..arguments import input_path, names, output_path, size, sizes

# every op, then the decode step (last: --quick leaves it out)
OPS = ("apply_step", "append", "flush_csa", "flush_hca", "write_layer", "gather_window",
       "gather_topk", "gather_all", "indexer_topk", "attention", "flash_step")
# (on a GPU, --quick) -> what runs unless an option says otherwise
_DEFAULTS = {
    (True, False): dict(ops=OPS, rows=[1, 8, 64, 256, 4096, 65536], flush_decode=[1, 8, 64],
                        flush_prefill=[4096], step_batches=[1, 8, 64], reps=21, batch=20),
    (False, False): dict(ops=OPS, rows=[1, 8, 64, 256], flush_decode=[1, 8, 64],
                         flush_prefill=[256], step_batches=[1, 8], reps=5, batch=3),
    (True, True): dict(ops=OPS[:-1], rows=[1, 256, 4096], flush_decode=[1, 64],
                       flush_prefill=[4096], step_batches=[8], reps=5, batch=5),
    (False, True): dict(ops=OPS[:-1], rows=[1, 64], flush_decode=[1, 8], flush_prefill=[64],
                        step_batches=[1], reps=3, batch=2),
}


def add_options(p: argparse.ArgumentParser, json_default=None, plot_default=None) -> None:
    """The benchmark's options; unset sizes and repeats take the platform's
    defaults (fewer with --quick)."""
    p.add_argument("--ops", type=names(OPS),
                   help=f"comma-separated among {','.join(OPS)} (default all; --quick: all but "
                        "flash_step)")
    p.add_argument("--rows", type=sizes, help="rows a call of append and the gathers, new "
                   "blocks of apply_step (up to 1024), e.g. 1,64,4k")
    p.add_argument("--formats", type=names(C.KV_FORMATS), default=["ds_fp8"],
                   help="kv formats, comma-separated (default ds_fp8)")
    p.add_argument("--flush-decode", type=sizes,
                   help="requests of the decode cases of flush, write_layer, indexer_topk "
                        "and attention (one token each)")
    p.add_argument("--flush-prefill", type=sizes,
                   help="tokens of the prefill cases of flush and write_layer")
    p.add_argument("--step-batches", type=sizes, help="requests of the decode-step cases")
    p.add_argument("--step-context", type=size,
                   help="context of the decode step, indexer_topk and attention "
                        "(default 4096 on a GPU, 512 on a CPU)")
    p.add_argument("--reps", type=size, help="samples a case (the median is reported)")
    p.add_argument("--batch", type=size, help="calls a sample")
    p.add_argument("--inner", type=size, metavar="N",
                   help="op calls (on as many layers) in one timed jit call (default: 64 for "
                        "calls up to 256 rows, 16 up to 4k, 4 beyond; 16 at most for flush, "
                        "write_layer, indexer_topk and attention)")
    p.add_argument("--with-reference", action="store_true",
                   help="also time the jnp reference of each op and of the step")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and repeats, no decode step")
    p.add_argument("--json", type=output_path, metavar="PATH", default=json_default,
                   help="where to write the numbers" + (f" (default {json_default})"
                                                        if json_default else ""))
    p.add_argument("--plot", type=output_path, metavar="PATH", default=plot_default,
                   help="where to write the plot (needs matplotlib)" + (
                       f" (default {plot_default})" if plot_default else ""))
    p.add_argument("--markdown", type=input_path, metavar="JSON",
                   help="print a saved run's (--json) tables as markdown and exit")


def fill_defaults(args) -> None:
    """Options left unset take the defaults of the default backend."""
    import jax
    gpu = jax.default_backend() == "gpu"
    for name, value in _DEFAULTS[(gpu, args.quick)].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.step_context is None:
        args.step_context = 4096 if gpu else 512
