"""benchmarks/bench_request_state.py end to end on the CPU: a well-formed
report whose round trips all came back bit for bit (the GPU run: the same
script on a GPU)."""
import json

import pytest

from dsv4_jax import memory_report
from dsv4_jax.app.bench import device_timeline as timeline
import bench_request_state as bench
from conftest import requires_cpu_ffi
from support.marks import CUDA


@pytest.mark.slow(reason="the request-move bench's whole run; test_request_state's moves stay")
@requires_cpu_ffi
def test_cli_run_reports_exact_round_trips(tmp_path, capsys):
    out = tmp_path / "rs.json"
    assert bench.main(["--model", "tiny", "--contexts", "256", "--reps", "1",
                       "--copy-gbps", "100", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    cfg = bench.bench_config("tiny", 256)
    rep = memory_report(cfg)
    slot = rep.window_per_request + rep.compressor_per_request   # the length is no leaf
    assert row["slot_bytes"] == slot and row["bytes"] == slot + 2 * rep.per_block
    assert row["exact"] is True and row["copy_GBps"] == 100 and row["host_memory_kind"] == "pinned_host"
    for key in ("slot_restore_ms", "device_out_ms", "device_in_ms", "host_out_ms", "host_in_ms",
                "d2h_GBps", "h2d_GBps", "prefill_ms"):
        assert row[key] > 0, key
    assert row["device_in_GBps"] == pytest.approx(row["bytes"] / row["device_in_ms"] / 1e6)
    assert row["device_in_pct"] == pytest.approx(200 * row["device_in_GBps"] / 100)
    assert row["host_in_pct"] == pytest.approx(100 * row["host_in_GBps"] / row["h2d_GBps"])
    assert row["prefix_hit_speedup"] == pytest.approx(row["prefill_ms"] / row["slot_restore_ms"])
    # no GPU timeline on the CPU: host times only, every move in the table
    assert not any(k.endswith("_dev_us") for k in row)
    printed = capsys.readouterr().out
    for move in ("slot snapshot", "slot restore", "request out, device", "request in, device",
                 "request out, to host", "request in, from host"):
        assert f"| tiny | 256 | {move} |" in printed, move
    assert printed.rstrip().endswith("(cpu)")


def test_contexts_must_be_whole_blocks():
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "100"])


@pytest.mark.parametrize("model", [pytest.param("tiny", marks=CUDA)])
def test_gpu_run_moves_exactly_through_pinned_host(tmp_path, model):
    """On the GPU (run there): the whole benchmark at CPU sizes, the
    host copies through the GPU's pinned host memory, every round trip exact."""
    out = tmp_path / "rs.json"
    assert bench.main(["--model", model, "--contexts", "256,1024", "--reps", "2",
                       "--json", str(out)]) == 0
    for row in json.loads(out.read_text())["rows"]:
        assert row["exact"] is True and row["platform"] == "gpu"
        assert row["host_memory_kind"] == "pinned_host" and row["h2d_GBps"] > 0
        # every move timed on the GPU's timeline too, its launches named
        for key in ("slot_snapshot", "slot_restore", "device_out", "device_in", "host_out",
                    "host_in"):
            assert 0 < row[f"{key}_dev_busy_us"] <= row[f"{key}_dev_us"], key
            assert row[f"{key}_launches"] >= 1 and row[f"{key}_kernels"], key
        # a move on the device is one program of one copy kernel: no index
        # from the host, no fusion or copy around it
        for key in ("slot_snapshot", "slot_restore", "device_out", "device_in"):
            assert row[f"{key}_launches"] == 1, (key, row[f"{key}_kernels"])
            (name,) = row[f"{key}_kernels"]
            assert name.startswith("CopyRowsKernel"), (key, name)
        assert row["d2h_dev_GBps"] > 0 and row["h2d_dev_GBps"] > 0


def test_device_time_spans_one_call_of_the_timeline(monkeypatch):
    """A call's device time is its first launch's start to its last one's
    end, the median over the calls; gaps between calls are left out."""
    calls = [[(0, 10, "fusion_a"), (15, 5, "MemcpyD2H")],           # span 20, busy 15
             [(100, 12, "fusion_a"), (130, 6, "MemcpyD2H")],        # span 36, busy 18
             [(500, 11, "fusion_a"), (520, 4, "MemcpyD2H")]]        # span 24, busy 15
    events = [e for c in calls for e in c]
    monkeypatch.setattr(timeline, "kernel_events", lambda call, runs: events)
    t = timeline.device_time(lambda: None, 3)
    assert t["us"] == pytest.approx(24e-3) and t["busy_us"] == pytest.approx(15e-3)
    assert t["launches"] == 2 and t["kernels"] == {"fusion_a": 1, "MemcpyD2H": 1}
    assert t["split"] is True
    monkeypatch.setattr(timeline, "kernel_events", lambda call, runs: events[:-1])
    t = timeline.device_time(lambda: None, 3)     # 5 events do not split into 3 calls
    assert t["split"] is False and t["us"] == pytest.approx(511e-3 / 3)
    monkeypatch.setattr(timeline, "kernel_events", lambda call, runs: [])
    assert timeline.device_time(lambda: None, 3) is None
