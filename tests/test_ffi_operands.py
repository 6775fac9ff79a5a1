"""Each FFI target's operands as its op module documents them (the "FFI
target" block of dsv4_jax/ops/<op>.py's docstring) are the operands its
handlers bind (DSV4_<OP>_OPERANDS in ffi/include/dsv4/<op>.h, handed to
Python by _dsv4_cpu.operands()): a name added, dropped or reordered on one
side only fails here.

How the documented block is read:
  - a block starts at a line naming the target in double quotes (`FFI target
    "dsv4_x"` or `"dsv4_x"` alone) and holds the sections `attrs`, `args`
    and `rets`, each its keyword line and the lines indented deeper;
  - a section is a comma-separated list of operands, each its name first;
    types (`[...]`) and remarks (`(...)`) are dropped, `x[, y]` (y optional)
    lists y; `then the aliased:` marks where the operands updated in place
    begin; `rets  the aliased buffers, same order.` means those operands;
  - names: dots as underscores (the state leaf swa.pos is swa_pos).
How the bound list is read:
  - attributes bound as one struct (ATTRS, ffi/include/dsv4/attrs.h) come as
    its members, each an attribute, in the struct's order;
  - an argument updated in place is bound as `<name>_in`: compared as <name>;
  - the remaining arguments or results (ARGS/RETS) named G stand for the
    documented operands after the fixed ones: every one named G or G_<leaf>
    (swa_kv -> swa_kv, or swa_kv_nope, swa_kv_rope, swa_kv_scale), except
    that G = `aliased` stands for exactly the in-place operands.
"""
import ast
import pathlib
import re

import pytest

from dsv4_jax import _ffi

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ROOT / "dsv4_jax" / "ops"
OP_LINE = re.compile(r"^DSV4_OP\((\w+), (\w+), (\w+), (\w+), (\w+)\)$", re.M)
TARGETS = [t for _, t, _, _, _ in OP_LINE.findall(
    (ROOT / "ffi" / "include" / "dsv4" / "ops.def").read_text())]
TARGET_LINE = re.compile(r'^(?:FFI target )?"(dsv4_\w+)"')
SECTION = re.compile(r"^( *)(attrs|args|rets)\s+(.*)$")
ALIASED = "then the aliased:"


def _names(text: str) -> tuple[list[str], int | None]:
    """The operand names of one section, and the index where the aliased
    ones begin (None: no `then the aliased:`)."""
    text = re.sub(r"\[, ([\w.]+)\]", r", \1", text)      # x[, y]: y is an operand
    text = re.sub(r"\[[^\[\]]*\]", "", text)              # types
    while re.search(r"\([^()]*\)", text):                  # remarks, nested
        text = re.sub(r"\([^()]*\)", "", text)
    names, aliased = [], None
    for item in text.split(","):
        item = item.strip()
        if item.startswith(ALIASED):
            aliased, item = len(names), item[len(ALIASED):].strip()
        if item:
            names.append(item.split()[0].rstrip(".").replace(".", "_"))
    return names, aliased


