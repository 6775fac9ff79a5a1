"""The README's code blocks run as written and print what the README says
they print. Each is found by the marker line `<!-- test_readme: NAME -->`
just above it, so README and test cannot drift."""
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_block(name: str) -> str:
    """The ```python block right after the README's `<!-- test_readme: name -->`."""
    found = re.search(rf"<!-- test_readme: {name} -->\n```python\n(.*?)```", README.read_text(),
                      re.S)
    assert found, f"README.md: no ```python block right after <!-- test_readme: {name} -->"
    return found.group(1)


def readme_prints(name: str) -> list[str]:
    """What the README says block `name` prints: the `...` spans after
    "prints" in the paragraph right after the block, whitespace joined."""
    text = README.read_text()
    start = text.index(f"<!-- test_readme: {name} -->")
    after = text[text.index("```\n", text.index("```python", start) + 9) + 4:]
    paragraph = re.split(r"\n\s*\n", after.lstrip("\n"), maxsplit=1)[0]
    said = [" ".join(m.split()) for m in re.findall(r"`([^`]*)`", paragraph.split("prints", 1)[1])]
    assert said, f"README.md: no `...` of what block {name} prints"
    return said


def run_block(name: str, capsys) -> dict:
    """Block `name` run in this interpreter: its variables; its output must
    be the line the README shows."""
    scope = {}
    exec(compile(readme_block(name), "README.md", "exec"), scope)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1:] == readme_prints(name)[:1], out
    return scope


def test_readme_moves_example_runs(capsys):
    import dsv4_jax as dj
    scope = run_block("moves", capsys)
    m, state = scope["manager"], scope["state"]
    a, b, key = scope["a"], scope["b"], scope["key"]
    assert m.length_of(b) == 256 and m.length_of(a) == 256
    assert m.blocks_of(b) == m.prefix_blocks(key)
    assert scope["other_manager"].length_of(scope["b2"]) == 256
    # the prefix was written: b's slot holds a's 128 last positions, bit for bit
    snap = m.prefix_snapshot(key)
    assert sorted(np.asarray(snap.window.pos)[0]) == list(range(128, 256))
    for got, want in zip(jax.tree_util.tree_leaves(dj.snapshot(state, m.slot_of(b))),
                         jax.tree_util.tree_leaves(snap)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8))
    assert np.abs(np.asarray(snap.csa_comp)).sum() > 0

def test_readme_usage_example_runs(capsys):
    scope = run_block("use", capsys)
    state, manager = scope["state"], scope["manager"]
    a, b = scope["a"], scope["b"]
    assert manager.length_of(a) == 300 and manager.length_of(b) == 17
    table = np.asarray(state.block_table)
    assert list(table[manager.slot_of(a), :3]) == list(manager.blocks_of(a))
    # request b's window holds its 17 positions; entries 0..7 are visible to
    # every query at position >= 31 and only to those
    pos = np.asarray(scope["pos"])
    assert sorted(pos[1][pos[1] >= 0]) == list(range(17))
    valid = np.asarray(scope["valid"])
    tpos = np.asarray(scope["meta"].token_pos)
    slot = np.asarray(scope["meta"].token_slot)
    want = (slot[:, None] >= 0) & (np.arange(8)[None, :] < (tpos[:, None] + 1) // 4)
    np.testing.assert_array_equal(valid, want)
    assert np.abs(np.asarray(scope["entries"], np.float32)[valid]).sum(-1).min() > 0


# Run after the README's sharded block, in the same interpreter: what the
# block computed, checked against the rows it fed in.
SHARDED_CHECKS = textwrap.dedent("""
    assert len(jax.devices()) == 4 and cfg.num_shards == 4, jax.devices()
    # least-loaded admission: one request per shard
    assert sorted(manager.shard_of(r) for r in requests) == [0, 1, 2, 3]
    # the pools live split over the four devices
    assert len(state.csa.kv.nope.sharding.device_set) == 4
    kv_rows = np.asarray(kv.astype(jnp.float32))
    pos_all = np.asarray(pos)
    used = set()
    for r, n in zip(requests, [300, 17, 130, 64]):
        g = manager.global_slot(r)
        used.add(g)
        rows = manager.token_rows(r)
        assert rows.stop - rows.start == n
        p = pos_all[g]
        held = p >= 0
        # the window holds the last 128 positions, position q in ring slot q % 128
        assert sorted(p[held]) == list(range(max(0, n - 128), n)), (r, p)
        assert all(p[q % 128] == q for q in range(max(0, n - 128), n))
        # its RoPE channels are the bf16 input rows of those positions, exactly:
        # the request's rows of the global token axis are token_rows(r)
        win = np.asarray(window_of[r].astype(jnp.float32))
        for q in range(max(0, n - 128), n):
            np.testing.assert_array_equal(win[q % 128, 448:], kv_rows[rows.start + q, 448:])
        assert not np.any(win[~held])
    others = [g for g in range(cfg.max_requests) if g not in used]
    assert np.all(pos_all[others] == -1)
    print("sharded README example: ok")
""")


def run_script(path, devices, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_readme_sharded_example_runs_on_four_cpu_devices(tmp_path):
    script = tmp_path / "readme_sharded.py"
    script.write_text(readme_block("sharded") + SHARDED_CHECKS)
    done = run_script(script, 4)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sharded README example: ok" in done.stdout
    assert readme_prints("sharded")[0] in done.stdout.splitlines()


def test_readme_sharded_example_runs_on_one_device(tmp_path):
    """A mesh of one device is one shard: the example runs as printed."""
    script = tmp_path / "readme_sharded.py"
    script.write_text(readme_block("sharded"))
    done = run_script(script, 1)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == ("1 shard(s) on 1 device(s): requests on shards "
                                            "[0, 0, 0, 0], windows [128, 17, 128, 64] positions")


def test_readme_processes_example_runs_as_two_processes(tmp_path):
    """The per-process script, started as the block's comment says: two
    processes of two CPU devices each, each printing its line."""
    from dsv4_jax.multiprocess import run_processes
    script = tmp_path / "serve.py"
    script.write_text(readme_block("processes"))
    env = lambda i: {"JAX_PLATFORMS": "cpu",
                     "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    results = run_processes(lambda i, address: [sys.executable, str(script), address, "2",
                                                str(i)], 2, env=env, timeout_s=300)
    lines = []
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
        lines += [l for l in r.output.splitlines() if l.startswith("process ")]
    assert lines[0] == ("process 0 of 2: request 0 holds 3 tokens, its window positions "
                        "[0, 1, 2]")
    assert lines[1] == readme_prints("processes")[0]
