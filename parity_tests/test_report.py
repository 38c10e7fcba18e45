"""`python -m parity_tests.report` refuses a config the trainers refuse as they do: their one line, exit code 2, no
traceback (its runs are subprocesses; the report passes on what the first of them said)."""

import subprocess
import sys

import pytest

from parity_tests import runs


@pytest.mark.parametrize("flags,message", [
    (["--steps", "20"], "error: optim.warmup_steps=50 must be smaller than the decay length 20"),  # tiny.yaml: 50
    (["--model.n_layerz=3"], "error: unknown config key 'model.n_layerz'; did you mean model.n_layer?")])
def test_report_refuses_a_bad_config_in_one_line(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, "-m", "parity_tests.report", "--config", runs.TINY, "--out",
                           str(tmp_path / "report"), *flags], cwd=runs.REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line != "export init ..."]  # its progress line
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert not (tmp_path / "report" / "report.md").exists()
