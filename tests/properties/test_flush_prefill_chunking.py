"""Chunking invariance of long prefill streams (docs/design/semantics.md,
docs/design/testing.md): a 16k-token request (starting mid-window, on carried accumulators) flushed in
one 16k-token call or four 4k-token calls (the window plan) gives the bytes
of smaller chunkings (calls of 1 to 1,000 rows: the serial walk below 256
rows, the plan above), on the CPU handler and on the CUDA kernels, CSA and
HCA. As test_chunking.py does for mixed schedules, every state leaf is
compared; here bit for bit, since one device folds each chunking."""
import jax
import numpy as np
import pytest

from dsv4_jax import config as C
from support.flush_plan import call_flush, params, prefill_state, projections
from support.marks import has_cuda, requires_cpu_ffi
from support.trees import assert_trees_bytes_equal

N = 16384
P0 = 2
CHUNKINGS = {"16k": [N], "4k": [4096] * 4,
             "small": [1, 37, 255, 1000, 3, 256, 999] * 10}   # the rest in 1000-row calls


def _cuts(sizes):
    cuts, done = [], 0
    for c in sizes:
        c = min(c, N - done)
        if c:
            cuts.append(c)
            done += c
    while done < N:
        cuts.append(min(1000, N - done))
        done += cuts[-1]
    return cuts


def _stream(kind, device):
    st = prefill_state("ds_fp8", R=2, max_context=N + 256, seed=21)
    proj = projections(kind, N, seed=22)
    prm = params(kind, seed=23)
    pos = np.arange(P0, P0 + N, dtype=np.int32)
    out = {}
    for name, sizes in CHUNKINGS.items():
        s, a = st, 0
        for c in _cuts(sizes):
            part = tuple(None if x is None else x[a:a + c] for x in proj)
            s = call_flush(s, kind, np.ones(c, np.int32), pos[a:a + c], part, prm, device=device)
            a += c
        out[name] = jax.tree_util.tree_map(np.asarray, s)
    for name in ("4k", "small"):
        assert_trees_bytes_equal(out[name], out["16k"], f"{kind} {name} vs 16k ")
    assert not out["16k"].errors.any()


@requires_cpu_ffi
@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
def test_cpu_prefill_chunkings_agree(kind):
    _stream(kind, jax.devices("cpu")[0])


@pytest.mark.parametrize("kind", [C.CSA, C.HCA])
@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU and _dsv4_cuda")
def test_cuda_prefill_chunkings_agree(kind):
    _stream(kind, jax.devices("cuda")[0])
