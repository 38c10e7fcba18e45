"""`python -m parity_tests.report` refuses a config the trainers refuse as they do: their one line, exit code 2, no
traceback (its runs are subprocesses; the report passes on what the first of them said), and the previous report
in --out untouched."""

import subprocess
import sys

import pytest

from parity_tests import runs


def _contents(folder) -> dict:
    """Every path under `folder`: a folder's is True, a file's its text."""
    return {str(p.relative_to(folder)): p.is_dir() or p.read_text() for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("flags,message", [
    (["--steps", "20"], "error: optim.warmup_steps=50 must be smaller than the decay length 20"),  # tiny.yaml: 50
    (["--model.n_layerz=3"], "error: unknown config key 'model.n_layerz'; did you mean model.n_layer?")])
def test_report_refuses_a_bad_config_in_one_line_and_keeps_the_previous_report(tmp_path, flags, message):
    """A previous report's runs (hours of CPU) stay as they were: runs/ is replaced only once the config, the
    overrides and the data have loaded (before, a typo deleted them and then exited 2)."""
    out = tmp_path / "report"
    (out / "runs" / "jaxtrain" / "checkpoints" / "500").mkdir(parents=True)
    (out / "runs" / "jaxtrain" / "metrics.jsonl").write_text('{"step": 500, "loss": 1.5}\n')
    (out / "report.md").write_text("# the previous report\n")
    before = _contents(out)
    proc = subprocess.run([sys.executable, "-m", "parity_tests.report", "--config", runs.TINY, "--out",
                           str(out), *flags], cwd=runs.REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line != "export init ..."]  # its progress line
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert _contents(out) == before  # and nothing added: no staged init left behind


def test_a_second_config_is_refused_not_read_over_the_first(tmp_path, capsys):
    """As the trainers' command line (jaxtrain.cmdline.one_config): argparse kept the last --config, unsaid."""
    from parity_tests import report

    with pytest.raises(SystemExit) as e:
        report.main(["--config", runs.TINY, "--config", "configs/small.yaml", "--out", str(tmp_path / "r")])
    assert e.value.code == 2
    assert f"error: --config is given 2 times ('{runs.TINY}', 'configs/small.yaml') but a run reads one YAML file" \
        in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
