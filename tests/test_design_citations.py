"""Citations of the design contract: every `docs/design/<file>.md` named in
the code, the tests and the documents exists, and so does every heading a
citation names in quotes after it (`docs/design/host.md, "Prefix sharing"`);
the design pages' links between themselves resolve; nothing (C++ sources
included) still cites the index by section number; and the "adding an op"
checklist names files that exist (for apply_step, an op in every tree)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ["dsv4_jax", "tests", "benchmarks", "tools", "examples", "docs", "ffi", "cuda", ".ci"]
TOP = ["README.md", "CMakeLists.txt", "pyproject.toml", "conftest.py"]
SUFFIXES = {".py", ".md", ".h", ".cc", ".cu", ".cuh", ".sh", ".txt", ".toml", ""}

CITATION = re.compile(r'docs/design/([\w-]+)\.md(?:`?\)?,\s*"([^"]{1,100})")?')
NUMBERED = re.compile(r"(?:docs/design\.md`? ?|design )§ ?\d")
LINK = re.compile(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)")


def _texts():
    files = [ROOT / f for f in TOP]
    for folder in FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file()
                  and p.suffix in SUFFIXES and "data" not in p.relative_to(ROOT).parts
                  and p != pathlib.Path(__file__).resolve()]   # this file's made-up cases
    for p in files:
        try:
            yield p.relative_to(ROOT).as_posix(), p.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue


def _squash(text: str) -> str:
    """A quoted heading that runs over lines of a comment, as one line."""
    return " ".join(re.sub(r"^\s*(#|//|\*)?\s*", "", line) for line in text.split("\n")).strip()


def _headings(page: pathlib.Path) -> list[str]:
    """Markdown headings and bold run-in headings (`**Prefix sharing.**`)."""
    out = []
    for line in page.read_text().split("\n"):
        if line.startswith("#"):
            out.append(line.lstrip("#").strip())
        elif line.startswith("**"):
            out.append(line[2:].split("**", 1)[0])
    return out


def broken_citations(texts) -> list[str]:
    """'where: what' for each cited design file or heading that does not exist."""
    bad = []
    for where, text in texts:
        for m in CITATION.finditer(text):
            page = ROOT / "docs" / "design" / f"{m.group(1)}.md"
            line = text.count("\n", 0, m.start()) + 1
            if not page.is_file():
                bad.append(f"{where}:{line}: no docs/design/{m.group(1)}.md")
            elif m.group(2) and not any(_squash(m.group(2)) in h for h in _headings(page)):
                bad.append(f"{where}:{line}: no heading {_squash(m.group(2))!r} in "
                           f"docs/design/{m.group(1)}.md")
    return bad


def test_every_cited_design_file_and_heading_exists():
    texts = list(_texts())
    assert len(texts) > 100
    assert sum(len(CITATION.findall(t)) for _, t in texts) > 100   # the scan finds citations
    bad = broken_citations(texts)
    assert not bad, "\n".join(bad)


def test_the_check_finds_a_missing_file_and_a_missing_heading():
    texts = [("a.py", 'x (docs/design/host.md, "Prefix\n# sharing") y'),
             ("b.py", "see docs/design/hosts.md"),
             ("c.md", 'docs/design/host.md, "Suffix sharing"')]
    assert broken_citations(texts) == ["b.py:1: no docs/design/hosts.md",
                                       "c.md:1: no heading 'Suffix sharing' in "
                                       "docs/design/host.md"]


def test_design_pages_link_to_pages_that_exist():
    pages = [ROOT / "docs" / "design.md", *sorted((ROOT / "docs" / "design").glob("*.md"))]
    bad = [f"{p.name}: {target}" for p in pages for target in LINK.findall(p.read_text())
           if not (p.parent / target).is_file()]
    assert not bad, bad


def test_citations_name_the_file_not_a_section_number():
    numbered = [f"{where}:{text.count(chr(10), 0, m.start()) + 1}"
                for where, text in _texts()
                for m in NUMBERED.finditer(text)]
    assert not numbered, numbered


def test_adding_an_op_names_files_that_exist():
    text = (ROOT / "docs" / "design" / "adding-an-op.md").read_text()
    paths = [p.replace("<op>", "apply_step") for p in re.findall(r"`([\w./<>-]+/[\w.<>-]+\.\w+)`", text)]
    assert len(paths) > 15, paths
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, missing
