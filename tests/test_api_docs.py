"""The API reference (docs/api.md and its section pages under docs/api/) is
what tools/gen_api.py writes from today's docstrings, and it covers every
public name."""
import difflib
import importlib.resources
import importlib.util
import pathlib
import re

import dsv4_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def pages() -> dict[str, str]:
    """Every page of the reference on disk, {path relative to docs/: text}."""
    paths = [DOCS / "api.md"] + sorted((DOCS / "api").glob("*.md"))
    return {str(p.relative_to(DOCS)): p.read_text() for p in paths}


def sections() -> dict[str, str]:
    """Every "## title" section of every page: {title: its text}."""
    out = {}
    for text in pages().values():
        out.update(re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    return out


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "tools" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date():
    want, _ = load_generator().render()
    on_disk = pages()
    assert set(on_disk) == set(want), "pages added or removed: run `python tools/gen_api.py`"
    for path, text in want.items():
        if text != on_disk[path]:
            diff = "".join(list(difflib.unified_diff(
                on_disk[path].splitlines(True), text.splitlines(True), f"docs/{path}",
                "regenerated"))[:60])
            raise AssertionError(f"docs/{path} is stale: run `python tools/gen_api.py` and "
                                 "commit it\n" + diff)


def test_every_public_object_has_a_docstring():
    _, missing = load_generator().render()
    assert not missing, f"public objects without a docstring: {missing}"


def test_every_public_name_has_an_entry():
    text = "\n".join(pages().values())
    headings = set(re.findall(r"^### `dsv4_jax\.(?:\w+\.)?(\w+)`$", text, re.M))
    assert set(dsv4_jax.__all__) <= headings, set(dsv4_jax.__all__) - headings
    for name in ("shard_config", "init_sharded_state", "ShardedCacheManager"):
        assert f"### `dsv4_jax.sharding.{name}`" in text


def test_api_reference_is_well_formed_markdown():
    """Fences balanced, so no code block swallows the rest of a page, and
    every heading one level below the one it sits under at most."""
    for path, text in pages().items():
        lines = text.splitlines()
        fences = [i for i, l in enumerate(lines) if l.startswith("```")]
        assert len(fences) % 2 == 0, f"{path}: an unclosed ``` fence"
        inside = set()
        for start, end in zip(fences[::2], fences[1::2]):
            assert lines[start] in ("```python", "```text"), (path, lines[start])
            assert lines[end] == "```", (path, end + 1, lines[end])
            inside.update(range(start, end + 1))
        level = 0
        for i, l in enumerate(lines):
            if i not in inside and l.startswith("#"):
                new = len(l) - len(l.lstrip("#"))
                assert new <= level + 1, f"{path} line {i + 1}: heading level {new} under {level}"
                level = new


def test_package_is_typed():
    assert (importlib.resources.files("dsv4_jax") / "py.typed").is_file()


def test_every_op_is_under_ops_and_the_conventions_name_them():
    """The reference lists each op under "Ops", none under "Other names", and
    its conventions cover the ops a model calls (write_layer, attention) and
    what jax.vmap does."""
    sections_ = sections()
    assert "Other names" not in sections_
    for op in ("apply_step", "append", "flush", "write_layer", "indexer_topk", "attention",
               "gather_window", "gather_topk", "gather_all"):
        assert f"### `dsv4_jax.{op}`" in sections_["Ops"], op
    for name in ("`write_layer`", "`attention`", "`jax.vmap`"):
        assert name in sections_["Conventions"], name
