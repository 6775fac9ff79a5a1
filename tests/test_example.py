"""examples/decode_loop.py runs, and its attention output equals a dense
attention written from scratch in numpy / float64 over the same tokens, with
the compressed entries of the oracle (tests/support/oracle.py)."""
import importlib.util
import math
import pathlib
import sys

import jax
import numpy as np
import pytest

from support import oracle as O
from dsv4_jax import config as C
from dsv4_jax import yarn_inv_freq

PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "decode_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("decode_loop", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def stored(entries, fmt):
    """What the cache gives back for bf16 entries: quantize, dequantize."""
    return O.decode_kv(O.encode_kv(entries, fmt), fmt).astype(np.float64)


def rms_norm(x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


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
    ex = load_example()
    # float32 matmuls as the float64 oracle assumes: on a GPU, XLA's default
    # precision takes TF32 for them (1e-2 off in the attention outputs)
    with jax.default_matmul_precision("highest"):
        res = ex.run(ex.Settings(prompts=(150, 61), decode_steps=3, kv_format=kv_format),
                     verbose=False)
    inv = yarn_inv_freq()
    checked_picks = 0
    for layer, kind in enumerate(res.config.layer_kinds):
        w = {k: v for k, v in res.weights[layer].items()}
        f64 = lambda a: np.asarray(a, np.float64)
        for r, X in enumerate(res.tokens):
            X = X.astype(np.float64)
            t = X.shape[0] - 1                                   # the last decoded token
            kv = O.to_bf16(rms_norm(X @ f64(w["wkv"])))
            keys = [stored(kv[max(0, t - C.WINDOW + 1):t + 1], kv_format)]
            if kind == C.CSA:
                ent = O.csa_keys(X @ f64(w["wc_kv"]), X @ f64(w["wc_score"]),
                                 w["comp"]["ape"], w["comp"]["norm"], inv)
                assert ent.shape[0] == (t + 1) // 4
                ik = O.csa_keys(X @ f64(w["wi_kv"]), X @ f64(w["wi_score"]),
                                w["icomp"]["ape"], w["icomp"]["norm"], inv)
                ikeys = O.decode_mxfp4(O.encode_mxfp4(O.index_keys(ik)))
                scores = indexer_scores(X[t], w, ikeys)
                picks = res.picks[layer][r]
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
                checked_picks += len(rest) > 0
                keys.append(stored(ent[chosen], kv_format))
            elif kind == C.HCA:
                ent = O.hca_keys(X @ f64(w["wc_kv"]), X @ f64(w["wc_score"]),
                                 w["comp"]["ape"], w["comp"]["norm"], inv)
                assert ent.shape[0] == (t + 1) // 128
                keys.append(stored(ent, kv_format))
            q = np.einsum("d,dhc->hc", X[t], f64(w["wq"]))
            want = dense_attention(q, np.concatenate(keys), f64(w["sink"]))
            got = res.out[layer, r]
            # bf16 / fp8 roundings of the float32 path may land one code away
            # from the float64 ones (seen: 2e-4 at most); a wrong entry moves it by ~1e-1.
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < 2e-3, f"layer {layer} request {r}: relative error {err:.3g}"
            assert np.abs(got).max() > 0.05          # not a trivially small output
    assert checked_picks >= 2          # the indexer had more visible entries than k
