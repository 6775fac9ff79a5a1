"""The decode-step benchmark (dsv4_jax/app/bench/model_step.py and
benchmarks/bench_decode_step.py) runs end to end on the CPU and reports its
fields; its step does the same work as the jnp reference; its timeline
summary counts and classifies what it is given."""
import json

import jax
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax.app.bench import device_timeline, filled_state, model_step as bs
from dsv4_jax import config as C
from conftest import requires_cpu_ffi

import bench_decode_step


def test_layer_plan_splits_the_presets_into_prefix_and_repeated_pair():
    assert bs.layer_plan(dj.CacheConfig.flash(1, 512).layer_kinds) == (3, (C.HCA, C.CSA), 20)
    # Pro: HCA, then (HCA, CSA) x 30
    assert bs.layer_plan(dj.CacheConfig.pro(1, 512).layer_kinds) == (1, (C.HCA, C.CSA), 30)
    assert bs.layer_plan(dj.CacheConfig.tiny().layer_kinds) == (2, (C.HCA, C.CSA), 1)


def test_variant_names_round_trip():
    for text in ("base", "gathers", "no-return-state", "separate-write+unroll",
                 "gathers+separate-write+no-return-state+unroll"):
        assert bs.Variant.parse(text).name == text
    assert bs.Variant.parse("base") == bs.Variant()
    assert bs.Variant.parse("gathers") == bs.Variant(gathers=True)
    for bad in ("rolled", "", "base+unroll"):
        with pytest.raises(ValueError, match="variant"):
            bs.Variant.parse(bad)


def test_cases_option_parses_and_refuses():
    assert bench_decode_step.cases("1x4096,64x64k") == [(1, 4096), (64, 65536)]
    for bad in ("64", "0x4096", "8x", "axb"):
        with pytest.raises(Exception, match="BxCONTEXT"):
            bench_decode_step.cases(bad)


def test_timeline_summary_of_two_hand_made_steps():
    append = "dsv4::(anonymous namespace)::AppendKernel(dsv4::(anonymous namespace)::AppendArgs)"
    events = [(0, 10_000, append), (12_000, 1_000, "memcpy32_post"),
              (14_000, 2_000, "loop_add_fusion"),
              (100_000, 20_000, append), (121_000, 1_000, "memcpy32_post"),
              (123_000, 2_000, "loop_add_fusion")]
    s = device_timeline.timeline_summary(events, steps=2, layers=1)
    assert s["split"] and s["kernels_per_step"] == 3 and s["kernels_per_layer"] == 3
    assert s["cache_kernels_per_layer"] == 2 and s["copy_kernels_per_step"] == 1
    assert s["other_kernels_per_layer"] == 1
    assert s["busy_us"] == 18.0 and s["cache_busy_us"] == 16.0
    assert s["span_us"] == (16.0 + 25.0) / 2          # steps span 16 and 25 us
    assert s["family_us"] == {"attention": 0.0, "indexer": 0.0, "writes": 15.0, "gathers": 0.0,
                              "copies": 1.0, "other": 2.0}
    assert s["copy_kernels_per_layer"] == 1
    by_name = {k["name"]: k for k in s["kernels"]}
    assert by_name["AppendKernel"] == {"name": "AppendKernel", "kind": "cache", "count": 1,
                                       "total_us": 15.0, "mean_us": 15.0}
    assert by_name["memcpy32_post"]["kind"] == "copy"
    assert by_name["loop_add_fusion"]["kind"] == "other"
    assert [k["name"] for k in s["kernels"]][0] == "AppendKernel"   # most time first


def test_kernel_sequence_of_a_hand_made_step():
    """Layers start at each launch of the step's first cache kernel; names
    are cut at the parenthesis matching the final one."""
    append = "dsv4::(anonymous namespace)::AppendKernel(dsv4::(anonymous namespace)::AppendArgs)"
    window = "dsv4::(anonymous namespace)::GatherWindowKernel(dsv4::GatherWindowArgs)"
    step = []
    for layer in range(3):
        t = layer * 100_000
        step += [(t, 5_000, append), (t + 6_000, 3_000, window),
                 (t + 10_000, 1_000, "memcpy32_post"), (t + 12_000, 2_000, "loop_add_fusion")]
    seq, why = device_timeline.kernel_sequence(step, layers=3, first=1)
    assert why is None
    assert [(k["name"], k["kind"]) for k in seq] == [
        ("AppendKernel", "cache"), ("GatherWindowKernel", "cache"), ("memcpy32_post", "copy"),
        ("loop_add_fusion", "other")] * 2
    assert (seq[0]["start_us"], seq[0]["us"], seq[0]["gap_us"]) == (0.0, 5.0, 86.0)
    assert (seq[1]["start_us"], seq[1]["us"], seq[1]["gap_us"]) == (6.0, 3.0, 1.0)
    assert seq[4]["start_us"] == 100.0 and seq[-1]["start_us"] == 112.0
    seq, why = device_timeline.kernel_sequence(step, layers=4, first=1)
    assert seq == [] and "3 launches of AppendKernel for 4 layers" in why


