"""Which tests are `slow`: the default `pytest` leaves them out (pyproject's
addopts `-m "not slow"`), `pytest -m "slow or not slow"` runs them too (CI).

Two kinds. The reference run of a test that also runs the CPU handler on the
same parameters (`[reference-...]` beside `[cpu-...]`), where the CPU
module is built and the CPU runs the tests: the jnp reference compiles for
seconds where the handler compiles in a blink, and the default run still
holds the reference to the handler byte for byte (the demo's replay,
test_ffi_vs_reference's quick cases, the agreement tests of each op). And
the tests named in SLOW, by function, or by function and parameters as
pytest prints them (a `*` matches any run of characters), not by file, so
tests can move without the list going stale: each is slow here (tens of
seconds on 2 cores) or needs gigabytes, and a quicker test of the same
property stays in the default run (a smaller case, or a sibling test).
"""
import fnmatch

import pytest

SLOW = {
    # the attention benchmark's quick run on bf16 pools (the ds_fp8 one stays)
    "test_quick_run_bf16_pools",
    # the CPU handlers against the reference over 8 steps of every kv_format
    # (the demo and the per-op parity tests cover the same in the default run)
    "test_ffi_equals_reference_step_by_step",
    # the largest of its sizes (the others stay)
    "test_select_spread_over_a_cluster[cpu-262144]",
    "test_reference_write_step_temporaries_stay_small[bf16]",
    # sharding over 4 devices (the 2-device run stays) and the sharded apply_step
    "test_sharded_workload_equals_each_shard_run_alone[4-*]",
    "test_sharded_apply_step_equals_unsharded_per_shard_and_stays_in_place",
    # sharded moves (the unsharded ones stay, and sharded ops: test_sharding)
    "test_prefix_sharing_on_a_sharded_state",
    "test_export_import_into_another_cache_and_a_sharded_one",
    # two processes against one (two-process runs of the example and the
    # README's script stay)
    "test_two_processes_equal_one_process_byte_for_byte[*]",
    # whole demos: the passing one stays
    "test_demo_fails_on_a_corrupted_cache",
    "test_demo_with_impl_reference_says_what_it_checked",
    "test_demo_preempts_and_resumes_mid_decode_and_still_passes",
    "test_demo_speculative_keeps_random_prefixes_and_passes",
    "test_demo_layer_scan_equals_unrolled_layers",
    # the benchmarks' whole quick runs and the decode-step bench's parity (the
    # bench command on two ops and the decode step's quick run stay)
    "test_bench_writes_numbers",
    "test_quick_run_rows",
    "test_cli_run_reports_exact_round_trips",
    "test_step_does_the_reference_work",
    # prefill chunks of the window and of HCA entries through every
    # implementation (the CSA chunk, window and picks both, stays)
    "test_implementations_agree[swa-chunk]",
    "test_implementations_agree[hca-chunk]",
    # the attention block against Hugging Face's on ds_fp8 pools and with the
    # library's indexer (the bf16 run with HF's picks and the mutation stay)
    "test_ds_fp8_pools_match_hf_on_fp8_rows[cpu]",
    "test_library_indexer_picks_overlap_hf_and_bound_the_output[cpu]",
    # a pool beyond 2 GiB: ~6 GB of memory
    "test_pool_beyond_2_gib",
}


@pytest.hookimpl(tryfirst=True)      # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    patterns = [p.replace("[", "[[]") for p in SLOW]     # "[" of the parameters, literally
    names = {item.name for item in items}
    twins = _cpu_runs_here()
    for item in items:
        own = (item.name, getattr(item, "originalname", item.name))
        if any(fnmatch.fnmatchcase(name, p) for name in own for p in patterns) or \
                (twins and _cpu_twin(item.name) in names):
            item.add_marker(pytest.mark.slow)


def _cpu_twin(name: str):
    """test_x[cpu-a] for test_x[reference-a] (the impl among the parameters),
    else None."""
    function, _, params = name.partition("[")
    tokens = params.rstrip("]").split("-")
    if "reference" not in tokens:
        return None
    return f"{function}[{'-'.join('cpu' if t == 'reference' else t for t in tokens)}]"


def _cpu_runs_here() -> bool:
    """Whether the CPU handler's runs are not skipped: the CPU module built
    and the CPU the default backend (support.marks.requires_cpu_ffi)."""
    import jax
    from dsv4_jax import _ffi
    return _ffi.has_target("cpu", "dsv4_apply_step") and jax.default_backend() == "cpu"
