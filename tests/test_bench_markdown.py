"""benchmarks/run.py --markdown (dsv4_jax.app.bench.suite): a saved run's rows as
the tables of docs/perf/ops.md."""
import json

from dsv4_jax.app.bench.suite import main


def test_markdown_tables_from_saved_rows(tmp_path, capsys):
    rows = [
        {"op": "empty", "what": "empty FFI call", "us": 2.0},
        {"op": "gather_topk", "rows": 4096, "us": 25.0, "GBps": 1500.0, "copy_pct": 80.4,
         "vs_empty": 12.5, "impl": "cuda", "fmt": "ds_fp8", "T": 8, "k": 512},
        {"op": "flush_csa", "case": "decode B=8", "T": 8, "us": 13.0, "impl": "cuda",
         "fmt": "ds_fp8", "vs_empty": 6.5},
        {"op": "flush_hca", "case": "prefill T=4096", "T": 4096, "us": 2700.0, "impl": "cuda",
         "fmt": "ds_fp8", "vs_empty": 1350.0},
        {"op": "flash_decode_step", "B": 8, "ctx": 4096, "impl": "cuda", "ms": 2.5,
         "first_call_s": 0.4, "fmt": "ds_fp8", "span_us": 2412.34, "busy_us": 1800.0,
         "cache_busy_us": 1500.5, "kernels_per_layer": 6.5, "cache_kernels_per_layer": 4.25,
         "family_us": {"attention": 900.0, "indexer": 300.25, "writes": 250.0, "gathers": 0.0,
                       "copies": 10.0, "other": 339.75},
         "copy_kernels_per_layer": 0.5},
        {"op": "flash_decode_step", "B": 8, "ctx": 4096, "impl": "reference", "ms": 5.25,
         "first_call_s": 6.0, "fmt": "ds_fp8"},
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"device": "x", "platform": "gpu", "jax": "0", "rows": rows}))
    main(["--markdown", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert "| empty FFI call | | 2.00 | | | | 1.0 |" in lines
    # 1500 GB/s is 50 % of the 3.0 TB/s copy rate
    assert "| gather_topk | 4096 rows (T=8, k=512) | 25.00 | 1500 | 80 | 50 | 12.5 |" in lines
    assert "| flush_csa | decode B=8 T=8 | 13.00 |  |  |  | 6.5 |" in lines
    assert "| flush_hca | prefill T=4096 | 2700.00 |  |  |  | 1350.0 |" in lines
    assert ("| 8 | 4096 | cuda | 2.500 | 2412.3 | 1800.0 | 900.0 | 300.2 | 250.0 | 6.50 | 0.50 |"
            in lines)
    assert "| 8 | 4096 | reference | 5.250 | – | – | – | – | – | – | – |" in lines   # no timeline