def test_kernels_fall_into_op_families():
    def dsv4(name):
        return f"void dsv4::(anonymous namespace)::{name}(dsv4::(anonymous namespace)::Args)"
    family = device_timeline.kernel_family
    for name, want in [("AttentionKernel<dsv4::cuda::wgmma::Products>", "attention"),
                       ("AttentionChunkEncodeKernel", "attention"),
                       ("AttentionKernel<dsv4::cuda::warp_mma::Products>", "attention"),
                       ("ScoreKernelMxfp4<4>", "indexer"),
                       ("SelectKernel", "indexer"), ("WriteLayerKernel", "writes"),
                       ("AppendKernel", "writes"), ("FlushPlanKernel", "writes"),
                       ("ResetAndScrubKernel", "writes"), ("GatherTopkKernel", "gathers"),
                       ("CopyRowsKernel", "other")]:
        assert family(dsv4(name)) == want, name
    assert (device_timeline.kernel_name(dsv4("AttentionKernel<dsv4::cuda::wgmma::Products>"))
            == "AttentionKernel<dsv4::cuda::wgmma::Products>")
    assert family("memcpy32_post") == "copies"
    assert family("loop_add_fusion") == "other"
    assert family("input_reduce_fusion_Attention") == "other"     # not a dsv4 kernel


@pytest.mark.slow(reason="the decode-step bench against the reference; its quick run stays")
@requires_cpu_ffi
def test_step_does_the_reference_work():
    """The CPU handlers' step equals the jnp reference's on a filled state
    that no op counts as bad input, for the attention step and the gathers
    one: the state bit for bit (but for the online-softmax accumulators,
    whose expf differs by a few ulps between XLA and libm,
    ffi/include/dsv4/numerics.h), h of the gathers exactly, h of attention
    within the rounding of bf16 outputs summed in a different fp32 order."""
    B, ctx = 2, 512
    cfg = dj.CacheConfig.tiny(max_requests=B, max_context=ctx)
    x = bs.step_inputs(B, ctx)
    results = {}
    for impl, variant in [("reference", "base"), ("cpu", "no-return-state+unroll"),
                          ("reference", "gathers+separate-write"), ("cpu", "gathers")]:
        state, h = bs.make_step(cfg, ctx, bs.Variant.parse(variant), impl)(
            filled_state.filled_state(cfg, ctx), x)
        results[impl, variant] = jax.tree_util.tree_map(np.asarray, (state, h))
    ref_state, ref_h = results["reference", "base"]
    assert not ref_state.errors.any()
    assert np.abs(ref_h).sum() > 0     # the reads found entries
    gathers_h = results["reference", "gathers+separate-write"][1]
    assert np.abs(gathers_h).sum() > 0
    np.testing.assert_array_equal(results["cpu", "gathers"][1], gathers_h)
    # 4 layers of 64 heads of bf16 outputs: each within 2^-8 of its size
    attn_h = results["cpu", "no-return-state+unroll"][1]
    np.testing.assert_allclose(attn_h, ref_h, rtol=0, atol=2 ** -6 * np.abs(ref_h).max())
    assert not np.array_equal(attn_h, gathers_h)
    for key, (state, _) in results.items():
        for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state),
                                     jax.tree_util.tree_leaves(ref_state)):
            where = f"{key} {jax.tree_util.keystr(path)}"
            if where.endswith("comp"):   # atol: a weighted sum that cancels keeps the
                # absolute error of its terms, which are of order 1
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=where)
            else:
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                              err_msg=where)


@requires_cpu_ffi
def test_quick_run_reports_its_fields(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert bench_decode_step.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["B"], row["context"], row["model"], row["variant"]) == (1, 512, "flash", "base")
    assert row["host_ms"] > 0 and row["first_call_s"] > 0
    assert row["errors"] == [0] * dj.errors.NUM_ERROR_KINDS
    if jax.default_backend() == "gpu":
        assert row["kernels_per_step"] > 0 and row["span_us"] > 0
        assert 0 < row["cache_busy_us"] <= row["busy_us"] and row["sequence"]
        assert row["family_us"]["attention"] > 0 and row["family_us"]["writes"] > 0
    assert "| 1 | 512 | base |" in capsys.readouterr().out


def test_json_path_is_checked_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode_step.main(["--quick", "--json", str(tmp_path / "no" / "step.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--json" in err and "does not exist" in err
