"""What a new user meets first and second: the demo refuses to check the
reference against itself, the command line answers bad input in one line
before any work (output paths, a demo too large to finish), `-h` shows every
option, messages say what happened, forgetting to donate the state is
caught, and the error counters can be reset. The README's code blocks are
tests/test_readme.py's."""
import argparse
import dataclasses
import importlib
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import _ffi, config as C, donation
from dsv4_jax.app import cli, demo
from dsv4_jax.app.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys, *argv) -> str:
    """argparse's error for argv (exit code 2): its last line."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def no_cpu_module(monkeypatch, tmp_path):
    """As if dsv4_jax were imported from a checkout (at tmp_path) without
    compiled modules."""
    monkeypatch.setattr(_ffi, "_registered", {})
    monkeypatch.setattr(_ffi, "_load_errors", {"cpu": "No module named 'dsv4_jax._dsv4_cpu'",
                                               "cuda": "No module named 'dsv4_jax._dsv4_cuda'"})
    monkeypatch.setattr(_ffi, "source_checkout", lambda: str(tmp_path))
    return tmp_path


# ---- item 1: the demo checks the compiled handlers or says why it cannot -------------------
def test_demo_fails_loudly_without_the_ffi_module(capsys, no_cpu_module, monkeypatch):
    code, out, err = run_cli(capsys, "demo", "--plain")
    assert code == 2 and out == ""                  # refused before anything ran
    assert err == (f"python -m dsv4_jax demo: error: no FFI handlers to check on cpu: "
                   f"dsv4_jax._dsv4_cpu is not built in {no_cpu_module / 'dsv4_jax'}, the source "
                   f"checkout Python imports dsv4_jax from; build it in place with "
                   f"`pip install -e .` in {no_cpu_module}, or run from another directory "
                   f"(--impl reference checks the jnp reference against itself)\n")
    # an installed package without the module says what failed instead
    monkeypatch.setattr(_ffi, "source_checkout", lambda: None)
    code, _, err = run_cli(capsys, "demo", "--plain")
    assert code == 2 and "dsv4_jax._dsv4_cpu did not load (No module named" in err


def test_info_names_the_missing_module_and_its_fix(capsys, no_cpu_module):
    code, out, _ = run_cli(capsys, "info", "--plain")
    assert code == 0
    assert f"  cpu: not loaded: dsv4_jax._dsv4_cpu is not built in {no_cpu_module}" in out, out
    assert "  cuda: not loaded: dsv4_jax._dsv4_cuda is not built in" in out, out


@pytest.mark.slow(reason="a whole demo; test_demo_passes_and_reports stays")
def test_demo_with_impl_reference_says_what_it_checked(capsys, no_cpu_module):
    code, out, err = run_cli(capsys, "demo", "--plain", "--model", "tiny", "--requests", "1",
                             "--context", "64", "--steps", "2", "--chunk", "32",
                             "--impl", "reference")
    assert code == 0, err
    assert "ops: reference" in out
    assert "note: --impl reference: both runs used the jnp reference" in out
    assert "no FFI module" not in out
    assert "check against the reference: PASS" in out


# ---- item 5: one-line errors, limits checked before anything runs ---------------------------
@pytest.mark.parametrize("command", ["plan", "bench"])
def test_json_to_a_missing_folder_is_one_line_before_any_work(capsys, command):
    line = usage_error(capsys, command, "--plain", "--json", "/nonexistent/dir/x.json")
    assert line == (f"python -m dsv4_jax {command}: error: argument --json: "
                    f"/nonexistent/dir/x.json: the folder /nonexistent/dir does not exist")
    assert capsys.readouterr().out == ""           # nothing ran


def test_bench_output_paths_are_checked_before_any_work(capsys, tmp_path):
    line = usage_error(capsys, "bench", "--plot", str(tmp_path))
    assert line.endswith(f"argument --plot: {tmp_path}: is a folder, expected a file path")
    line = usage_error(capsys, "bench", "--markdown", str(tmp_path / "missing.json"))
    assert line.endswith(f"argument --markdown: {tmp_path / 'missing.json'}: no such file")
    unwritable = tmp_path / "ro"
    unwritable.mkdir(mode=0o500)
    if not os.access(unwritable, os.W_OK):       # root writes anywhere
        line = usage_error(capsys, "bench", "--json", str(unwritable / "x.json"))
        assert line.endswith("x.json: not writable here")


BENCHMARKS = sorted(p[:-3] for p in os.listdir(os.path.join(os.path.dirname(__file__), "..",
                                                             "benchmarks"))
                    if p.startswith("bench_") and p.endswith(".py"))


@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_checks_its_json_path_first(capsys, script):
    main_of = importlib.import_module(script).main
    with pytest.raises(SystemExit) as e:
        main_of(["--json", "/nonexistent/dir/x.json"])
    assert e.value.code == 2
    assert "/nonexistent/dir/x.json: the folder /nonexistent/dir does not exist" in \
        capsys.readouterr().err


def test_help_lists_every_option_of_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["-h"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.help != argparse.SUPPRESS:
                for option in action.option_strings:
                    assert option in text, (name, option)
    assert "--ops" in text and "--corrupt-at-step" not in text


def test_bench_ops_know_every_op(capsys):
    """--ops takes every op the library exports (and the decode step);
    tests/test_cli.py's quick run times each."""
    parser = cli.build_parser()
    ops = "apply_step,write_layer,indexer_topk,attention"
    args = parser.parse_args(["bench", "--ops", ops])
    assert args.ops == ops.split(",")
    from dsv4_jax.app.bench.options import OPS
    for op in ("apply_step", "append", "write_layer", "indexer_topk", "attention",
               "gather_window", "gather_topk", "gather_all"):
        assert op in OPS
    line = usage_error(capsys, "bench", "--ops", "attention,softmax")
    assert "expected names among apply_step, append" in line and "'attention,softmax'" in line


