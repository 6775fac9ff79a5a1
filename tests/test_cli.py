"""`python -m dsv4_jax`: the demo checks its cache and can fail; plan prints
the numbers of memory_report."""
import dataclasses
import json
import math
import re

import pytest

import dsv4_jax as dj
from dsv4_jax import CacheConfig, memory_report
from dsv4_jax.app.cli import main

# Small enough for a 2-core CI machine: 2 requests, 3 prefill steps, 4 decode steps.
SMALL = ["--plain", "--model", "tiny", "--requests", "2", "--context", "256", "--steps", "4",
         "--chunk", "96"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_demo_passes_and_reports(capsys):
    code, out = run_cli(capsys, "demo", *SMALL)
    assert code == 0, out
    verdict = re.search(r"check against the reference: (PASS|FAIL) \((.*)\)", out)
    assert verdict and verdict.group(1) == "PASS", out
    # the throughput table has both phases with the tokens the schedule implies
    prompts = [int(n) for n in re.search(r"prompts \[([\d, ]+)\]", out).group(1).split(", ")]
    assert re.search(rf"^prefill\s+{math.ceil(max(prompts) / 96)}\s+{sum(prompts):,}\s", out, re.M), out
    assert re.search(r"^decode\s+4\s+8\s", out, re.M), out
    # entries emitted: every request holds its prompt plus 4 decoded tokens
    lengths = [p + 4 for p in prompts]
    csa = sum(n // 4 for n in lengths) * 2          # tiny: two CSA layers
    hca = sum(n // 128 for n in lengths)            # and one HCA layer
    assert re.search(rf"CSA entries emitted \(all CSA layers\)\s+{csa:,}$", out, re.M), out
    assert re.search(rf"HCA entries emitted \(all HCA layers\)\s+{hca:,}$", out, re.M), out


@pytest.mark.slow(reason="a whole demo; test_demo_passes_and_reports stays")
def test_demo_preempts_and_resumes_mid_decode_and_still_passes(capsys, monkeypatch):
    """--preempt: the first requests go to host memory mid-decode and come
    back into slots they never held; the replay repeats the moves with numpy
    on the host, so a move that loses a byte fails the check."""
    from dsv4_jax.requests import moves as request_moves
    code, out = run_cli(capsys, "demo", *SMALL, "--preempt", "2")
    assert code == 0, out
    assert "the first 2 requests preempted to host memory before decode step 1 and resumed " \
           "into other slots and blocks before step 2" in out, out
    assert "check against the reference: PASS" in out, out
    # the parked requests sit out one decode step: 4 + 4 - 2 tokens decoded
    assert re.search(r"^decode\s+4\s+6\s", out, re.M), out

    def resume_without_accumulators(state, manager, parked, *a, **k):
        empty = dj.snapshot(dj.init_state(state.config), 0)
        snap = dataclasses.replace(parked.snapshot, csa_comp=empty.csa_comp)
        return real_resume(state, manager, dataclasses.replace(parked, snapshot=snap), *a, **k)
    real_resume = request_moves.resume
    monkeypatch.setattr(request_moves, "resume", resume_without_accumulators)
    code, out = run_cli(capsys, "demo", *SMALL, "--preempt", "1")
    assert code == 1 and "check against the reference: FAIL" in out, out


@pytest.mark.slow(reason="a whole demo; test_demo_passes_and_reports stays")
def test_demo_speculative_keeps_random_prefixes_and_passes(capsys):
    """--speculative K: each decode step verifies K drafts a request and keeps
    a random 0 .. 1 + K of its tokens; the reference replays the same steps
    and counts, and the cache holds exactly the prompts plus the kept tokens."""
    code, out = run_cli(capsys, "demo", *SMALL, "--speculative", "3")
    assert code == 0, out
    assert "each decode step verifies 3 random drafts a request" in out, out
    assert "check against the reference: PASS" in out, out
    prompts = [int(n) for n in re.search(r"prompts \[([\d, ]+)\]", out).group(1).split(", ")]
    kept = int(re.search(r"^decode\s+4\s+([\d,]+)\s", out, re.M).group(1).replace(",", ""))
    assert 0 < kept < 4 * 2 * 4, out            # some kept, not every one of 4 steps x 2 x 4
    lengths = [int(n) for n in re.search(r"tokens cached\s+[\d,]+ \(([\d, ]+)\)", out)
               .group(1).split(", ")]
    assert sum(lengths) == sum(prompts) + kept, out
    csa = sum(n // 4 for n in lengths) * 2
    assert re.search(rf"CSA entries emitted \(all CSA layers\)\s+{csa:,}$", out, re.M), out


@pytest.mark.slow(reason="a whole demo; test_demo_passes_and_reports stays")
def test_demo_fails_on_a_corrupted_cache(capsys):
    code, out = run_cli(capsys, "demo", *SMALL, "--corrupt-at-step", "1")
    assert code == 1, out
    assert "check against the reference: FAIL" in out and "PASS" not in out, out
    assert "csa.kv.nope" in out, out     # names the pool that differs


@pytest.mark.parametrize("argv, message", [
    (["--steps", "300", "--context", "256"], "--steps"),
    (["--requests", "0"], "--requests"),
    (["--kv-format", "fp4"], "--kv-format"),
    (["--corrupt-at-step", "999"], "--corrupt-at-step"),
    (["--speculative", "128"], "--speculative"),
    (["--speculative", "7", "--steps", "40", "--context", "256"], "8 positions a step"),
])
def test_demo_rejects_bad_options(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--plain", "--model", "tiny", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("model, context, requests, kv_format, layers", [
    ("flash", 1 << 20, 2, "ds_fp8", 43), ("pro", 65536, 8, "bf16", 61)])
def test_plan_numbers_equal_memory_report(capsys, tmp_path, model, context, requests,
                                          kv_format, layers):
    path = tmp_path / "plan.json"
    code, out = run_cli(capsys, "plan", "--plain", "--model", model, "--context", str(context),
                        "--requests", str(requests), "--kv-format", kv_format,
                        "--gpu-memory", "80", "--json", str(path))
    assert code == 0
    got = json.loads(path.read_text())
    cfg = getattr(CacheConfig, model)(max_requests=requests, max_context=context,
                                      kv_format=kv_format)
    rep = memory_report(cfg)
    assert got["pools"] == rep.pools and got["total"] == rep.total
    assert got["by_kind"] == rep.by_kind and got["per_token"] == rep.per_token
    # The whole state is `requests` requests at full context plus the error
    # counters: one request's share must come out the same.
    errors = rep.pools["errors"]
    assert got["per_request"] * requests == rep.total - errors
    assert got["blocks_per_request"] == context // 128
    assert got["blocks_total"] == cfg.num_blocks == requests * context // 128
    assert got["mla_per_request"] == 656 * layers * context
    assert got["fit_requests"] == (80 << 30) // got["per_request"]
    assert got["fit_requests_mla"] == (80 << 30) // (656 * layers * context)
    # the printed tables carry the same numbers
    for name, b in rep.pools.items():
        assert re.search(rf"^{re.escape(name)}\s+{b:,}\s", out, re.M), name
    assert re.search(rf"^total\s+{rep.total:,}\s", out, re.M)
    assert f"{got['per_request']:,} B" in out and f"{rep.per_token:,.2f} B" in out


def test_plan_rejects_bad_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--context", "-5"])
    assert e.value.code == 2 and "--context" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--gpu-memory", "nan"])


@pytest.mark.slow(reason="the bench's whole quick run; the bench command on two ops stays")
def test_bench_writes_numbers(capsys, tmp_path):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code, out = run_cli(capsys, "bench", "--plain", "--quick", "--reps", "1", "--batch", "1",
                        "--rows", "1", "--flush-decode", "2", "--flush-prefill", "16",
                        "--inner", "2",
                        "--json", str(out_json), "--plot", str(out_png))
    assert code == 0, out
    data = json.loads(out_json.read_text())
    assert data["errors"] == {}            # every timed call did real work, nothing dropped
    ops = {"apply_step", "append", "flush_csa", "flush_hca", "write_layer", "gather_window",
           "gather_topk", "gather_all", "indexer_topk", "attention"}   # all but the step
    timed = [r for r in data["rows"] if r["op"] != "empty"]
    assert {r["op"] for r in timed} == ops
    for r in timed:
        assert r["us"] > 0 and r["bytes"] > 0
        assert r["GBps"] == pytest.approx(r["bytes"] / r["us"] / 1e3)
        assert re.search(rf"^{r['op']}\s+{r['rows']}\s", out, re.M)
    assert data["copy_gbps"] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in out
    else:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_times_the_ops_asked(capsys, tmp_path):
    """The quick run on two ops, one of each kind of size (rows, decode
    tokens): the whole run is test_bench_writes_numbers, slow."""
    out_json = tmp_path / "b.json"
    code, out = run_cli(capsys, "bench", "--plain", "--quick", "--reps", "1", "--batch", "1",
                        "--ops", "append,attention", "--rows", "8", "--flush-decode", "2",
                        "--inner", "2",
                        "--json", str(out_json), "--plot", str(tmp_path / "b.png"))
    assert code == 0, out
    data = json.loads(out_json.read_text())
    timed = [r for r in data["rows"] if r["op"] != "empty"]
    assert [(r["op"], r["rows"]) for r in timed] == [("append", 8), ("attention", 2)]
    for r in timed:
        assert r["us"] > 0 and r["GBps"] == pytest.approx(r["bytes"] / r["us"] / 1e3)
        assert re.search(rf"^{r['op']}\s+{r['rows']}\s", out, re.M)
    assert data["errors"] == {}


def test_bench_rejects_bad_options(capsys):
    for argv in (["--ops", "append,nope"], ["--rows", "0"], ["--formats", "fp4"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", *argv])
        assert e.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.slow(reason="a whole demo; test_demo_passes_and_reports stays")
def test_demo_layer_scan_equals_unrolled_layers():
    """The demo scans the repeating part of a layer pattern (traced layer
    index); the cache must come out byte for byte as with unrolled layers."""
    from support.trees import assert_trees_bytes_equal
    from dsv4_jax.app import demo
    assert demo.layer_groups(CacheConfig.flash().layer_kinds) == (3, 2, 20)
    assert demo.layer_groups(CacheConfig.pro().layer_kinds) == (1, 2, 30)
    assert demo.layer_groups(CacheConfig.tiny().layer_kinds) == (4, 1, 0)
    cfg = CacheConfig((0, 4, 128, 4, 128), max_requests=2, num_blocks=4,
                      max_blocks_per_request=2, index_topk=16)
    assert demo.layer_groups(cfg.layer_kinds) == (1, 2, 2)
    settings = demo.DemoSettings(prompts=(200, 90), chunk=128, decode_steps=3)
    scanned = demo.run(cfg, settings)
    unrolled = demo.run(cfg, settings, metas=scanned.metas, scan=False)
    assert_trees_bytes_equal(scanned.state, unrolled.state)
    assert demo.entries_emitted(cfg, [203, 93]) == {"csa": 2 * (50 + 23), "index": 146,
                                                    "hca": 2 * 1}
    assert demo.check_against(scanned.state, unrolled.state).ok


def test_library_does_not_import_the_cli_extras():
    import subprocess
    import sys
    code = ("import sys, dsv4_jax, dsv4_jax.app.workload; "
            "bad = [m for m in ('rich', 'matplotlib', 'tqdm') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_plain_fallback_without_rich(capsys, monkeypatch):
    from dsv4_jax.app import ui
    monkeypatch.setattr(ui, "_rich", lambda: False)      # as if rich were not installed
    code, out = run_cli(capsys, "plan", "--model", "pro", "--context", "4096", "--requests", "2")
    assert code == 0
    total = memory_report(CacheConfig.pro(max_requests=2, max_context=4096)).total
    assert re.search(rf"^total\s+{total:,}\s", out, re.M) and "┃" not in out
