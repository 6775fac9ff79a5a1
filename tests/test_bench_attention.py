"""benchmarks/bench_attention.py's quick run on the CPU: every case it times
gives a row with its time, bytes, rates and the baseline of the same work."""
import json

from bench_attention import main


def test_quick_run_rows(tmp_path):
    out = tmp_path / "attention.json"
    assert main(["--quick", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    cases = [r for r in rows if r["op"] == "attention"]
    assert {(r["mode"], r["kind"]) for r in cases} == {
        ("decode", "csa"), ("decode", "hca"), ("prefill", "csa"), ("prefill", "hca")}
    assert len([r for r in cases if r["mode"] == "decode"]) == 4      # B 1, 2 x two kinds
    for r in cases:
        assert r["us"] > 0 and r["baseline_us"] > 0 and r["bytes_read"] > 0
        assert r["tflops"] > 0 and r["gbps"] > 0
        assert r["rel_diff"] < 2 ** -6          # the baseline computed the same attention
    assert any(r["op"] == "copy" and r["gbps"] > 0 for r in rows)
