"""The suite's own plumbing: how many xdist workers `-n auto` starts (conftest.py), and test_fuzz's closing count,
which reaches the terminal from xdist's workers (tests/conftest.py)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _auto_workers(cpus: set[int], **env) -> str:
    script = (f"import os; os.sched_setaffinity(0, {cpus!r}); import conftest; "
              "print(conftest.pytest_xdist_auto_num_workers(None))")
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_AUTO_NUM_WORKERS"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**environ, **env}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_auto_starts_one_worker_a_usable_core():
    """One core usable (its affinity, as a CPU-limited container or `taskset` gives): one worker, whatever
    os.cpu_count() says; xdist's own hook (psutil or os.cpu_count) would count the machine's cores."""
    assert _auto_workers({0}) == "1"
    assert _auto_workers({0}, PYTEST_XDIST_AUTO_NUM_WORKERS="3") == "None"  # xdist's hook reads it


def test_fuzz_counts_from_the_workers_reports_are_summed_once(tmp_path):
    """Two modules on two workers each record counts, as test_fuzz's tests do: the closing line holds their sum."""
    (tmp_path / "test_a.py").write_text(
        'def test_a(record_property):\n    record_property("fuzz_invalid_inputs", {"yaml": 2, "data": 1})\n')
    (tmp_path / "test_b.py").write_text(
        'def test_b(record_property):\n    record_property("fuzz_invalid_inputs", {"yaml": 3})\n')
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "conftest", "-n", "2",
                           "--dist", "loadfile", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "test_fuzz: 6 generated invalid inputs refused (data 1, yaml 5)" in proc.stdout, proc.stdout[-2000:]
    assert "2 workers" in proc.stdout or "created: 2/2 workers" in proc.stdout, proc.stdout[-2000:]
