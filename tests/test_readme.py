"""The README's usage example runs as written."""
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    code = re.search(r"## Use\n\n```python\n(.*?)```", text, re.S).group(1)
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
