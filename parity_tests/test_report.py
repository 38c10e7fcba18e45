"""`python -m parity_tests.report` refuses a config the trainers refuse as they do: their one line, exit code 2, no
traceback (its runs are subprocesses; the report passes on what the first of them said), and the previous report
in --out untouched."""

import subprocess
import sys

import pytest
import yaml

from jaxtrain import config
from parity_tests import judgment, runs


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
    lines = proc.stderr.splitlines()  # the refusal alone: no progress line above it
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert _contents(out) == before  # and nothing added: no staged init left behind
    fresh = tmp_path / "new-report"
    proc = subprocess.run([sys.executable, "-m", "parity_tests.report", "--config", runs.TINY, "--out",
                           str(fresh), *flags], cwd=runs.REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and not fresh.exists()  # nor an empty --out made


def test_a_second_config_is_refused_not_read_over_the_first(tmp_path, capsys):
    """As the trainers' command line (jaxtrain.cmdline.one_config): argparse kept the last --config, unsaid."""
    from parity_tests import report

    with pytest.raises(SystemExit) as e:
        report.main(["--config", runs.TINY, "--config", "configs/small.yaml", "--out", str(tmp_path / "r")])
    assert e.value.code == 2
    assert f"error: --config is given 2 times ('{runs.TINY}', 'configs/small.yaml') but a run reads one YAML file" \
        in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag,way", [
    ("--run.out_dir=USER", "give --out"), ("--init.from=USER", "fresh params"), ("--train.steps=9", "--steps"),
    ("--train.precision=bf16", "--precision"), ("--model.dropout=0.1", "without dropout"),
    ("--log.every=10", "compares every step")])  # it judged the logged steps alone, and said "every step"
def test_a_key_the_report_sets_is_refused_naming_the_way(tmp_path, capsys, flag, way):
    """Each run's own flags come first in its command, the report's after: --run.out_dir of the user's sent
    jaxtrain's run into the user's folder (resuming, or --run.fresh setting aside, a run there) and torchref's onto
    it; the others were overridden unsaid. Refused before anything is written."""
    from parity_tests import report

    flag = flag.replace("USER", str(tmp_path / "mine"))
    with pytest.raises(SystemExit) as e:
        report.main(["--config", runs.TINY, "--out", str(tmp_path / "r"), flag])
    key = flag.split("=")[0]
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key} is the report's to set") and way in err[0], err
    assert err[0].endswith("; see python -m parity_tests.report --help"), err
    assert not (tmp_path / "mine").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("precision, factor", [("fp32", "15"), ("bf16", "3"), ("fp16", "3")])
def test_the_floor_paragraph_names_the_factor_its_bounds_use(precision, factor):
    """bf16's and fp16's bounds take 3 x the floor, fp32's 15 x: the paragraph said 15 for all three."""
    from parity_tests import report

    paragraph = report._floor_paragraph(precision, {"jaxtrain": "jaxtrain ref", "torchref": "torchref ref"})
    assert f"a per-step bound marked `+ {factor} x floor` allows" in paragraph
    assert judgment.floor_factor(precision) == float(factor)


def test_the_fp32_floor_runs_at_twice_the_accumulation_only_where_the_config_allows_it():
    """The reference doubles optim.grad_accum_steps; where the halved micro-batch breaks a rule of the config (the
    batch, or model.vocab_tiles' division of a micro-batch's tokens), the report has no floor, rather than a
    reference run refused after both backends trained."""
    from parity_tests import report

    def resolved(*flags):
        cfg = config.load(["--config", runs.TINY, "--model.seq_len=48", "--model.vocab_size=256", *flags])
        return yaml.safe_load(config.dump(cfg))

    assert report.reference("fp32", resolved("--data.batch_size=4")) == ("accum 2", ["--optim.grad_accum_steps=2"])
    assert report.reference("fp32", resolved("--data.batch_size=3")) == (None, [])  # 3 does not halve
    # 4 sequences of 48 tokens: 192 a micro-batch, 96 at twice the accumulation, which 64 tiles do not divide
    assert report.reference("fp32", resolved("--data.batch_size=4", "--model.vocab_tiles=64")) == (None, [])
    assert report.reference("fp32", resolved("--data.batch_size=4", "--model.vocab_tiles=32")) == (
        "accum 2", ["--optim.grad_accum_steps=2"])
    assert report.reference("bf16", resolved("--data.batch_size=3")) == ("fp32", ["--train.precision=fp32"])
