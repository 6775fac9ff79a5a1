"""benchmarks/bench_attention.py's quick run on the CPU: every case it times
gives a row with its time, bytes, rates and the baseline of the same work."""
import json

import pytest

from bench_attention import main

from dsv4_jax.app.bench.inputs import entry_bytes


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """`quick_run(fmt)`: the rows of the quick run with --kv-format fmt (none:
    the default), each run once for the file's tests."""
    runs = {}

    def rows(fmt=None):
        if fmt not in runs:
            out = tmp_path_factory.mktemp("bench_attention") / "rows.json"
            argv = ["--quick", "--reps", "1", "--json", str(out)]
            assert main(argv + (["--kv-format", fmt] if fmt else [])) == 0
            runs[fmt] = json.loads(out.read_text())["rows"]
        return runs[fmt]
    return rows


@pytest.mark.slow(reason="the attention bench's whole quick run; the bench command on two ops stays")
def test_quick_run_rows(quick_run):
    rows = quick_run()
    cases = [r for r in rows if r["op"] == "attention"]
    assert {(r["mode"], r["kind"]) for r in cases} == {
        ("decode", "csa"), ("decode", "hca"), ("prefill", "csa"), ("prefill", "hca")}
    assert len([r for r in cases if r["mode"] == "decode"]) == 4      # B 1, 2 x two kinds
    for r in cases:
        assert r["us"] > 0 and r["baseline_us"] > 0 and r["bytes_read"] > 0
        assert r["tflops"] > 0 and r["gbps"] > 0
        assert r["rel_diff"] < 2 ** -6          # the baseline computed the same attention
    assert any(r["op"] == "copy" and r["gbps"] > 0 for r in rows)


@pytest.mark.slow(reason="the bench's quick run on bf16 pools; the ds_fp8 run stays")
def test_quick_run_bf16_pools(quick_run):
    """--kv-format bf16: the same cases on bf16 pools, their bytes counted at
    a bf16 entry's size, the baseline still the same attention. The ds_fp8
    rows are the default run's (ds_fp8 is the default: checked here)."""
    runs = {fmt: [r for r in quick_run(arg) if r["op"] == "attention"]
            for fmt, arg in (("ds_fp8", None), ("bf16", "bf16"))}
    assert len(runs["bf16"]) == len(runs["ds_fp8"]) == 6
    visited = {}
    for fp8, bf in zip(runs["ds_fp8"], runs["bf16"]):
        assert (fp8["mode"], fp8["kind"], fp8["B"]) == (bf["mode"], bf["kind"], bf["B"])
        assert fp8["kv_format"] == "ds_fp8" and bf["kv_format"] == "bf16"
        assert bf["rel_diff"] < 2 ** -6
        # bytes_read = visited entries x entry size + the queries' and outputs' bytes
        extra = bf["bytes_read"] - fp8["bytes_read"]
        per_entry = entry_bytes("bf16") - entry_bytes("ds_fp8")
        assert extra > 0 and extra % per_entry == 0
        visited[fp8["mode"], fp8["kind"], fp8["B"]] = extra // per_entry
    assert len(set(visited.values())) > 1      # entries visited differ by case
