"""examples/decode_loop.py runs, and its attention outputs (the last decoded
token, and the last prompt token from the prefill chunks) equal a dense
attention written from scratch in numpy / float64 over the same tokens, with
the compressed entries of the oracle (tests/support/oracle.py)."""
import math

import jax
import numpy as np
import pytest

from support.examples import load_example
from support import oracle as O
from dsv4_jax import config as C
from dsv4_jax import yarn_inv_freq

def stored(entries, fmt):
    """What the cache gives back for bf16 entries: quantize, dequantize."""
    return O.decode_kv(O.encode_kv(entries, fmt), fmt).astype(np.float64)


def rms_norm(x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def rope(x, t, inv, sign=1.0):
    """Interleaved RoPE (sign -1: its inverse) on the trailing 64 channels of
    x [..., 512] at position t, float64 from the fp32 angle."""
    ang = (np.float32(t) * np.asarray(inv, np.float32)).astype(np.float64)
    c, s = np.cos(ang), sign * np.sin(ang)
    y = np.array(x, np.float64)
    a, b = y[..., 448::2].copy(), y[..., 449::2].copy()
    y[..., 448::2], y[..., 449::2] = a * c - b * s, a * s + b * c
    return y


def layer_inv_freq(kind):
    if kind == C.SWA:
        return (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    return yarn_inv_freq()


def dense_attention(q, keys, sink):
    """q [H, 512] over keys [S, 512] (K = V) with a per-head sink logit."""
    logits = q @ keys.T / math.sqrt(C.HEAD_DIM)                      # [H, S]
    m = np.maximum(logits.max(-1), sink)
    p = np.exp(logits - m[:, None])
    return (p @ keys) / (p.sum(-1) + np.exp(sink - m))[:, None]


def indexer_scores(x_t, w, ikeys):
    """The indexer's scores with its query rounded to bf16, then to MXFP4
    (what DeepSeek-V4's inference code scores and indexer_topk's default)."""
    q = np.einsum("d,dhc->hc", x_t, w["wi_q"].astype(np.float64)) @ O.hadamard_matrix() \
        / math.sqrt(C.INDEX_DIM)
    q = O.decode_mxfp4(O.encode_mxfp4(O.to_bf16(q)))
    return (x_t @ w["wi_w"].astype(np.float64)) @ np.maximum(q @ ikeys.T, 0)


@pytest.mark.parametrize("kv_format", ["ds_fp8", "bf16"])
def test_decode_loop_matches_dense_numpy_attention(kv_format):
    ex = load_example("decode_loop")
    # float32 matmuls as the float64 oracle assumes: on a GPU, XLA's default
    # precision takes TF32 for them (1e-2 off in the attention outputs)
    with jax.default_matmul_precision("highest"):
        res = ex.run(ex.Settings(prompts=(150, 61), decode_steps=3, kv_format=kv_format),
                     verbose=False)
    checked_picks = 0
    for r, X in enumerate(res.tokens):
        # the last decoded token, and the last prompt token (a prefill chunk's)
        for t, out, picks in ((X.shape[0] - 1, res.out, res.picks),
                              (X.shape[0] - 1 - 3, res.prompt_out, res.prompt_picks)):
            checked_picks += check_token(res, kv_format, r, X[:t + 1], out, picks)
    assert checked_picks >= 2          # the indexer had more visible entries than k


def check_token(res, kv_format, r, X, out, all_picks):
    """The attention outputs of request r's token t = len(X) - 1 in every
    layer against the dense float64 attention; returns how many CSA layers
    had more visible entries than k."""
    inv = yarn_inv_freq()
    checked = 0
    X = X.astype(np.float64)
    t = X.shape[0] - 1
    f64 = lambda a: np.asarray(a, np.float64)
    for layer, kind in enumerate(res.config.layer_kinds):
        w = {k: v for k, v in res.weights[layer].items()}
        rinv = layer_inv_freq(kind)
        lo = max(0, t - C.WINDOW + 1)
        kv = O.to_bf16(rms_norm(X[lo:] @ f64(w["wkv"])))
        kv = O.to_bf16(np.stack([rope(kv[i], lo + i, rinv) for i in range(len(kv))]))
        keys = [stored(kv, kv_format)]
        if kind == C.CSA:
            ent = O.csa_keys(X @ f64(w["wc_kv"]), X @ f64(w["wc_score"]),
                             w["comp"]["ape"], w["comp"]["norm"], inv)
            assert ent.shape[0] == (t + 1) // 4
            ik = O.csa_keys(X @ f64(w["wi_kv"]), X @ f64(w["wi_score"]),
                            w["icomp"]["ape"], w["icomp"]["norm"], inv)
            ikeys = O.decode_mxfp4(O.encode_mxfp4(O.index_keys(ik)))
            scores = indexer_scores(X[t], w, ikeys)
            picks = all_picks[layer][r]
            k = min(len(picks), len(scores))
            # the picks are a top-k of the indexer scores (up to near-ties)
            assert sorted(picks[picks >= 0]) == sorted(set(picks[picks >= 0]))
            assert (picks >= 0).sum() == k and (picks[k:] == -1).all()
            chosen = picks[:k]
            rest = np.setdiff1d(np.arange(len(scores)), chosen)
            tol = 1e-3 * np.abs(scores).max()
            if len(rest):
                assert scores[chosen].min() >= scores[rest].max() - tol
                srt = np.sort(scores)[::-1]
                if srt[k - 1] - srt[k] > tol:   # a clear boundary: the exact set
                    assert set(chosen) == set(np.argsort(-scores)[:k])
            checked += len(rest) > 0
            keys.append(stored(ent[chosen], kv_format))
        elif kind == C.HCA:
            ent = O.hca_keys(X @ f64(w["wc_kv"]), X @ f64(w["wc_score"]),
                             w["comp"]["ape"], w["comp"]["norm"], inv)
            assert ent.shape[0] == (t + 1) // 128
            keys.append(stored(ent, kv_format))
        q = O.to_bf16(rms_norm(np.einsum("d,dhc->hc", X[t], f64(w["wq"]))))
        q = O.to_bf16(rope(q, t, rinv)).astype(np.float64)
        want = rope(dense_attention(q, np.concatenate(keys), f64(w["sink"])), t, rinv, -1.0)
        got = out[layer, r]
        # bf16 / fp8 roundings of the float32 path may land one code away
        # from the float64 ones (seen: 2e-4 at most); attention returns bf16
        # now, rounded once (2^-9 of the largest value) and on the RoPE
        # channels once more after the inverse rotation; a wrong entry moves
        # the output by ~1e-1.
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2 * 2 ** -9 + 5e-4, \
            f"layer {layer} request {r} token {t}: relative error {err:.3g}"
        assert np.abs(got).max() > 0.05          # not a trivially small output
    return checked
