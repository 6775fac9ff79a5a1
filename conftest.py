"""Which tests are `slow`: the default `pytest` leaves them out (pyproject's
addopts `-m "not slow"`), `pytest -m "slow or not slow"` runs them too.

Two kinds. A test marked at its definition, `@pytest.mark.slow(reason=...)`
(or a case of it, `pytest.param(..., marks=pytest.mark.slow(reason=...))`):
slow on 2 cores (tens of seconds) or needing gigabytes, with a quicker test
of the same property left in the default run, which the reason names. A
mark without a reason stops the collection, and pyproject's
`--strict-markers` stops a misspelt mark. And, by rule, the reference run of
a test that also runs the CPU handler on the same parameters
(`[reference-...]` beside `[cpu-...]`), where the CPU module is built and the
CPU runs the tests: the jnp reference compiles for seconds where the handler
compiles in a blink, and the default run still holds the reference to the
handler byte for byte (the demo's replay, test_ffi_vs_reference's quick
cases, the agreement tests of each op). These also carry the mark
`reference_twin`: CI (`.ci/run`) runs every test but them (`-m "not
reference_twin"`), as they are half its test time.
"""
import pytest


@pytest.hookimpl(tryfirst=True)      # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    unexplained = [item.nodeid for item in items for mark in item.iter_markers("slow")
                   if not mark.kwargs.get("reason")]
    if unexplained:
        raise pytest.UsageError("a slow mark needs reason=\"...\" (why it is slow and which "
                                "quicker test stays in the default run): "
                                + ", ".join(unexplained))
    names = {item.name for item in items}
    twins = [item for item in items if _cpu_twin(item.name) in names]
    if twins and not _cpu_runs_here():      # asked only where there are twins: it imports jax
        return
    for item in twins:
        item.add_marker(pytest.mark.slow(reason="the reference twin of a CPU handler's run"))
        item.add_marker(pytest.mark.reference_twin)


def _cpu_twin(name: str):
    """test_x[cpu-a] for test_x[reference-a] (the impl among the parameters),
    else None."""
    function, _, params = name.partition("[")
    tokens = params.rstrip("]").split("-")
    if "reference" not in tokens:
        return None
    return f"{function}[{'-'.join('cpu' if t == 'reference' else t for t in tokens)}]"


def _cpu_runs_here() -> bool:
    """Whether the CPU handler's runs are not skipped: the CPU module built
    and the CPU the default backend (support.marks.requires_cpu_ffi)."""
    import jax
    from dsv4_jax import _ffi
    return _ffi.has_target("cpu", "dsv4_apply_step") and jax.default_backend() == "cpu"
