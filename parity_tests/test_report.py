"""`python -m parity_tests.report` refuses a config the trainers refuse as they do: their one line, exit code 2, no
traceback (its runs are subprocesses; the report passes on what the first of them said), and the previous report
in --out untouched. Its reference runs, and its judgment of low-precision runs (report.compare) on hand-made
metrics and states."""

import subprocess
import sys

import numpy as np
import pytest
import yaml

from jaxtrain import config
from jaxtrain.errors import UserError
from parity_tests import judgment, report, report_text, runs


def _contents(folder) -> dict:
    """Every path under `folder`: a folder's is True, a file's its text."""
    return {str(p.relative_to(folder)): p.is_dir() or p.read_text() for p in sorted(folder.rglob("*"))}


def _previous_report(out) -> dict:
    """A previous report's files in `out`, and their _contents."""
    (out / "runs" / "jaxtrain" / "checkpoints" / "500").mkdir(parents=True)
    (out / "runs" / "jaxtrain" / "metrics.jsonl").write_text('{"step": 500, "loss": 1.5}\n')
    (out / "report.md").write_text("# the previous report\n")
    return _contents(out)


@pytest.mark.parametrize("flags,message", [
    (["--steps", "20"], "error: optim.warmup_steps=50 must be smaller than the decay length 20"),  # tiny.yaml: 50
    (["--model.n_layerz=3"], "error: unknown config key 'model.n_layerz'; did you mean model.n_layer?"),
    # the export takes it, jaxtrain's start refuses it (one CPU device): runs/ was gone, progress lines above
    (["--mesh.fsdp=2"], "error: mesh.data=-1 x mesh.fsdp=2 does not cover the 1 devices")])
def test_report_refuses_a_bad_config_in_one_line_and_keeps_the_previous_report(tmp_path, flags, message):
    """A previous report's runs (hours of CPU) stay as they were: runs/ is replaced only once every run has
    finished (before, a typo deleted them and then exited 2; then a start a trainer refused did)."""
    out = tmp_path / "report"
    before = _previous_report(out)
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
    paragraph = report_text.floor_paragraph(precision, {"jaxtrain": "jaxtrain ref", "torchref": "torchref ref"})
    assert f"a per-step bound marked `+ {factor} x floor` allows" in paragraph
    assert judgment.floor_factor(precision) == float(factor)


_TILED = ("--model.seq_len=48", "--model.vocab_size=256", "--data.batch_size=4")  # 192 tokens: 3 tiles of 64


def _resolved(*flags) -> dict:
    """tiny.yaml with model.seq_len 48 and vocabulary 256, and `flags`, as the YAML mapping report.reference takes."""
    return yaml.safe_load(config.dump(config.load(["--config", runs.TINY, *_TILED, *flags])))


def test_the_fp32_floor_runs_at_another_accumulation_where_the_config_allows_one():
    """The reference doubles optim.grad_accum_steps; where the config refuses that (the batch, or model.vocab_tiles'
    division of a micro-batch's tokens), it halves it, else takes another count that splits the batch. Where none
    runs, the report has no floor, rather than a reference run refused after both backends trained. With no floor,
    every bound is its constant alone, which a long correct run can leave: a batch of 3 had none."""
    assert report.reference("fp32", _resolved()) == ("accum 2", ["--optim.grad_accum_steps=2"])
    assert report.reference("fp32", _resolved("--data.batch_size=3")) == ("accum 3", ["--optim.grad_accum_steps=3"])
    assert report.reference("fp32", _resolved("--optim.grad_accum_steps=4")) == (
        "accum 2", ["--optim.grad_accum_steps=2"])  # 8 micro-batches of a batch of 4: no
    assert report.reference("fp32", _resolved("--data.batch_size=1")) == (None, [])  # one sequence splits no way
    # 4 sequences of 48 tokens: 192 a micro-batch, 96 at twice the accumulation and 48 at 4, which 64 tiles do not
    # divide
    assert report.reference("fp32", _resolved("--model.vocab_tiles=64")) == (None, [])
    assert report.reference("fp32", _resolved("--model.vocab_tiles=32")) == (
        "accum 2", ["--optim.grad_accum_steps=2"])
    # 12 sequences at k=4: 8, 2, then the divisors of 12 nearest to 4 by ratio (3: 0.75, 6: 1.5, 12: 3, 1: 0.25)
    assert report.accumulations(4, 12) == [8, 2, 3, 6, 12, 1]
    assert report.accumulations(1, 6) == [2, 3, 6]
    assert report.reference("bf16", _resolved("--data.batch_size=3")) == ("fp32", ["--train.precision=fp32"])


# bf16-only settings (and cudnn attention, which kernel_choice refuses off bf16), as the fp32 reference replaces them
LOW_ONLY = ("--train.precision=bf16", "--model.residual_dtype=bf16", "--model.gelu_fwd=pallas",
            "--model.qkv_grad=pallas", "--model.attention=cudnn")


