"""The README's launch recipes: every dry-run command it shows compiles for its device count and fits its target,
and its table's state column is what the shardings give (exact: params, AdamW moments and the accumulator). The
SLURM script parses and runs the config its own dry-run line checks."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from test_dryrun import table_value


def recipes_section() -> str:
    with open("README.md") as f:
        text = f.read()
    return text.split("### Launch recipes", 1)[1].split("\n## ", 1)[0]


def dry_run_commands() -> list[list[str]]:
    lines = [line.strip() for line in recipes_section().splitlines()]
    return [shlex.split(line)[3:] for line in lines
            if line.startswith("python -m jaxtrain.run ") and "--run.dry_run=true" in line]


def recipe_key(args: list[str]) -> tuple:
    """(config file name, the overrides that change the run, device count) of a dry-run command's arguments."""
    config = args[args.index("--config") + 1].removeprefix("configs/")
    devices = next(int(a.split("=")[1]) for a in args if a.startswith("--run.dry_run_devices="))
    changes = tuple(sorted(a for a in args[2:] if not a.startswith(("--run.dry_run", "--run.target_device"))))
    return config, changes, devices


def table_state_gib() -> dict[tuple, float]:
    """recipe key -> the state column of the README's table."""
    rows = {}
    for line in recipes_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[1].startswith("`"):
            config, *changes = cells[1].split("`")[1].split()
            devices = int(cells[2].split()[0])
            rows[(config, tuple(sorted(changes)), devices)] = float(cells[4])
    return rows


def state_gib(stdout: str) -> float:
    rows = ("params (fp32)", "AdamW moments (fp32)", "gradient accumulator (fp32)", "other optimizer state")
    return sum(table_value(stdout, row) for row in rows)


def test_every_recipe_has_a_row_and_a_dry_run():
    assert set(map(recipe_key, dry_run_commands())) == set(table_state_gib()) and len(table_state_gib()) == 5


@pytest.mark.slow
def test_every_recipe_dry_run_fits_its_target():
    """All five at once (each compiles mostly on one thread; this machine has two cores)."""
    commands = dry_run_commands()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxtrain.run", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    for args, proc in zip(commands, procs):
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, (args, stderr[-2000:])
        assert "fits:" in stderr, args
        # the table's figure has 3 decimals; the state is exact, whatever XLA version compiles the step
        assert state_gib(stdout) == pytest.approx(table_state_gib()[recipe_key(args)], abs=2e-3), args


def test_slurm_script_runs_the_config_its_dry_run_checks():
    script = "launch/gpt-1b.sbatch"
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    with open(script) as f:
        text = f.read()
    srun = shlex.split(re.search(r"^srun (.*)$", text, re.M).group(1))
    dry_run = shlex.split(re.search(r"^#\s+(python -m jaxtrain.run .*--run.dry_run=true.*)$", text, re.M).group(1))
    assert srun[srun.index("--config") + 1] == dry_run[dry_run.index("--config") + 1] == "configs/gpt-1b.yaml"
    assert dry_run[3:] in dry_run_commands()  # the README shows, and the slow test runs, the same check
    nodes = int(re.search(r"--nodes=(\d+)", text).group(1))
    tasks = int(re.search(r"--ntasks-per-node=(\d+)", text).group(1))
    assert recipe_key(dry_run[3:])[2] == nodes * tasks  # the dry run compiled for the devices the job gets


# A stand-in for srun on PATH: records the SRUN_CPUS_PER_TASK it was given, says it started, and waits (at most 10 s)
# for the test's go; SIGTERM ends it as srun's SIGTERM ends a step (srun SIGKILLs every task), whatever this shell
# inherited (a bash stand-in could not trap a SIGTERM it was started ignoring).
FAKE_SRUN = """#!{python}
import os, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
folder = pathlib.Path(os.environ["FAKE_SRUN_DIR"])
(folder / "cpus").write_text(os.environ.get("SRUN_CPUS_PER_TASK", ""))
(folder / "started").touch()
deadline = time.monotonic() + 10
while not (folder / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0 if (folder / "go").exists() else 3)
"""


def test_slurm_script_gives_srun_its_cpus_and_outlives_a_sigterm(tmp_path):
    """The batch script as sbatch runs it, with a stand-in srun: srun gets the script's --cpus-per-task through
    SRUN_CPUS_PER_TASK (Slurm >= 22.05 passes sbatch's own no further), and a SIGTERM to the batch shell (preemption,
    scancel) leaves it waiting for srun, whose exit status it returns: a shell killed at once would end the job
    while the tasks save. Under `exec srun` the SIGTERM would reach srun itself, which ends the step."""
    script = "launch/gpt-1b.sbatch"
    with open(script) as f:
        cpus = re.search(r"^#SBATCH --cpus-per-task=(\d+)", f.read(), re.M).group(1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    env = {name: value for name, value in os.environ.items() if name != "SRUN_CPUS_PER_TASK"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_SRUN_DIR=str(tmp_path), SLURM_CPUS_PER_TASK=cpus)  # as sbatch
    shell = subprocess.Popen(["bash", script], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "started").exists()
        shell.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # a shell that dies of it has died by now
        (tmp_path / "go").touch()
        assert shell.wait(timeout=30) == 0
    finally:
        shell.kill()
    assert (tmp_path / "cpus").read_text() == cpus
