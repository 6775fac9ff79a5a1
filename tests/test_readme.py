"""The README's code blocks run as written. Each is found by the marker line
`<!-- test_readme: NAME -->` just above it, so README and test cannot drift."""
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_block(name: str) -> str:
    """The ```python block right after the README's `<!-- test_readme: name -->`."""
    found = re.search(rf"<!-- test_readme: {name} -->\n```python\n(.*?)```", README.read_text(),
                      re.S)
    assert found, f"README.md: no ```python block right after <!-- test_readme: {name} -->"
    return found.group(1)


def test_readme_moves_example_runs():
    scope = {}
    exec(compile(readme_block("moves"), "README.md", "exec"), scope)
    m = scope["manager"]
    assert m.length_of(scope["b"]) == 256 and m.length_of(scope["a"]) == 256
    assert m.blocks_of(scope["b"]) == m.prefix_blocks(scope["key"])
    assert scope["other_manager"].length_of(scope["b2"]) == 256


def test_readme_usage_example_runs():
    code = readme_block("use")
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
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


def test_readme_sharded_example_runs_on_four_cpu_devices(tmp_path):
    script = tmp_path / "readme_sharded.py"
    script.write_text(readme_block("sharded") + SHARDED_CHECKS)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sharded README example: ok" in done.stdout