def documented() -> dict[str, dict[str, list[str]]]:
    """{target: {"attrs"|"args"|"rets": names}} from every op module."""
    out: dict[str, dict[str, list[str]]] = {}
    for path in sorted(OPS.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        target, section, indent = None, None, 0
        raw: dict[str, dict[str, str]] = {}
        for line in doc.splitlines():
            m = TARGET_LINE.match(line.strip())
            if m and line == line.lstrip():
                target, section = m.group(1), None
                assert target not in out and target not in raw, f"{target} documented twice"
                raw[target] = {}
                continue
            m = SECTION.match(line)
            if target and m:
                indent, section = len(m.group(1)), m.group(2)
                raw[target][section] = m.group(3)
            elif section and len(line) - len(line.lstrip()) > indent:
                raw[target][section] += " " + line.strip()
            else:
                section = None
        for target, sections in raw.items():
            args, aliased = _names(sections.get("args", ""))
            rets = sections.get("rets", "")
            out[target] = {
                "attrs": _names(sections.get("attrs", ""))[0], "args": args,
                "aliased": args[aliased:] if aliased is not None else [],
                "rets": (args[aliased:] if rets.startswith("the aliased buffers")
                         else _names(rets)[0]),
                "module": path.name}
    return out


def _match(kind: str, doc: list[str], aliased: list[str], bound: list[tuple[str, str]],
           fixed_role: str, rest_role: str) -> list[str]:
    """What differs between documented names and the bound (role, name) of
    one kind (arguments or results)."""
    fixed = [n.removesuffix("_in") for r, n in bound if r == fixed_role]
    rest = [n.removesuffix("_in") for r, n in bound if r == rest_role]
    problems = []
    if doc[:len(fixed)] != fixed:
        problems.append(f"{kind}: documented {doc[:len(fixed)]}, bound {fixed}")
    tail = doc[len(fixed):]
    if not rest:
        if tail:
            problems.append(f"{kind}: documented {tail} after the bound ones")
    elif rest == ["aliased"]:
        if not aliased or tail != aliased:
            problems.append(f"{kind}: the remaining ({rest[0]}) should be the aliased "
                            f"{aliased}, documented {tail}")
    elif not tail or any(n != rest[0] and not n.startswith(rest[0] + "_") for n in tail):
        problems.append(f"{kind}: the remaining ({rest[0]}) documented as {tail}")
    return problems


@pytest.fixture(scope="module")
def docs():
    return documented()


def _bound(target):
    try:
        return _ffi.operands(target)
    except KeyError as e:
        pytest.skip(str(e))


def test_every_target_is_documented_once(docs):
    """Each target of ops.def has one block, and no block names another."""
    assert set(docs) == set(TARGETS)


@pytest.mark.parametrize("target", TARGETS)
def test_documented_operands_are_the_bound_ones(docs, target):
    bound = _bound(target)
    if target not in docs:
        pytest.fail(f"{target}: no FFI target block in dsv4_jax/ops/*.py")
    doc = docs[target]
    problems = []
    attrs = [n for r, n in bound if r == "attr"]
    if doc["attrs"] != attrs:
        problems.append(f"attrs: documented {doc['attrs']}, bound {attrs}")
    problems += _match("args", doc["args"], doc["aliased"], bound, "arg", "args")
    problems += _match("rets", doc["rets"], doc["aliased"], bound, "ret", "rets")
    assert not problems, f"{target} ({doc['module']}): " + "; ".join(problems)


@pytest.mark.parametrize("op", ["csa", "hca"])
def test_serial_flush_binds_flushs_operands(op):
    """The testing module's flush on the serial walk alone takes flush's
    operands, so it stands in for dsv4_flush_<op> (the window plan's oracle)."""
    serial = f"dsv4_flush_{op}_serial"
    if not _ffi.has_target("cpu", serial):
        pytest.skip(f"no CPU testing module ({_ffi.TESTING_BUILD})")
    assert _ffi.operands(serial) == _bound(f"dsv4_flush_{op}")


def test_the_reader_sees_what_it_should():
    """The reading rules on one made-up block, so a rule that reads nothing
    cannot pass the tests above unnoticed."""
    names, aliased = _names("layer i32[] (global, -1 = bad), meta i32[P >= 2T] (a, (b, c)), "
                            "then the aliased: swa.pos i32[L, R, 128], errors i32[9], "
                            "swa.kv.nope, swa.kv.rope[, swa.kv.scale]")
    assert names == ["layer", "meta", "swa_pos", "errors", "swa_kv_nope", "swa_kv_rope",
                     "swa_kv_scale"]
    assert aliased == 2
    bound = [("arg", "layer"), ("arg", "meta"), ("arg", "swa_pos_in"), ("arg", "errors_in"),
             ("args", "swa_kv_in"), ("ret", "swa_pos"), ("ret", "errors"), ("rets", "swa_kv")]
    assert _match("args", names, names[2:], bound, "arg", "args") == []
    assert _match("rets", names[2:], names[2:], bound, "ret", "rets") == []
    assert _match("args", names[:1] + names[2:], names[2:], bound, "arg", "args")
    assert _match("rets", names[2:] + ["scratch"], names[2:], bound, "ret", "rets")
    assert _match("args", names, names[2:], bound[:2] + [("args", "aliased_in")],
                  "arg", "args") == []
