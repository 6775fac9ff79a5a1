"""The root conftest.py's slow marks, run on a made-up suite in a fresh
pytest: a slow test marked with its reason is left out of the default run,
one marked without a reason stops the collection with its name, and the
reference twin of a CPU run is slow and left out of CI's selection."""
import pathlib
import shutil
import subprocess
import sys

from support.marks import requires_cpu_ffi

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pytest(tmp_path, body: str, *args):
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -m \"not slow\" --strict-markers -p no:cacheprovider\n"
        "markers =\n    slow: a long test\n    reference_twin: a twin\n")
    (tmp_path / "test_made_up.py").write_text("import pytest\n\n" + body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=tmp_path,
                          capture_output=True, text=True)


def test_a_slow_test_with_its_reason_leaves_the_default_run(tmp_path):
    body = ('@pytest.mark.slow(reason="long; test_quick stays")\ndef test_long():\n    pass\n\n'
            'def test_quick():\n    pass\n')
    out = _pytest(tmp_path, body)
    assert out.returncode == 0 and "1 passed, 1 deselected" in out.stdout, out.stdout
    out = _pytest(tmp_path, body, "-m", "slow or not slow")
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout


def test_a_slow_mark_without_a_reason_stops_the_collection(tmp_path):
    body = ('@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])\n'
            'def test_case(n):\n    pass\n')
    out = _pytest(tmp_path, body)
    assert out.returncode == 4, out.stdout + out.stderr
    assert "a slow mark needs reason=" in out.stderr and "test_case[2]" in out.stderr, out.stderr


@requires_cpu_ffi   # the rule's own condition (conftest._cpu_runs_here): else nothing is a twin
def test_a_reference_twin_of_a_cpu_run_is_slow_and_left_out_of_ci(tmp_path):
    """test_x[reference-a] beside test_x[cpu-a] is marked slow and
    reference_twin where the CPU handler runs (as on CI): the default run and
    CI's selection leave it out, "slow or not slow" runs it."""
    body = ('@pytest.mark.parametrize("impl", ["cpu", "reference"])\n'
            'def test_x(impl):\n    pass\n\n'
            '@pytest.mark.parametrize("impl", ["reference"])\n'
            'def test_alone(impl):\n    pass\n')
    for args, summary in (((), "2 passed, 1 deselected"),
                          (("-m", "not reference_twin"), "2 passed, 1 deselected"),
                          (("-m", "slow or not slow"), "3 passed")):
        out = _pytest(tmp_path, body, *args)
        assert out.returncode == 0 and summary in out.stdout, (args, out.stdout + out.stderr)
