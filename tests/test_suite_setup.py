"""The suite's own plumbing: how many xdist workers `-n auto` starts (conftest.py), test_fuzz's closing count,
which reaches the terminal from xdist's workers (tests/conftest.py), the dependency floors CI tests
(.ci/floors.txt), CI's exit (.ci/run's trap) and the slow tests it runs when short of time (its fault tests, a
turn of the rest)."""

import os
import re
import shlex
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _auto_workers(cpus: set[int], markexpr: str = "not slow", **env) -> str:
    """What conftest's hook answers with `cpus` usable, for the suite `-m markexpr` selects."""
    script = (f"import os, types; os.sched_setaffinity(0, {cpus!r}); import conftest; "
              f"config = types.SimpleNamespace(getoption=lambda name: {markexpr!r} if name == 'markexpr' else None); "
              "print(conftest.pytest_xdist_auto_num_workers(config))")
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_AUTO_NUM_WORKERS"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**environ, **env}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_auto_starts_one_worker_a_usable_core_and_one_more_for_the_default_suite():
    """One core usable (its affinity, as a CPU-limited container or `taskset` gives): two workers for the default
    suite (-m 'not slow'), one for the slow suite or every test, whatever os.cpu_count() says (xdist's own hook,
    psutil or os.cpu_count, would count the machine's cores); at most one per 4 GiB of this machine's memory."""
    by_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**32
    assert _auto_workers({0}) == str(max(1, min(2, by_memory)))
    assert _auto_workers({0}, "slow") == "1" and _auto_workers({0}, "") == "1"
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


def _floors_file() -> dict[str, Version]:
    """.ci/floors.txt: {normalized name: version} of its `name==version` lines."""
    with open(os.path.join(REPO, ".ci", "floors.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f]
    return {canonicalize_name(name): Version(version) for name, version in (pin.split("==") for pin in pins if pin)}


def test_each_dependency_floor_is_the_version_ci_tests():
    """pyproject's runtime dependencies: each one floor (`>=`), and .ci/floors.txt, which .ci/run installs and tests,
    pins that same version (jaxlib: jax's), so a floor cannot move without the tested version moving with it."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        requirements = [Requirement(text) for text in tomllib.load(f)["project"]["dependencies"]]
    floors = {}
    for requirement in requirements:
        (spec,) = requirement.specifier  # one clause each
        assert spec.operator == ">=", requirement
        floors[canonicalize_name(requirement.name)] = Version(spec.version)
    pinned = _floors_file()
    assert pinned.pop("jaxlib") == floors["jax"]
    assert pinned == floors


def _ci_exit_trap() -> str:
    """.ci/run's `trap '...' EXIT` line, verbatim."""
    with open(os.path.join(REPO, ".ci", "run")) as f:
        (line,) = [line for line in f if line.startswith("trap ") and line.rstrip().endswith(" EXIT")]
    return line


def test_ci_exits_zero_with_its_venvs_removed_whatever_the_floors_install_did(tmp_path):
    """.ci/run's exit trap, under its own `set -euo pipefail`: a run that passed exits 0 and removes its scratch
    folder whether the floors' background install finished long ago, is still running (it is stopped) or never
    started; a failed run keeps its exit code."""
    pid_file = tmp_path / "install.pid"
    cases = {"finished": "(true) & floors_install=$!; wait $floors_install",
             "running": f"(sleep 60 >/dev/null 2>&1) & floors_install=$!; echo $floors_install > {pid_file}",
             "never started": ""}
    for name, setup in cases.items():
        for code in (0, 3):
            scratch = tmp_path / f"{name}-{code}".replace(" ", "-")
            scratch.mkdir()
            script = f'set -euo pipefail\nscratch={scratch}\n{_ci_exit_trap()}{setup}\nexit {code}\n'
            proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
            assert proc.returncode == code, (name, proc.returncode, proc.stderr)
            assert not scratch.exists(), name
            if name == "running":
                assert processes.ended_within(int(pid_file.read_text())), "the install CI left running"


def _ci_array(name: str) -> list[str]:
    """A bash array of .ci/run's, split as bash splits it (quotes; a backslash-newline inside quotes joins lines)."""
    with open(os.path.join(REPO, ".ci", "run")) as f:
        body = f.read().split(f"\n{name}=(", 1)[1].split(")\n", 1)[0]
    return shlex.split(body.replace("\\\n", ""))


def test_the_fault_tests_ci_runs_short_of_time_are_slow_tests_that_exist():
    """.ci/run's FAULT_TESTS, run alone where the whole slow suite does not fit: a test renamed or no longer slow
    would leave CI to run nothing (pytest's "not found") or a default test twice."""
    listed = _ci_array("FAULT_TESTS")
    assert len(listed) == 3, listed
    for node in listed:
        path, name = node.split("::")
        with open(os.path.join(REPO, path)) as f:
            assert f"@pytest.mark.slow\ndef {name}(" in f.read(), node


def test_every_slow_test_is_a_fault_test_or_in_one_turn_of_ci():
    """.ci/run, short of time for the whole slow suite, runs FAULT_TESTS with one of SLOW_TURNS (files): a slow test
    in a file no turn names would never run there, one in two turns twice as often as the others, and a turn with
    no slow test of its own would run the fault tests alone. Read from the files (the floors' venv, which runs this,
    cannot import the whole suite): a test is slow by a `@pytest.mark.slow` line, the only way the suite marks one."""
    faults, turns = _ci_array("FAULT_TESTS"), [turn.split() for turn in _ci_array("SLOW_TURNS")]
    assert len(turns) == 3 and all(turns), turns
    others = {}  # file -> its slow tests that are not fault tests
    for folder in ("tests", "parity_tests"):
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            path = f"{folder}/{name}"
            if not name.endswith(".py") or path == "tests/test_suite_setup.py":  # this file names the marker
                continue
            with open(os.path.join(REPO, path)) as f:
                text = f.read()
            marked = len(re.findall(r"^@pytest\.mark\.slow$", text, re.M))
            assert text.count("pytest.mark.slow") == marked, f"{path} marks slow tests in another way"
            if marked > sum(node.startswith(f"{path}::") for node in faults):
                others[path] = marked
    assert len(others) >= 6, others
    for path in others:
        assert sum(path in files for files in turns) == 1, (path, turns)
    assert all(path in others for files in turns for path in files), turns
