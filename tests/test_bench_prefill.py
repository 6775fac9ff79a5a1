"""benchmarks/bench_prefill.py: the prefill benchmark schedules prompts as a
token-budgeted server does, counts the bytes its docstring names, runs end to end
on the CPU with a well-formed report, and leaves the very state that plain
apply_step / append / flush calls of the same steps and inputs write."""
import json

import jax
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import config as C
import bench_prefill as prefill
from conftest import requires_cpu_ffi
from support.marks import CUDA

SMOKE = "2x320/128"   # a step holding both requests, HCA windows closed, blocks recycled


def test_scenarios_parse_and_schedule_request_after_request():
    sc = prefill.Scenario.parse("2x320/128")
    assert (sc.requests, sc.tokens, sc.chunk, sc.name) == (2, 320, 128, "2x320/128")
    assert sc.schedule() == [[(0, 128)], [(0, 128)], [(0, 64), (1, 64)], [(1, 128)],
                             [(1, 128)]]
    assert prefill.Scenario.parse("1x64k/8k") == prefill.Scenario(1, 65536, 8192)
    assert prefill.Scenario.parse("8x8192/8192").schedule() == [[(r, 8192)] for r in range(8)]
    for bad in ("8x8192", "0x128/128", "1x128/-4"):
        with pytest.raises(ValueError, match="scenario"):
            prefill.Scenario.parse(bad)


def test_read_bytes_of_a_64k_prompt_through_flash():
    """Per token: 43 bf16 window rows, 21 CSA layers' f32 kv + score of the
    compressor (2 x 1024) and the indexer (2 x 256), 20 HCA layers' (2 x 512):
    22.3 GB."""
    cfg = prefill.prefill_config("flash", prefill.Scenario(1, 65536, 8192))
    assert cfg.num_layers == 43 and cfg.num_blocks == 512 + 1
    per_token = 43 * 1024 + 21 * 4 * (2 * 1024 + 2 * 256) + 20 * 4 * (2 * 512)
    assert prefill.read_bytes(cfg, 65536) == 65536 * per_token == 22_347_251_712


@requires_cpu_ffi
def test_cli_run_reports_its_fields(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert prefill.main(["--scenarios", SMOKE, "--model", "tiny", "--impl", "cpu", "--reps", "2",
                         "--copy-gbps", "100", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["copy_gbps"] == 100 and data["platform"] == "cpu"
    (row,) = data["rows"]
    assert (row["scenario"], row["chunks"], row["rows_per_chunk"], row["layers"]) == \
        (SMOKE, 5, 128, 4)
    assert (row["impl"], row["write"], row["model"], row["errors"]) == ("cpu", "fused", "tiny", {})
    assert len(row["runs_ms"]) == 2 and row["ms_total"] == pytest.approx(np.median(row["runs_ms"]))
    assert row["ms_per_chunk"] == pytest.approx(row["ms_total"] / 5)
    nbytes = 640 * (4 * 1024 + 2 * 4 * (2 * 1024 + 2 * 256) + 4 * 2 * 512)
    assert row["read_bytes"] == nbytes
    assert row["GBps"] == pytest.approx(nbytes / row["ms_total"] / 1e6)
    assert row["copy_ms"] == pytest.approx(nbytes / 100e9 * 1e3)
    assert row["copy_pct"] == pytest.approx(100 * row["copy_ms"] / row["ms_total"])
    printed = capsys.readouterr().out
    assert "warm-up chunk 5/5" in printed and "| 2x320/128 | 5 | fused | cpu |" in printed
    assert prefill.main(["--markdown", str(out)]) == 0
    assert "| 2x320/128 | 5 | fused | cpu |" in capsys.readouterr().out


def plain_writes(cfg, runs, x):
    """The state of every run's steps written by separate jitted calls of
    apply_step, then per layer append and (CSA, HCA) flush, on the CPU."""
    step = jax.jit(lambda s, m: dj.apply_step(s, m, impl="cpu"), donate_argnums=0)
    append = jax.jit(lambda s, layer, m, kv: dj.append(s, layer, m, kv, impl="cpu"),
                     donate_argnums=0, static_argnums=1)
    flush = jax.jit(lambda s, layer, m, kv, sc, p, ikv, isc: dj.flush(
        s, layer, m, kv, sc, p, impl="cpu", index_kv=ikv, index_score=isc),
        donate_argnums=0, static_argnums=1)
    state = dj.init_state(cfg)
    for metas in runs:
        for meta in metas:
            state = step(state, meta)
            for layer, kind in enumerate(cfg.layer_kinds):
                state = append(state, layer, meta, x["kv"])
                if kind == C.CSA:
                    state = flush(state, layer, meta, x["csa_kv"], x["csa_score"],
                                  x["params"][C.CSA], x["index_kv"], x["index_score"])
                elif kind == C.HCA:
                    state = flush(state, layer, meta, x["hca_kv"], x["hca_score"],
                                  x["params"][C.HCA], None, None)
    return state


@requires_cpu_ffi
@pytest.mark.parametrize("write", prefill.WRITES)
def test_benchmark_leaves_the_state_of_plain_op_calls(write):
    """Two runs (warm-up and one timed), the second on recycled slots and
    blocks: every leaf equal, byte for byte, to the plain calls' state; the
    state is not blank (the writes landed) and counts no bad input."""
    sc = prefill.Scenario.parse(SMOKE)
    cfg = prefill.prefill_config("tiny", sc)
    row, runs = prefill.measure(cfg, sc, impl="cpu", write=write, reps=1, seed=3,
                                copy_gbps=100.0, emit=lambda line: None)
    assert len(runs.metas) == 2 and row["errors"] == {}
    want = plain_writes(cfg, runs.metas, prefill.step_inputs(runs.rows, seed=3))
    got = runs.state
    blank = dj.init_state(cfg)
    for (path, g), w, b in zip(jax.tree_util.tree_leaves_with_path(got),
                               jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(blank)):
        g, w, b = (np.asarray(a).view(np.uint8) for a in (g, w, b))
        where = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(g, w, err_msg=where)
        if not where.endswith("errors"):
            assert (g != b).any(), f"{where} holds nothing written"



@pytest.mark.parametrize("write", [pytest.param(w, marks=CUDA) for w in prefill.WRITES])
def test_gpu_run_reports_its_timeline(tmp_path, write):
    """On the GPU (the lead runs it): the CUDA path end to end, and the
    device timeline of a run split into its steps."""
    out = tmp_path / "prefill.json"
    assert prefill.main(["--scenarios", SMOKE, "--model", "tiny", "--reps", "1", "--write", write,
                         "--device-timeline", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["errors"] == {} and row["copy_GBps"] > 0 and row["ms_total"] > 0
    assert row["kernels_per_chunk"] >= 4
    assert row["busy_ms_per_chunk"] > 0 and row["span_ms_per_chunk"] > 0
    assert any(k["kind"] == "cache" for k in row["kernels"])
