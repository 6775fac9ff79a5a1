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
    table = np.asarray(state.block_table)
    assert manager.length_of(a) == 301 and manager.length_of(b) == 18
    assert list(table[manager.slot_of(a), :3]) == list(manager.blocks_of(a))
