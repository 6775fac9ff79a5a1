"""benchmarks/bench_speculative.py's quick run on the CPU: every program it
times gives a row with a time and no error counts but STALE_WINDOW, and the
summary row compares the speculative step with the plain one. The timing
loop runs one verify step again and again on a state whose commit already
kept some of its drafts: from the second call on, the window rows before
the step's first position were overwritten by those kept rows, which
attention counts (STALE_WINDOW) and skips; the plain step re-appends its
one position and stays clean."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow(reason="the speculative bench's whole quick run; test_speculative's steps stay")
def test_quick_run_rows(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_speculative", ROOT / "benchmarks" / "bench_speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "speculative.json"
    assert bench.main(["--quick", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    timed = {r["program"]: r for r in rows if r["program"] != "summary"}
    assert set(timed) == {"plain", "speculative", "begin", "commit", "restore"}
    from dsv4_jax.errors import ErrorKind
    for r in timed.values():
        others = [n for k, n in enumerate(r["errors"]) if k != ErrorKind.STALE_WINDOW]
        assert r["host_ms"] > 0 and not any(others), r
    assert not any(timed["plain"]["errors"]), timed["plain"]
    summary = next(r for r in rows if r["program"] == "summary")
    assert summary["speculative_over_plain"] > 0 and summary["commit_us_per_layer"] > 0
    assert 0 < summary["kept_tokens"] <= summary["verified_tokens"] == 2 * 4