def test_demo_refuses_more_requests_than_it_checks_in_minutes(capsys):
    code, out, err = run_cli(capsys, "demo", "--plain", "--requests", "1000")
    assert code == 2 and out == ""
    assert err.strip() == (
        "python -m dsv4_jax demo: error: --requests 1,000: 1,000 requests of up to 512 tokens "
        "through 4 layers are 2,048,000 token-layers for the run and its reference replay, "
        "more than the demo's 262,144 on a CPU (it would take many minutes); the most that "
        "fit are --requests 128 (or a shorter --context)")
    args = cli.build_parser().parse_args(["demo", "--requests", "128"])
    cli._demo_defaults(args)
    cli._demo_work(args, C.PRESETS[args.model])              # the most it names are accepted
    args.requests = 129
    with pytest.raises(cli.CliError, match="--requests 129"):
        cli._demo_work(args, C.PRESETS[args.model])


def test_plan_refuses_a_context_positions_cannot_hold(capsys):
    line = usage_error(capsys, "plan", "--context", str(10 ** 21))
    assert "--context: positions are int32, expected at most 2,147,483,520" in line
    assert C.MAX_CONTEXT == 2 ** 31 - 128 and C.MAX_CONTEXT % C.BLOCK_TOKENS == 0
    code, _, _ = run_cli(capsys, "plan", "--plain", "--requests", "1",
                         "--context", str(C.MAX_CONTEXT))
    assert code == 0
    line = usage_error(capsys, "plan", "--requests", "200", "--context", str(C.MAX_CONTEXT))
    assert "num_blocks: block ids are int32" in line


def test_demo_refuses_more_steps_than_it_runs(capsys):
    code, out, err = run_cli(capsys, "demo", "--plain", "--context", "100000000")
    assert code == 2 and out == ""
    m = re.fullmatch(r".*--context 100,000,000: with --chunk 64 it takes up to ([\d,]+) steps, "
                     r"more than the demo's 4,096; the largest that fits is ([\d,]+)\n", err)
    assert m, err
    largest = int(m.group(2).replace(",", ""))
    # the largest context it names is one the demo accepts, and not by far
    settings = demo.DemoSettings((largest - 32,), 64, 32)
    assert len(demo.schedule(settings)) <= cli.DEMO_MAX_STEPS
    settings = demo.DemoSettings((largest + C.BLOCK_TOKENS - 32,), 64, 32)
    assert len(demo.schedule(settings)) > cli.DEMO_MAX_STEPS


