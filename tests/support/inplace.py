"""Assertions that a jitted step updates the state in place (docs/design/in-place.md):
assert_in_place for a step over a whole state, check_in_place for one CPU
handler's call over the leaves it writes."""
from __future__ import annotations

import re

import jax


def _aliased_params(hlo: str) -> set[int]:
    """Parameter numbers named in the module's input_output_alias header."""
    header = hlo.split("\n", 1)[0]
    if "input_output_alias=" not in header:
        return set()
    header = header.split("input_output_alias=", 1)[1].split("entry_computation_layout", 1)[0]
    return {int(p) for _, p in re.findall(r"\{([\d,]*)\}:\s*\((\d+),", header)}


def _copied_shapes(hlo: str) -> list[str]:
    """Result shapes of every copy instruction in the optimized HLO."""
    return re.findall(r"=\s*(\S+?\[[\d,]*\])\S*\s+copy\(", hlo)


def _pointers(x) -> tuple:
    """Device buffer address of every shard of an array."""
    return tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)


def compiled_text(step, *args):
    return step.lower(*args).compile().as_text()


def assert_in_place(step, state, *args, min_bytes: int = 4096, only=None):
    """`step(state, *args)` (jitted with the state donated as argument 0)
    aliases every state leaf of at least `min_bytes` and copies none of them;
    after running, every such leaf keeps its buffer pointer. `only`, a
    predicate on a leaf's path string, narrows the leaves checked. Returns the
    new state."""
    hlo = compiled_text(step, state, *args)
    with_path = jax.tree_util.tree_leaves_with_path(state)
    leaves = [x for _, x in with_path]
    aliased = _aliased_params(hlo)
    big = [i for i, (path, x) in enumerate(with_path) if x.nbytes >= min_bytes
           and (only is None or only(jax.tree_util.keystr(path)))]
    missing = [i for i in big if i not in aliased]
    assert not missing, f"state leaves {missing} are not aliased in:\n{hlo[:2000]}"
    pool_shapes = {f"{x.dtype.name if hasattr(x.dtype, 'name') else x.dtype}"
                   f"[{','.join(map(str, x.shape))}]" for i, x in enumerate(leaves) if i in big}
    copies = [s for s in _copied_shapes(hlo)
              if any(s.endswith("[" + p.split("[", 1)[1]) for p in pool_shapes)]
    assert not copies, f"pool-shaped copies in the compiled step: {copies}"
    before = [_pointers(leaves[i]) for i in big]
    new_state = step(state, *args)
    after_leaves = jax.tree_util.tree_leaves(new_state)
    after = [_pointers(after_leaves[i]) for i in big]
    assert before == after, "a donated pool moved to another buffer"
    return new_state


def pointers(tree):
    return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)]


def check_in_place(step, st, args, leaves_of):
    compiled = jax.jit(step, donate_argnums=0).lower(st, *args).compile()
    text = compiled.as_text()
    assert "input_output_alias" in text
    # no copy instruction producing a pool-sized array
    for leaf in jax.tree_util.tree_leaves(leaves_of(st)):
        if leaf.size >= 4096:
            shape = ",".join(map(str, leaf.shape))
            assert not re.search(rf"\[{shape}\]\{{[^}}]*\}} copy\(", text), shape
    before = pointers(leaves_of(st))
    new = compiled(st, *args)
    assert pointers(leaves_of(new)) == before
