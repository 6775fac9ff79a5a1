"""Writes the API reference from the package's docstrings: docs/api.md (the
conventions and the contents) and a page a section under docs/api/.

    python tools/gen_api.py           # rewrite docs/api.md and docs/api/*.md
    python tools/gen_api.py --check   # exit 1 if any page is stale

Only the standard library's `inspect` and the package itself: the reference
is whatever the docstrings and signatures say, so a docstring is where a
correction goes. tests/test_api_docs.py fails when a page differs from what
this script writes now.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # the checkout's package, when run as a script
    sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs"
INDEX = "api.md"          # pages, relative to docs/
PAGES = "api"
PACKAGE = "dsv4_jax"

# (section title, names relative to the package; "mod.name" reaches into a
# submodule). Names of dsv4_jax.__all__ left out here land in "Other names",
# so a new export shows up (and makes the reference stale) instead of vanishing.
SECTIONS = [
    ("Ops", ["apply_step", "append", "flush", "write_layer", "indexer_topk", "attention",
             "gather_window", "gather_topk", "gather_all"]),
    ("Configuration", ["CacheConfig"]),
    ("State", ["init_state", "CacheState", "WindowState", "CSAState", "HCAState", "KVEntries",
               "IndexerKeys"]),
    ("Step bookkeeping", ["CacheManager", "StepMeta"]),
    ("Moving requests", ["snapshot", "restore", "read_blocks", "write_blocks", "request_ids",
                         "read_request", "write_request", "RequestSnapshot", "RequestBlocks",
                         "RequestIds", "share_prefix", "admit_on_prefix", "offload", "preempt",
                         "resume", "OffloadedRequest", "export_request", "import_request"]),
    ("Speculative steps", ["verify_begin", "verify_layer", "verify_commit", "accepted_counts",
                           "VerifyStep"]),
    ("Compressor parameters", ["CompressorParams", "yarn_inv_freq"]),
    ("Errors", ["check_errors", "reset_errors", "ErrorKind", "ErrorOp", "CacheInputError",
                "CacheFullError"]),
    ("Donation", ["check_donated", "NotDonatedWarning"]),
    ("Memory", ["memory_report", "memory.MemoryReport"]),
    ("Implementation choice", ["default_impl"]),
    ("Sharding", ["sharding.shard_config", "sharding.init_sharded_state",
                  "sharding.ShardedCacheManager", "sharding.state_specs",
                  "sharding.state_sharding", "sharding.run_sharded"]),
    ("Attention block", ["block.BlockConfig", "block.attention_layer", "block.stack_step",
                         "block.jitted_step", "block.load_safetensors", "block.from_tensors",
                         "block.layer_shapes", "block.query", "block.window_kv",
                         "block.compressor_inputs", "block.compressor_params",
                         "block.indexer_query", "block.output_projection", "block.rope",
                         "block.hadamard", "block.inv_freq_of"]),
    ("Across processes", ["multiprocess.ProcessCacheManager", "multiprocess.StepAbandoned",
                          "multiprocess.shard_processes", "errors.shard_error_counts",
                          "multiprocess.run_processes", "multiprocess.free_port"]),
]
WIDTH = 96   # signatures longer than this go one parameter per line

# The constants a caller sizes its operands with: (expression over the
# package's modules, what it sizes). The values are evaluated, never typed.
CONSTANTS_TITLE = "Constants"
CONSTANTS = [
    ("config.HEAD_DIM", "width of a KV entry: the last axis of `q`, `kv` (append, write_layer, "
                        "verify rows), `chunk_kv` and attention's `out`"),
    ("config.ROPE_DIM", "trailing channels of an entry that carry RoPE (`rope_inv_freq` has "
                        "half as many frequencies)"),
    ("config.NOPE_DIM", "leading channels of an entry without RoPE (stored as fp8 in ds_fp8 "
                        "and fp8_token)"),
    ("2 * config.HEAD_DIM", "CSA layers: width of `comp_kv`, `comp_score` (flush's `kv`, "
                            "`score`): two overlapping halves"),
    ("config.HEAD_DIM", "HCA layers: width of `comp_kv`, `comp_score`"),
    ("2 * config.INDEX_DIM", "CSA layers: width of `index_kv`, `index_score`"),
    ("config.INDEX_HEADS", "indexer heads: `q` of indexer_topk is `bf16[T, INDEX_HEADS, "
                           "INDEX_DIM]`, its `weights` `f32[T, INDEX_HEADS]`"),
    ("config.INDEX_DIM", "indexer key and query width"),
    ("config.WINDOW", "sliding-window positions of every layer (a query at t sees "
                      "t - WINDOW < p <= t)"),
    ("config.CSA_RATIO", "tokens a CSA entry pools: a query at t sees (t + 1) // CSA_RATIO "
                         "entries"),
    ("config.HCA_RATIO", "tokens an HCA entry pools"),
    ("config.BLOCK_TOKENS", "tokens of a paged block (the manager allocates a block per "
                            "BLOCK_TOKENS a request holds; a prefix is a multiple of it)"),
    ("config.CacheConfig.flash().index_topk", "V4-Flash's top-k (`config.index_topk`; "
                                              "V4-Pro 1024): attention's `topk` columns"),
    ("speculative.MAX_DRAFTS", "most drafts a request verifies in one speculative step "
                               "(`verify_begin(drafts=...)`)"),
    ("config.MAX_CONTEXT", "most tokens of one request (positions are int32)"),
]


# ---- signatures ------------------------------------------------------------------------------
def _annotation(a) -> str:
    if isinstance(a, str):      # `from __future__ import annotations` keeps them as written
        return a.replace("'", "").replace('"', "")
    return inspect.formatannotation(a)


def _default(v) -> str:
    if isinstance(v, str):
        return '"' + v + '"'
    return repr(v)


def _params(sig: inspect.Signature, drop_first: bool) -> list[str]:
    out, star_done = [], False
    params = list(sig.parameters.values())[1 if drop_first else 0:]
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            out.append("*")
            star_done = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        star_done = star_done or p.kind is p.VAR_POSITIONAL
        if p.annotation is not p.empty:
            text += ": " + _annotation(p.annotation)
        if p.default is not p.empty:
            text += (" = " if p.annotation is not p.empty else "=") + _default(p.default)
        out.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params)
                                            or params[i + 1].kind is not p.POSITIONAL_ONLY):
            out.append("/")
    return out


def signature(name: str, obj, drop_first: bool = False) -> str:
    """`name(params) -> ret`, wrapped one parameter per line when long."""
    sig = inspect.signature(obj)
    params = _params(sig, drop_first)
    ret = "" if sig.return_annotation is sig.empty or inspect.isclass(obj) else \
        " -> " + _annotation(sig.return_annotation)
    one = f"{name}({', '.join(params)}){ret}"
    if len(one) <= WIDTH or not params:
        return one
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){ret}"


# ---- docstrings as Markdown ------------------------------------------------------------------
_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _escape(text: str) -> str:
    """Prose outside code spans: characters Markdown would read as markup."""
    parts = _CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"[\\*<]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", lambda m: "\\" + m[0],
                          parts[i])
    return "".join(parts)


def _preformatted(lines: list[str]) -> bool:
    """A paragraph laid out by hand: indented lines, or columns aligned with
    runs of spaces (field tables, formulas, examples)."""
    return any(l[:1] == " " or re.search(r"\S {2,}\S", l) for l in lines)


def _list_items(lines: list[str]) -> list[str] | None:
    """The items of a "- item" list whose items continue on indented lines."""
    if not lines[0].startswith("- "):
        return None
    items = []
    for l in lines:
        if l.startswith("- "):
            items.append(l[2:].strip())
        elif l.startswith("  ") and items:
            items[-1] += " " + l.strip()
        else:
            return None
    return items


def _heading(lines: list[str]) -> bool:
    """A paragraph that is one short line like "Token rows:"."""
    return len(lines) == 1 and re.fullmatch(r"[A-Z][^.:`]{0,60}:", lines[0]) is not None


def markdown(doc: str | None, level: int = 4, skip_summary: bool = False) -> str:
    """A docstring as Markdown: prose paragraphs reflowed and escaped, "- "
    lists as lists, "Title:" lines as headings of `level`, and laid-out
    paragraphs kept as they are in a text block."""
    if not doc:
        return ""
    out = []
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(doc))
    for para in paragraphs[1 if skip_summary else 0:]:
        lines = para.rstrip().split("\n")
        items = _list_items(lines)
        if items is not None:
            out.append("\n".join("- " + _escape(i) for i in items))
        elif _heading(lines):
            out.append("#" * level + " " + lines[0][:-1])
        elif _preformatted(lines):
            out.append("```text\n" + "\n".join(lines) + "\n```")
        else:
            text = " ".join(l.strip() for l in lines)
            out.append(_escape(text.replace("::", ":")))
    return "\n\n".join(out)


# ---- objects ---------------------------------------------------------------------------------
def resolve(name: str):
    """(public dotted name, object) of a name relative to the package."""
    module_name, _, attr = name.rpartition(".")
    module = importlib.import_module(f"{PACKAGE}.{module_name}" if module_name else PACKAGE)
    return f"{PACKAGE}.{name}", getattr(module, attr)


def _members(cls) -> list[tuple[str, object]]:
    """Public members a class defines itself, in source order (dataclass
    fields are in the constructor's signature instead)."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in fields:
            continue
        if isinstance(value, (staticmethod, classmethod, property)) or inspect.isfunction(value):
            out.append((name, value))
    return out


def _member_entry(public: str, cls, name: str, value, missing: list) -> str:
    qual = f"{cls.__name__}.{name}"
    if isinstance(value, property):
        fget = value.fget
        ret = inspect.signature(fget).return_annotation
        ret = "" if ret is inspect.Signature.empty else " -> " + _annotation(ret)
        head, doc, kind = f"{qual}{ret}", fget.__doc__, "property"
    else:
        func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        bound = not isinstance(value, staticmethod)   # self / cls is not shown
        head = signature(qual, func, drop_first=bound)
        doc = func.__doc__
        kind = {staticmethod: "staticmethod", classmethod: "classmethod"}.get(type(value), "")
    if not doc:
        missing.append(f"{public}.{name}")
    decorator = f"@{kind}\n" if kind else ""
    return f"```python\n{decorator}{head}\n```\n\n{markdown(doc)}"


def _enum_table(cls) -> str:
    # an enum's module may describe its members in `_DESCRIPTIONS` (errors.py
    # does, for CacheInputError's message): one text for both places
    descriptions = getattr(importlib.import_module(cls.__module__), "_DESCRIPTIONS", {})
    rows = ["| name | value | meaning |", "|---|---|---|"]
    rows += [f"| `{m.name}` | {int(m.value)} | {_escape(descriptions.get(m, ''))} |" for m in cls]
    return "\n".join(rows)


def entry(name: str, missing: list) -> str:
    """The Markdown of one public object."""
    public, obj = resolve(name)
    short = public.rpartition(".")[2]
    doc = obj.__doc__
    if doc and dataclasses.is_dataclass(obj) and doc.startswith(f"{short}("):
        doc = None        # the signature dataclasses writes when a class has no docstring
    if not doc:
        missing.append(public)
    if inspect.isclass(obj):
        if issubclass(obj, enum.Enum):
            head, body = f"class {short}({obj.__bases__[0].__name__})", _enum_table(obj)
        elif issubclass(obj, BaseException):
            head, body = f"class {short}({obj.__bases__[0].__name__})", ""
        else:
            head, body = signature(f"class {short}", obj), ""
        parts = [f"### `{public}`", f"```python\n{head}\n```", markdown(doc), body]
        parts += [_member_entry(public, obj, n, v, missing) for n, v in _members(obj)]
    else:
        parts = [f"### `{public}`", f"```python\n{signature(short, obj)}\n```", markdown(doc)]
    return "\n\n".join(p.strip() for p in parts if p.strip())


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


_GENERATED = ("<!-- Generated by tools/gen_api.py from the docstrings; edit those, then run"
              " `python tools/gen_api.py`. -->")
_TITLE = f"# `{PACKAGE}` API reference"


def render() -> tuple[dict[str, str], list[str]]:
    """The reference as Markdown pages {path relative to docs/: text}: the
    index (conventions and contents) and a page a section; and the public
    objects without a docstring."""
    package = importlib.import_module(PACKAGE)
    placed = {n for _, names in SECTIONS for n in names}
    sections = list(SECTIONS)
    others = [n for n in package.__all__ if n not in placed]
    if others:
        sections.append(("Other names", others))
    missing: list[str] = []
    pages = {}
    for title, names in sections:
        out = [_GENERATED, _TITLE,
               f"Part of the reference: [conventions and contents](../{INDEX}).",
               f"## {title}"]
        out += [entry(n, missing) for n in names]
        pages[f"{PAGES}/{_slug(title)}.md"] = "\n\n".join(out).rstrip() + "\n"
    pages[f"{PAGES}/{_slug(CONSTANTS_TITLE)}.md"] = constants_page()
    index = [
        _GENERATED, _TITLE,
        "Every public function and class of the package, with shapes and dtypes."
        " Shapes are written `dtype[dims]`: `T` token rows of a step, `R` request slots,"
        " `N` physical blocks, `MB` blocks per request, `L` layers (`Lc` CSA, `Lh` HCA),"
        " `B` rows of a per-request read, `k` top-k. The design contract behind it is"
        " [`docs/design.md`](design.md).",
        "## Contents",
        "\n".join([f"- [{t}]({PAGES}/{_slug(t)}.md): "
                   + ", ".join(f"`{n.rpartition('.')[2]}`" for n in names)
                   for t, names in sections]
                  + [f"- [{CONSTANTS_TITLE}]({PAGES}/{_slug(CONSTANTS_TITLE)}.md): the "
                     f"operand widths and sizes of `dsv4_jax.config` and "
                     f"`dsv4_jax.speculative`"]),
        "## Conventions",
        markdown(package.__doc__, level=3, skip_summary=True),
    ]
    return {INDEX: "\n\n".join(index).rstrip() + "\n", **pages}, missing


def constants_page() -> str:
    """The Constants page: each expression of CONSTANTS with its value."""
    env = {name: importlib.import_module(f"{PACKAGE}.{name}") for name in ("config", "speculative")}
    rows = ["| constant | value | sizes |", "|---|---|---|"]
    for expr, meaning in CONSTANTS:
        value = eval(expr, {"__builtins__": {}}, env)   # noqa: S307 (our own expressions)
        rows.append(f"| `{expr}` | {value:,} | {_escape(meaning)} |")
    out = [_GENERATED, _TITLE, f"Part of the reference: [conventions and contents](../{INDEX}).",
           f"## {CONSTANTS_TITLE}",
           "The sizes a caller shapes its operands with, as `dsv4_jax.config` and "
           "`dsv4_jax.speculative` define them (`from dsv4_jax import config as C`).",
           "\n".join(rows)]
    return "\n\n".join(out) + "\n"


def stale_pages(pages: dict[str, str]) -> list[str]:
    """Pages on disk that differ from `pages`, and section pages on disk
    that `pages` no longer has."""
    out = [p for p, text in pages.items()
           if not (DOCS / p).exists() or (DOCS / p).read_text() != text]
    on_disk = {f"{PAGES}/{f.name}" for f in (DOCS / PAGES).glob("*.md")}
    return out + sorted(on_disk - set(pages))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if any page is stale")
    args = ap.parse_args(argv)
    pages, missing = render()
    for name in missing:
        print(f"gen_api: {name} has no docstring", file=sys.stderr)
    stale = stale_pages(pages)
    if args.check:
        for p in stale:
            print(f"docs/{p}: stale, run python tools/gen_api.py")
        if not stale:
            print(f"docs/{INDEX} and docs/{PAGES}/: up to date")
        return 1 if stale or missing else 0
    (DOCS / PAGES).mkdir(exist_ok=True)
    for p in stale:
        if p in pages:
            (DOCS / p).write_text(pages[p])
            print(f"wrote docs/{p} ({len(pages[p].splitlines())} lines)")
        else:
            (DOCS / p).unlink()
            print(f"removed docs/{p}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