def test_demo_refuses_a_cache_beyond_memory(capsys, monkeypatch):
    budget = 64 << 20
    monkeypatch.setattr(cli, "_memory_budget", lambda: (budget, "test memory"))
    code, _, err = run_cli(capsys, "demo", "--plain", "--model", "tiny", "--context", "200000")
    assert code == 2
    m = re.search(r"need 2 x .* of cache, more than the 64\.00 MiB of test memory; "
                  r"the largest that fits is ([\d,]+)$", err.strip())
    assert m, err
    largest = int(m.group(1).replace(",", ""))
    size = lambda ctx: dj.memory_report(dj.CacheConfig.tiny(max_context=ctx)).total
    assert 2 * size(largest) <= budget < 2 * size(largest + C.BLOCK_TOKENS)


# ---- item 7: messages ---------------------------------------------------------------------------
def test_demo_short_context_names_context_not_the_default_steps(capsys):
    line = usage_error(capsys, "demo", "--context", "5")
    assert "--context: expected at least 8 tokens, got 5" in line and "--steps" not in line
    line = usage_error(capsys, "demo", "--context", "32", "--steps", "40")
    assert "--steps" in line and "got 40" in line


def test_impl_cuda_on_the_cpu_is_said_once(capsys):
    line = usage_error(capsys, "demo", "--impl", "cuda")
    assert "--impl cuda: 'cuda' needs the computation on cuda, but it runs on cpu" in line
    assert "impl: impl" not in line and "--impl: impl" not in line


def test_info_takes_plain_and_tells_built_from_usable(capsys, monkeypatch):
    code, out, _ = run_cli(capsys, "info", "--plain")
    assert code == 0 and re.search(r"^  cpu: loaded \(\d+ targets(, testing module)?\)$", out,
                                   re.M), out
    # a CUDA module that loaded on a machine without a GPU
    monkeypatch.setitem(_ffi._registered, "cuda", {"dsv4_apply_step"})
    monkeypatch.setattr(_ffi, "_load_errors", {})
    monkeypatch.setattr(_ffi, "_testing", {})
    code, out, _ = run_cli(capsys, "info", "--plain")
    assert "  cuda: built (1 targets), but no CUDA device is visible" in out, out


def test_one_flip_is_one_flip():
    state = dj.init_state(dj.CacheConfig.tiny(max_requests=1, max_context=128))
    nope = np.array(state.csa.kv.nope)
    nope.view(np.uint8)[0, 0, 0, 0] = 1           # 0 and the smallest subnormal: one step
    flipped = dataclasses.replace(state, csa=dataclasses.replace(
        state.csa, kv=dataclasses.replace(state.csa.kv, nope=jnp.asarray(nope))))
    check = demo.check_against(flipped, state)
    assert check.ok and re.search(r"up to 1 one-code flip of [\d,]+ codes$", check.message), \
        check.message


def test_plan_names_the_windows_row_for_what_it_holds(capsys):
    code, out, _ = run_cli(capsys, "plan", "--plain", "--model", "pro", "--context", "65536")
    assert code == 0
    rep = dj.memory_report(dj.CacheConfig.pro(max_requests=8, max_context=65536))
    assert re.search(rf"^windows\s+61\s+{rep.by_kind['swa']:,}\s", out, re.M), out
    assert not re.search(r"^swa\s+0\s", out, re.M)


def test_a_python_list_operand_gets_a_clear_error():
    state = dj.init_state(dj.CacheConfig.tiny(max_requests=2, max_context=128))
    with pytest.raises(ValueError, match=r"^slots: expected a jax or numpy array of shape \[\*\] "
                                         r"and dtype int32, got list$"):
        dj.gather_window(state, 0, [0, 1])


# ---- item 6: donation and the error counters ------------------------------------------------
def _tiny_step_inputs():
    cfg = dj.CacheConfig.tiny(max_requests=2, max_context=256)
    manager = dj.CacheManager(cfg)
    a = manager.admit()
    meta = manager.prepare_step({a: 3})
    kv = jnp.ones((meta.num_tokens, 512), jnp.bfloat16)
    return dj.init_state(cfg), meta, kv


