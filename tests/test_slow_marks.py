"""The root conftest.py's slow marks, run on a made-up suite in a fresh
pytest: a slow test marked with its reason is left out of the default run,
one marked without a reason stops the collection with its name."""
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pytest(tmp_path, body: str, *args):
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -m \"not slow\" --strict-markers -p no:cacheprovider\n"
        "markers =\n    slow: a long test\n")
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
