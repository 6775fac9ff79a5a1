"""Which tests are `slow`: the default `pytest` leaves them out (pyproject's
addopts `-m "not slow"`), `pytest -m "slow or not slow"` runs them too (CI).

The list names tests by function, or by function and parameters as pytest
prints them, not by file: tests can move between files and folders without
it going stale. Each is slow here (tens of seconds on 2 cores) or needs
gigabytes; a quicker test of the same property stays in the default run
(the same test on the CPU handlers, a smaller case, or a sibling test).
"""
import pytest

SLOW = {
    # the CPU handlers against the reference over 8 steps of every kv_format
    # (the demo and the per-op parity tests cover the same in the default run)
    "test_ffi_equals_reference_step_by_step",
    # the reference runs of tests whose CPU-handler runs stay
    "test_next_owner_of_a_block_reads_nothing_of_the_previous_owner[reference]",
    "test_chunked_ds_fp8_matches_oracle[reference]",
    "test_chunked_other_formats_match_oracle[reference-fp8_token]",
    "test_chunked_other_formats_match_oracle[reference-bf16]",
    "test_whole_step_is_in_place[reference-1]",
    "test_whole_step_is_in_place[reference-70]",
    "test_long_context_many_ties[reference-mxfp4]",
    "test_long_context_many_ties[reference-bf16]",
    "test_traced_layer_equals_static_layer[reference]",
    "test_traced_bad_layer_counts_once_and_changes_nothing[reference]",
    "test_bad_tokens_are_dropped_and_counted[reference]",
    "test_commit_equals_a_cache_fed_only_the_kept_tokens[1-reference]",
    "test_commit_equals_a_cache_fed_only_the_kept_tokens[4-reference]",
    "test_commit_equals_a_cache_fed_only_the_kept_tokens[7-reference]",
    "test_bad_counts_are_counted_once_and_keep_nothing[reference]",
    "test_rejected_rows_leave_no_count_and_kept_rows_count_as_written[reference]",
    "test_verify_reads_equal_a_prefill_chunk_of_the_same_tokens[reference]",
    # the largest of its sizes (the others stay)
    "test_select_spread_over_a_cluster[cpu-262144]",
    "test_reference_write_step_temporaries_stay_small[bf16]",
    # sharding over 4 devices (the 2-device run stays) and the sharded apply_step
    "test_sharded_workload_equals_each_shard_run_alone[4]",
    "test_sharded_apply_step_equals_unsharded_per_shard_and_stays_in_place",
    # whole demos: the passing one stays
    "test_demo_fails_on_a_corrupted_cache",
    "test_demo_with_impl_reference_says_what_it_checked",
    "test_demo_speculative_keeps_random_prefixes_and_passes",
    # a pool beyond 2 GiB: ~6 GB of memory
    "test_pool_beyond_2_gib",
}


@pytest.hookimpl(tryfirst=True)      # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name in SLOW or getattr(item, "originalname", item.name) in SLOW:
            item.add_marker(pytest.mark.slow)
