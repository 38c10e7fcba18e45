"""train.nan_policy in both backends, from one init, with NaN injected into the same windows
(parity_tests.inject_nan): the same skip decisions, the same LR held through each skip, the same trajectory
around them; and with halt, the same stop before anything after the bad step is saved.

runs.SMALL's model cut to 12 steps (warmup 5), windows 3, 4 and 9 poisoned: a run of two skips and a lone one.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxtrain import config
from parity_tests import bounds, judgment, runs
from parity_tests.bounds import FP32
from parity_tests.judgment import Bound
from torchref.optim import get_lr

STEPS, WARMUP, BAD = 12, 5, (3, 4, 9)
ARGS = (*runs.SMALL, f"--train.steps={STEPS}", f"--optim.warmup_steps={WARMUP}", "--checkpoint.every=1",
        "--checkpoint.max_to_keep=20")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("nan_policy")


@pytest.fixture(scope="module")
def args(work):
    def make(out_dir, *more):
        return runs.run_args(str(out_dir), str(work / "corpus"), *ARGS, *more)
    return make


@pytest.fixture(scope="module")
def init(work, args):
    return runs.export_init(str(work / "init"), args(work / "init-config"))


def injected(backend: str, argv: list[str], init: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "parity_tests.inject_nan", backend, ",".join(map(str, BAD)), *argv,
           f"--init.from={init}"]
    return subprocess.run(cmd, cwd=runs.REPO, env=runs._env(), capture_output=True, text=True)


@pytest.fixture(scope="module")
def skipped_runs(work, args, init):
    outs = {}
    for backend in runs.BACKENDS:
        outs[backend] = str(work / f"skip-{backend}")
        proc = injected(backend, args(outs[backend], "--train.nan_policy=skip"), init)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return outs


def test_both_skip_the_same_windows_and_hold_the_lr(skipped_runs, args):
    """Counted by hand: a skipped window counts, its update does not, so the LR stands still through it (no
    scheduler.step(), no AdamW count) while the data moves on: step s applies LR(s - 1 - skips before s). The
    curve LR(t) itself is parity-tested in test_schedule.py."""
    cfg = config.load(args("unused"))
    skipped_before = [sum(b < s for b in BAD) for s in range(1, STEPS + 1)]
    want_skipped = [sum(b <= s for b in BAD) for s in range(1, STEPS + 1)]
    want_lr = [get_lr(s - 1 - skipped_before[s - 1], cfg) for s in range(1, STEPS + 1)]
    for backend, out in skipped_runs.items():
        lines = runs.train_lines(runs.read_metrics(out))
        assert [line["skipped"] for line in lines] == want_skipped, backend
        # NaN written null: metrics.jsonl is strict JSON (runs.read_metrics refuses a bare NaN)
        assert [s for s, line in enumerate(lines, 1) if line["loss"] is None] == list(BAD), backend
        # optax evaluates the schedule in float32: a few ulps (bounds.FP32["lr"])
        np.testing.assert_allclose([line["lr"] for line in lines], want_lr, rtol=1e-6, err_msg=backend)
        assert sorted(map(int, os.listdir(os.path.join(out, "checkpoints")))) == list(range(1, STEPS + 1)), backend


def test_trajectories_agree_around_the_skips(skipped_runs):
    """Per step, the finite ones (a NaN compares with nothing), within the fp32 trajectory bounds; the final state
    within bounds.params_bound, as an uninterrupted fp32 run."""
    jax_lines, torch_lines = (runs.read_metrics(skipped_runs[b]) for b in runs.BACKENDS)
    finite = [s for s in range(1, STEPS + 1) if s not in BAD]
    rows = judgment.compare_metrics(jax_lines, torch_lines, {k: FP32[k] for k in ("loss", "grad_norm", "tokens")},
                                steps=finite)
    rows += judgment.compare_metrics(jax_lines, torch_lines, {"lr": FP32["lr"],
                                                          "skipped": Bound(0.0, 0.0, "a count: exact")})
    lrs = [line["lr"] for line in runs.train_lines(torch_lines) if line["step"] in finite]
    states = [runs.final_state(b, skipped_runs[b], STEPS) for b in runs.BACKENDS]
    params = bounds.params_bound(lrs)
    rows += judgment.compare_states(*states, {"params": params, "exp_avg": None, "exp_avg_sq": None})
    bad = judgment.failures(rows)
    assert not bad, f"{bad}\n\n{judgment.format_rows(rows)}"


@pytest.mark.parametrize("backend", runs.BACKENDS)
def test_halt_stops_before_saving_past_the_bad_step(work, args, init, backend):
    """halt: exit 2 at step 3, one line naming the newest checkpoint (2), and nothing saved after it; the same
    command again stops the same way (it resumes from 2, meets the same window), it does not loop or save."""
    out = str(work / f"halt-{backend}")
    for attempt in range(2):
        proc = injected(backend, args(out), init)
        assert proc.returncode == 2, proc.stderr[-3000:]
        error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(error) == 1 and "at step 3: training diverged" in error[0], proc.stderr[-3000:]
        assert "the newest checkpoint, step 2" in error[0] and "Traceback" not in proc.stderr
        assert sorted(map(int, os.listdir(os.path.join(out, "checkpoints")))) == [1, 2], attempt
    state = runs.final_state(backend, out, 2)
    assert all(np.isfinite(x).all() for x in state.values())


@pytest.mark.slow
@pytest.mark.parametrize("backend", runs.BACKENDS)
def test_a_resume_after_skips_continues_the_same_run(work, args, init, skipped_runs, backend):
    """Stopped at step 5 (after the skips at 3 and 4) and started again: the checkpoint carries the skips (jaxtrain:
    gradient_step minus AdamW's count; torchref: trainer_state's `skipped`), so every later line is the
    uninterrupted run's, bit for bit."""
    out = str(work / f"resumed-{backend}")
    shutil.copytree(skipped_runs[backend], out)
    runs.truncate_to(out, 5)
    proc = injected(backend, args(out, "--train.nan_policy=skip"), init)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, straight = (runs.without_timing(runs.read_metrics(d)) for d in (out, skipped_runs[backend]))
    assert json.dumps(resumed) == json.dumps(straight)  # NaN == NaN as text
