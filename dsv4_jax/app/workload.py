"""What `python -m dsv4_jax demo` checks a run with (docs/design/testing.md):
random compressor parameters of every layer, and the comparison of two runs'
caches, byte for byte but for the one-code flips an fp32 value on a rounding
boundary may give. The tests compare runs with it too; the seeded workload
they drive is tests/support/workload.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..params import CompressorParams, yarn_inv_freq

F8 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu


def layer_params(cfg, seed=0):
    """Random compressor parameters of every compressed layer."""
    rng = np.random.default_rng(seed)
    inv_freq = jnp.asarray(yarn_inv_freq())

    def one(m, width, d):
        return CompressorParams(
            ape=jnp.asarray(rng.normal(0, 0.5, (m, width)), jnp.float32),
            norm=jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32), inv_freq=inv_freq)
    params = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        if kind == C.CSA:
            p = one(C.CSA_RATIO, 2 * C.HEAD_DIM, C.HEAD_DIM)
            params[layer] = dataclasses.replace(
                p, index=one(C.CSA_RATIO, 2 * C.INDEX_DIM, C.INDEX_DIM))
        elif kind == C.HCA:
            params[layer] = one(C.HCA_RATIO, C.HEAD_DIM, C.HEAD_DIM)
    return params


# ---- comparison ---------------------------------------------------------------------------
# Most one-code flips a run may show, as a fraction of the codes compared: a
# flip needs an fp32 value on a rounding boundary, which is rare.
MAX_FLIP_FRACTION = 1e-3


def _require(ok, message):
    """An assert that `python -O` keeps: the demo's PASS/FAIL depends on it."""
    if not ok:
        raise AssertionError(message)


@dataclasses.dataclass
class Flips:
    """One-code differences between two runs (fp32 values on a rounding
    boundary), and the number of values compared."""
    fp8: int = 0
    e2m1: int = 0
    bf16: int = 0
    total: int = 0

    @property
    def fraction(self):
        return (self.fp8 + self.e2m1 + self.bf16) / max(self.total, 1)


def within_one_step(a, b, sign_bit: int):
    """True where two codes of a sign-magnitude float format (e4m3: sign bit
    0x80; e2m1: 0x8) are at most one step apart on the value line. Codes
    below the sign bit count magnitude steps in value order, and -0 and +0
    are one value: the sign of a zero code follows the sign of the value
    rounded (docs/design/formats.md), so a value that rounds to zero and lies
    within rounding noise of it may give either, as a value on a rounding
    boundary gives either of two neighbouring codes."""
    def rank(c):
        c = c.astype(int)
        return np.where(c & sign_bit, -(c & (sign_bit - 1)), c & (sign_bit - 1))
    return np.abs(rank(a) - rank(b)) <= 1


def compare_states(got, want, flips: Flips, what=""):
    """Byte-identical except one-code flips (counted into `flips`) and fp32
    accumulators within rtol 1e-6."""
    pairs = zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want))
    for (path, a), b in pairs:
        name = what + jax.tree_util.keystr(path)
        a, b = np.asarray(a), np.asarray(b)
        _require(a.shape == b.shape and a.dtype == b.dtype, name)
        if a.dtype == np.float32 and name.endswith("comp"):
            # (max, sum, weighted kv) rows of [..., 3, width] accumulators. The
            # max is order-free: exact. The weighted sum cancels, so its 1e-6 is
            # taken relative to the row's magnitude, not each element.
            np.testing.assert_array_equal(a[..., 0, :], b[..., 0, :], err_msg=name + " max")
            np.testing.assert_allclose(a[..., 1, :], b[..., 1, :], rtol=1e-6, err_msg=name + " sum")
            scale = np.max(np.abs(b[..., 2, :]), axis=-1, keepdims=True)
            _require(np.all(np.abs(a[..., 2, :] - b[..., 2, :]) <= 1e-6 * scale + 1e-30),
                     f"{name} kv: differs by more than 1e-6 of the row scale")
            continue
        if a.dtype == np.float32:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-30, err_msg=name)
            continue
        ab, bb = a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32), \
            b.view(np.uint8) if b.dtype.itemsize == 1 else b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32)
        diff = ab != bb
        if a.dtype == F8:
            flips.total += a.size
            _require(np.all(within_one_step(ab[diff], bb[diff], 0x80)),
                     f"{name}: fp8 codes differ by more than one step")
            flips.fp8 += int(diff.sum())
        elif a.dtype == jnp.bfloat16:
            # RoPE output can cancel (x0 c - x1 s): a 1-ulp sin/cos difference
            # then moves a small result by more than one of its own ulps. Judge
            # a difference against one bf16 ulp of the row's largest value.
            flips.total += a.size
            # Identical bytes are equal whatever they hold (a poisoned NaN the
            # op never touched included), so only differing values are judged.
            af, bf = a.astype(np.float32), b.astype(np.float32)
            finite = np.where(np.isfinite(bf), np.abs(bf), 0.0)
            scale = np.max(finite, axis=-1, keepdims=True) * 2.0 ** -7
            # only differing values are judged: Inf or NaN poison in both warns of nothing
            _require(np.all(np.abs(af[diff] - bf[diff]) <= np.broadcast_to(scale, a.shape)[diff]),
                     f"{name}: bf16 values differ beyond the row's ulp")
            flips.bf16 += int(diff.sum())
        elif name.endswith("index.packed"):
            flips.total += 2 * a.size
            for shift in (0, 4):
                na, nb = (ab >> shift) & 0xF, (bb >> shift) & 0xF
                nd = na != nb
                step = within_one_step(na[nd], nb[nd], 0x8)
                _require(np.all(step), f"{name}: e2m1 codes differ by more than one step: "
                                       f"{list(zip(na[nd][~step][:8], nb[nd][~step][:8]))}")
                flips.e2m1 += int(nd.sum())
        else:   # int32 tables and positions, error counters, e8m0 scales
            _require(not diff.any(), f"{name}: {int(diff.sum())} values differ")
