"""One indexer_topk call per q_format at B decode tokens and `ctx` context,
for a kernel profiler to split the time by kernel:

    ncu --clock-control none --metrics gpu__time_duration.sum \\
        -k regex:"Score|Select|Quantize" python3 tools/indexer_kernel_times.py 64 65536
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
import dsv4_jax as D  # noqa: E402
from indexer import make_state  # noqa: E402

B, ctx = int(sys.argv[1]), int(sys.argv[2])
st = make_state(B, ctx)
rng = np.random.default_rng(1)
q = jnp.asarray(rng.standard_normal((B, 64, 128)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((B, 64)), jnp.float32)
slot = jnp.arange(B, dtype=jnp.int32)
pos = jnp.full((B,), ctx - 1, jnp.int32)
for fmt in ("mxfp4", "bf16"):
    f = jax.jit(lambda st, q, w: D.indexer_topk(st, 1, slot, pos, q, w, 512, q_format=fmt))
    print(fmt, np.asarray(f(st, q, w))[0, :4])