def test_an_eager_write_warns_once(monkeypatch):
    monkeypatch.setattr(donation, "_warned", False)
    state, meta, kv = _tiny_step_inputs()
    with pytest.warns(dj.NotDonatedWarning, match="ran outside jax.jit"):
        state = dj.append(state, 0, meta, kv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = dj.append(state, 0, meta, kv)      # once per process
        jax.jit(lambda s, m, x: dj.append(s, 0, m, x))(state, meta, kv)   # traced: no warning


def test_check_donated_tells_a_donating_step_from_one_that_copies():
    state, meta, kv = _tiny_step_inputs()

    def step(state, meta, kv):
        return dj.append(dj.apply_step(state, meta), 0, meta, kv)

    copying = jax.jit(step)
    with pytest.raises(ValueError, match=r"cache state 0 is not donated \(\d+ of its arrays, "
                                         r"e\.g\. state\.block_table\)"):
        dj.check_donated(copying, state, meta, kv)
    dj.check_donated(jax.jit(step, donate_argnums=0), state, meta, kv)
    dj.check_donated(jax.jit(step, donate_argnames="state"), state=state, meta=meta, kv=kv)
    assert not state.errors.is_deleted()          # lowering only: nothing ran, nothing consumed
    with pytest.raises(ValueError, match="no CacheState"):
        dj.check_donated(jax.jit(lambda x: x), kv)


def test_reset_errors_zeroes_the_counters_in_and_out_of_jit():
    state, meta, _ = _tiny_step_inputs()
    bad = dj.StepMeta.build(token_slot=[-1], token_pos=[0], lengths=[0, 0],
                            new_blocks=[[9, 0, 0]], reset_slots=[7])
    state = jax.jit(dj.apply_step, donate_argnums=0)(state, bad)
    with pytest.raises(dj.CacheInputError, match="bad_slot: 2"):
        dj.check_errors(state)
    cleared = dj.reset_errors(state)
    dj.check_errors(cleared)
    assert cleared.errors.dtype == jnp.int32 and cleared.errors.shape == state.errors.shape
    dj.check_errors(jax.jit(dj.reset_errors)(state))
    # the other buffers are the same arrays
    assert cleared.csa.kv.nope is state.csa.kv.nope


def test_reset_errors_keeps_a_sharded_state_sharded():
    if len(jax.devices()) < 2:
        pytest.skip("needs several devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    cfg = dj.sharding.shard_config(dj.CacheConfig.tiny(max_requests=2, max_context=128),
                                   mesh, "data")
    state = dj.sharding.init_sharded_state(cfg, mesh)
    state = dataclasses.replace(state, errors=jax.device_put(
        jnp.arange(state.errors.size, dtype=jnp.int32), state.errors.sharding))
    cleared = dj.reset_errors(state)
    assert cleared.errors.sharding == state.errors.sharding
    assert not np.asarray(cleared.errors).any()


def test_an_eager_call_with_a_bad_operand_raises_before_any_donation_warning(monkeypatch):
    """The ValueError alone: the warning that a call copies the pools is for
    calls that run, not for ones refused at their checks."""
    state, meta, kv = _tiny_step_inputs()
    T = meta.num_tokens
    f32 = lambda *s: jnp.ones(s, jnp.float32)
    params = dj.CompressorParams(f32(128, 512), f32(512), f32(32))
    calls = {
        "append": lambda: dj.append(state, 0, meta, kv.astype(jnp.float32)),
        "apply_step": lambda: dj.apply_step(state, "meta"),
        "flush": lambda: dj.flush(state, 2, meta, f32(T, 512).astype(jnp.int32), f32(T, 512),
                                  params),
        "write_layer": lambda: dj.write_layer(state, 2, meta, kv, f32(T, 512),
                                              f32(T, 512).astype(jnp.int32), params),
    }
    for name, call in calls.items():
        monkeypatch.setattr(donation, "_warned", False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ValueError):
                call()
        assert not [w for w in seen if issubclass(w.category, dj.NotDonatedWarning)], name
