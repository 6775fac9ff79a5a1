"""dsv4_jax/bench/request_state.py (issue 40's benchmark) end to end on the
CPU: a well-formed report whose round trips all came back bit for bit; the
GPU run is the lead's (benchmarks/bench_request_state.py)."""
import json

import pytest

from dsv4_jax import memory_report
from dsv4_jax.bench import request_state as bench
from conftest import requires_cpu_ffi
from support.marks import CUDA


@requires_cpu_ffi
def test_cli_run_reports_exact_round_trips(tmp_path, capsys):
    out = tmp_path / "rs.json"
    assert bench.main(["--model", "tiny", "--contexts", "256", "--reps", "1",
                       "--copy-gbps", "100", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    cfg = bench.bench_config("tiny", 256)
    rep = memory_report(cfg)
    slot = rep.window_per_request + rep.compressor_per_request + 4     # + the length
    assert row["slot_bytes"] == slot and row["bytes"] == slot + 2 * rep.per_block
    assert row["exact"] is True and row["copy_GBps"] == 100 and row["host_memory_kind"] == "pinned_host"
    for key in ("slot_restore_ms", "device_out_ms", "device_in_ms", "host_out_ms", "host_in_ms",
                "d2h_GBps", "h2d_GBps", "prefill_ms"):
        assert row[key] > 0, key
    assert row["device_in_GBps"] == pytest.approx(row["bytes"] / row["device_in_ms"] / 1e6)
    assert row["device_in_pct"] == pytest.approx(200 * row["device_in_GBps"] / 100)
    assert row["host_in_pct"] == pytest.approx(100 * row["host_in_GBps"] / row["h2d_GBps"])
    assert row["prefix_hit_speedup"] == pytest.approx(row["prefill_ms"] / row["slot_restore_ms"])
    printed = capsys.readouterr().out
    assert "| tiny | 256 |" in printed and printed.rstrip().endswith("(cpu)")


def test_contexts_must_be_whole_blocks():
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "100"])


@pytest.mark.parametrize("model", [pytest.param("tiny", marks=CUDA)])
def test_gpu_run_moves_exactly_through_pinned_host(tmp_path, model):
    """On the GPU (the lead runs it): the whole benchmark at CPU sizes, the
    host copies through the GPU's pinned host memory, every round trip exact."""
    out = tmp_path / "rs.json"
    assert bench.main(["--model", model, "--contexts", "256,1024", "--reps", "2",
                       "--json", str(out)]) == 0
    for row in json.loads(out.read_text())["rows"]:
        assert row["exact"] is True and row["platform"] == "gpu"
        assert row["host_memory_kind"] == "pinned_host" and row["h2d_GBps"] > 0
