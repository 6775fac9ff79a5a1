"""The package's floors: each module imports only from its own floor or the
floors below it, no two modules import each other in a loop, and the
library never imports the application (dsv4_jax/app/). And the public
surface the layout must keep: `dj.<name>`, `dsv4_jax.sharding`,
`dsv4_jax.multiprocess` and `python -m dsv4_jax`."""
import ast
import functools
import pathlib
import subprocess
import sys

import dsv4_jax as dj

PACKAGE = pathlib.Path(dj.__file__).parent

# Lowest first. A module's part is its first name under dsv4_jax (a file or a
# subpackage); "__init__" is the package itself.
FLOORS = [
    {"config", "errors", "error_ops", "error_detail", "meta", "_ffi"},
    {"params", "state"},
    {"reference", "memory", "donation", "sharded_state"},
    {"ops"},
    {"requests", "speculative"},
    {"host"},
    {"sharding", "multiprocess", "__init__"},
    {"app", "__main__", "block"},
]
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The dsv4_jax modules `path` imports (anywhere in it, a function's
    imports too), as absolute dotted names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "dsv4_jax"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "dsv4_jax":
                continue
            # `from . import config`: names that are modules are imported, not their package
            subs = {f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")}
            out |= subs if len(subs) == len(node.names) else {target}
    return out


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.lru_cache(maxsize=None)
def _graph():
    files = sorted(p for p in PACKAGE.rglob("*.py"))
    return {_module_name(p): _imports(p) for p in files}


def test_every_part_has_a_floor():
    parts = {_part(m) for m in _graph()}
    assert parts == set(FLOOR), (parts - set(FLOOR), set(FLOOR) - parts)


def _above(graph) -> list:
    """(module, import) pairs whose import stands on a floor above the module."""
    return [(m, t) for m, targets in graph.items() for t in targets
            if FLOOR[_part(t)] > FLOOR[_part(m)]]


def _circle(graph):
    """One import circle of `graph` as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                return stack[stack.index(t):] + [t]
            if t in graph and t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None
    for m in graph:
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_module_imports_from_a_floor_above_it():
    assert not _above(_graph()), _above(_graph())


def test_the_library_never_imports_the_application():
    wrong = [(m, t) for m, targets in _graph().items() for t in targets
             if _part(m) not in ("app", "__main__") and _part(t) == "app"]
    assert not wrong, wrong


def test_no_import_circle():
    assert _circle(_graph()) is None, " -> ".join(_circle(_graph()))


def test_the_checks_find_a_floor_broken_and_a_circle():
    """The checks above can fail: on a made-up graph they find what it breaks."""
    graph = {"dsv4_jax.config": {"dsv4_jax.app.demo"}, "dsv4_jax.app.demo": {"dsv4_jax.state"},
             "dsv4_jax.state": {"dsv4_jax.config"}}
    assert _above(graph) == [("dsv4_jax.config", "dsv4_jax.app.demo")]
    assert _circle(graph) == ["dsv4_jax.config", "dsv4_jax.app.demo", "dsv4_jax.state",
                              "dsv4_jax.config"]
    assert _circle({"dsv4_jax.state": {"dsv4_jax.config"}, "dsv4_jax.config": set()}) is None


def test_public_names_stay_where_users_import_them():
    import dsv4_jax.multiprocess as mp
    import dsv4_jax.sharding as sh
    names = {
        dj: ["CacheConfig", "CacheState", "KVEntries", "IndexerKeys", "WindowState", "CSAState",
             "HCAState", "init_state", "StepMeta", "CacheManager", "CacheFullError",
             "CacheInputError", "ErrorKind", "check_errors", "reset_errors", "check_donated",
             "NotDonatedWarning", "memory_report", "CompressorParams", "yarn_inv_freq",
             "default_impl", "apply_step", "append", "flush", "gather_window", "gather_topk",
             "gather_all", "indexer_topk", "write_layer", "attention", "RequestSnapshot",
             "RequestBlocks", "RequestIds", "request_ids", "snapshot", "restore", "read_blocks",
             "write_blocks", "read_request", "write_request", "OffloadedRequest", "share_prefix",
             "admit_on_prefix", "offload", "preempt", "resume", "export_request",
             "import_request", "VerifyStep", "verify_begin", "verify_layer", "verify_commit",
             "sharding", "multiprocess"],
        sh: ["shard_config", "state_specs", "state_sharding", "init_sharded_state", "run_sharded",
             "ShardedCacheManager"],
        mp: ["ProcessCacheManager", "StepAbandoned", "shard_processes", "run_processes",
             "free_port"],
    }
    missing = [f"{m.__name__}.{n}" for m, ns in names.items() for n in ns if not hasattr(m, n)]
    assert not missing, missing
    assert dj.multiprocess is mp and dj.sharding is sh


def test_python_m_dsv4_jax_runs_the_command_line():
    out = subprocess.run([sys.executable, "-m", "dsv4_jax", "-h"], capture_output=True,
                         text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert all(c in out.stdout for c in ("demo", "plan", "bench", "info")), out.stdout