def test_the_low_precision_reference_runs_the_model_in_fp32_throughout():
    """The fp32 reference of a bf16 report with a bf16 residual stream or bf16/fp16 kernels: the same model in fp32
    (residual stream fp32, XLA's kernels), which the trainers' config loader takes; before, it kept them with
    train.precision=fp32, which the trainers refuse, after both backends had trained."""
    suffix, flags = report.reference("bf16", _resolved(*LOW_ONLY))
    assert suffix == "fp32" and flags == ["--train.precision=fp32", "--model.residual_dtype=fp32",
                                          "--model.gelu_fwd=xla", "--model.qkv_grad=xla", "--model.attention=auto"]
    config.load(["--config", runs.TINY, *_TILED, *LOW_ONLY, *flags])  # the reference's command line: taken
    with pytest.raises(UserError, match="precision=fp32"):
        config.load(["--config", runs.TINY, *_TILED, *LOW_ONLY, "--train.precision=fp32"])  # the old reference


def test_a_reference_the_config_refuses_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    """Whatever the fp32 reference cannot run is refused before the first run, in one line, the previous report
    kept: here the reference without its fp32 counterparts, as it was before them."""
    monkeypatch.setattr(report, "FP32_COUNTERPARTS", {})
    out = tmp_path / "report"
    before = _previous_report(out)
    small = ["--steps", "1", "--optim.warmup_steps=0", "--model.n_layer=1", "--model.d_model=32", "--model.n_head=2",
             "--model.seq_len=16", "--data.batch_size=4", "--train.eval_batches=1"]  # quick, had it trained
    with pytest.raises(SystemExit) as e:
        report.main(["--config", runs.TINY, "--out", str(out), "--precision", "bf16", "--model.residual_dtype=bf16",
                     *small])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: the fp32 reference runs (--train.precision=fp32) would be refused: "
                             "model.residual_dtype=bf16 rounds the residual stream to bf16"), err
    assert _contents(out) == before


# report.compare on hand-made runs: 3 steps, torchref's bf16 loss 1e-3 above its fp32 run's at every step -----------

def _lines(losses, evals=True) -> list[dict]:
    lines = [{"step": s, "loss": x, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s} for s, x in enumerate(losses, 1)]
    return lines + ([{"step": len(losses), "eval_loss": 2.0, "eval_accuracy": 0.5}] if evals else [])


def _state(w: float) -> dict[str, np.ndarray]:
    """One LayerNorm weight (two entries, one at `w`) and its AdamW moments."""
    return {"h.0.ln_1.weight": np.array([w, 1.0]), "h.0.ln_1.weight.exp_avg": np.zeros(2),
            "h.0.ln_1.weight.exp_avg_sq": np.zeros(2)}


REFS = {"jaxtrain": "jaxtrain fp32", "torchref": "torchref fp32"}
FP32_LOSS = np.array([2.0, 1.9, 1.8])


def _compare(jax_loss, jax_w=0.5, torch_evals=True):
    """report.compare of bf16 runs: torchref's loss FP32_LOSS + 1e-3, both fp32 runs' FP32_LOSS; every final state
    0.5 (torchref's own params gap 0: its bf16 moved no weight, as at lr 1e-30), jaxtrain's bf16 one `jax_w`."""
    lines = {"jaxtrain": _lines(jax_loss), "torchref": _lines(FP32_LOSS + 1e-3, torch_evals),
             "jaxtrain fp32": _lines(FP32_LOSS), "torchref fp32": _lines(FP32_LOSS)}
    states = {label: _state(jax_w if label == "jaxtrain" else 0.5) for label in lines}
    return {r.component: r for r in report.compare(lines, states, "bf16", REFS)}


def test_a_zero_reference_gap_is_judged_not_divided_by():
    """torchref's own params gap 0: a cross gap of 0 is 0x it (before: ZeroDivisionError), one of 1e-3 infinitely
    many times it, out of bound."""
    rows = _compare(FP32_LOSS + 1e-3)
    assert all(r.passed is not False for r in rows.values()), judgment.format_rows(list(rows.values()))
    assert rows["final params gap / torchref's bf16-fp32 gap"].max_abs == 0.0
    moved = _compare(FP32_LOSS + 1e-3, jax_w=0.5 + 1e-3)["final params gap / torchref's bf16-fp32 gap"]
    assert moved.passed is False and moved.max_abs == np.inf


def test_a_jaxtrain_that_computes_in_fp32_fails_the_report():
    """The review's mutation, in numbers: jaxtrain's 'bf16' run equal to its fp32 run. Its gap to torchref's bf16 is
    then 1x torchref's own (passed, alone); its own gap is 0."""
    rows = _compare(FP32_LOSS)
    assert rows["loss gap / torchref's bf16-fp32 gap"].passed and rows["loss mean |dloss|"].passed
    mine = rows["jaxtrain's bf16-fp32 loss gap / torchref's"]
    assert mine.passed is False and mine.max_abs == 0.0
    assert [r.component for r in rows.values() if r.passed is False] == [mine.component]
    assert _compare(FP32_LOSS + 0.8e-3)["jaxtrain's bf16-fp32 loss gap / torchref's"].passed  # 0.8x: comparable


def test_an_eval_torchref_skipped_fails_the_report():
    """torchref without its eval line: before, the eval rows compared nothing and report.md said every component
    was within its bound."""
    rows = list(_compare(FP32_LOSS + 1e-3, torch_evals=False).values())
    resolved = yaml.safe_load(config.dump(config.load(["--config", runs.TINY])))
    text = report_text.markdown(runs.TINY, "bf16", resolved, [], rows, {}, {"jaxtrain": "/r/runs/jaxtrain"}, REFS)
    assert "**Every component is within its bound" not in text
    assert "**First step out of bound: 3** (eval steps logged by one run only: [3])." in text
