"""Both trainers driven through their real command lines from one exported init, and their outputs read back.

Shared by the end-to-end tests (test_trajectories.py) and the report (report.py):

    init = export_init(dir, args)                        # jaxtrain's fresh params, torch format, weights only
    train("jaxtrain", run_args(out_a, cache), init)      # python -m jaxtrain.run ... --init.from=init
    train("torchref", run_args(out_b, cache), init)      # python -m torchref.run ... --init.from=init
    lines, state = read_metrics(out_a), final_state("jaxtrain", out_a, step)   # what judgment.py compares

Every run is a subprocess, so each backend runs exactly as a user runs it. Final states are compared in the torch
format (jaxtrain's Orbax checkpoints go through `python -m jaxtrain.convert to-torch`, which is lossless), so this
module needs neither jax nor torch: numpy and safetensors only. `python -m parity_tests.runs export-init OUT
[--config ...] [--section.key=value ...]` is the one place jax is used, in its own process.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from safetensors.numpy import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
BACKENDS = ("jaxtrain", "torchref")
TIMING_KEYS = ("tokens_per_s", "mfu")  # wall-clock: the only fields that may differ between identical runs

# The end-to-end model: small enough that ~10 runs of 100 steps fit in a few minutes on 2 CPU cores, with every
# rule of the update in play: accumulation (k=2), warmup then cosine, weight decay on both groups, and clipping at
# 1.0, above which the pre-clip norm stays for ~85 of the 100 steps (both branches of the clip are taken).
# lr 1e-3, not tiny.yaml's 3e-3: at 3e-3 this 512-token batch makes training chaotic after ~40 steps. There
# torchref diverges from ITSELF (grad_accum 1 vs 2, which only reorders fp32 sums) by 3e-3 in loss at step 100,
# as much as from jaxtrain (6e-3): rounding grows ~10x per 10 steps, and no per-step bound can hold. At 1e-3 the
# same two gaps stay at 1e-6 for all 100 steps, so the run can tell a rule change from rounding (a 10% change of
# weight_decay leaves the loss bound at step 8, decay_mask=names at step 5, the LR one warmup step ahead at step 1).
# tiny.yaml itself (4 layers, d=128) amplified rounding too at its lr of then, 3e-3 (1e-3 since, for this reason):
# over 100 fp32 steps jaxtrain vs torchref left 1e-5 at step 28 (max 1.6e-4), and one backend against itself under
# rounding-only changes reached 1.2e-5 (torchref, init moved by 1 ulp) and 2.5e-5 (jaxtrain, accumulation 1 vs 2);
# `python -m parity_tests.report` measures tiny.yaml as it is.
SMALL = ("--model.n_layer=2", "--model.n_head=4", "--model.d_model=64", "--model.seq_len=64", "--model.dropout=0.0",
         "--data.batch_size=8", "--optim.grad_accum_steps=2", "--optim.lr=1e-3", "--optim.min_lr=1e-4",
         "--optim.warmup_steps=10", "--optim.max_grad_norm=1.0", "--train.steps=100", "--train.precision=fp32",
         "--train.eval_every=0", "--train.eval_batches=2")
# Outputs the comparisons need, and nothing that slows a run down.
QUIET = ("--log.every=1", "--log.progress=false", "--log.tensorboard=false", "--log.sample_tokens=0")


class RunFailed(AssertionError):
    """A command that exited non-zero: exit code 2 is a user error, its stderr's last line the one-line message."""

    def __init__(self, cmd: list[str], returncode: int, stderr: str):
        super().__init__(f"`{' '.join(cmd)}` exited {returncode}:\n{stderr[-3000:]}")
        self.returncode, self.stderr = returncode, stderr


def _env() -> dict:
    """The caller's environment without a fake-device count: both CLIs must see the one CPU device a user has."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repository root; a failure raises with the command and stderr's tail."""
    cmd = [sys.executable, "-m", module, *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    proc.wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RunFailed(cmd, proc.returncode, proc.stderr)
    return proc


def run_args(out_dir: str, cache_dir: str, *overrides: str, config: str = TINY) -> list[str]:
    return ["--config", config, f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}", *QUIET, *overrides]


def export_init(out_dir: str, args: list[str]) -> str:
    """jaxtrain's fresh params for the config `args`, as a torch-format folder holding weights only (no
    optimizer.safetensors), so that --init.from starts either backend at step 0 with a fresh optimizer."""
    cli("parity_tests.runs", "export-init", out_dir, *args)
    return out_dir


def train(backend: str, args: list[str], init: str | None = None) -> subprocess.CompletedProcess:
    """One run of `python -m <backend>.run args [--init.from=init]` (fp32 or bf16 as the args say)."""
    assert backend in BACKENDS, backend
    return cli(f"{backend}.run", *args, *([f"--init.from={init}"] if init else []))


def to_torch(step_dir: str, out_dir: str) -> str:
    cli("jaxtrain.convert", "to-torch", step_dir, out_dir)
    return out_dir


def from_torch(src: str, out_dir: str) -> str:
    cli("jaxtrain.convert", "from-torch", src, out_dir)
    return out_dir


# Reading the outputs ----------------------------------------------------------------------------------------------

def read_metrics(out_dir: str) -> list[dict]:
    """metrics.jsonl's records, read as strict JSON: a bare NaN or Infinity, which Python's json takes, fails."""
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line, parse_constant=_not_json) for line in f if line.strip()]


def _not_json(constant: str):
    raise ValueError(f"metrics.jsonl holds {constant}, which JSON lacks")


def train_lines(lines: list[dict]) -> list[dict]:
    return [line for line in lines if "loss" in line]


def eval_lines(lines: list[dict]) -> list[dict]:
    return [line for line in lines if "eval_loss" in line]


def without_timing(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]


def final_state(backend: str, out_dir: str, step: int) -> dict[str, np.ndarray]:
    """Params and AdamW moments at `step`, by torch name (`<param>`, `<param>.exp_avg`, `<param>.exp_avg_sq`),
    in torch's layout. A jaxtrain checkpoint is converted first (bit-exact: a transpose, no arithmetic)."""
    step_dir = os.path.join(out_dir, "checkpoints", str(step))
    if backend == "jaxtrain":
        # Beside the run, not in it: a copy of the run folder (a resume test) must not inherit the conversion.
        converted = os.path.join(f"{os.path.normpath(out_dir)}-as-torch", str(step))
        if not os.path.isdir(converted):
            to_torch(step_dir, converted)
        step_dir = converted
    return {**load_file(os.path.join(step_dir, "model.safetensors")),
            **load_file(os.path.join(step_dir, "optimizer.safetensors"))}


def truncate_to(out_dir: str, step: int) -> None:
    """Make a finished run look stopped after its checkpoint at `step`: later checkpoints are deleted (the
    metrics lines past `step` stay, as after a crash: each trainer must drop them itself on resume)."""
    root = os.path.join(out_dir, "checkpoints")
    assert os.path.isdir(os.path.join(root, str(step))), f"no checkpoint at step {step} in {root}"
    for name in os.listdir(root):
        if name.isdigit() and int(name) > step:
            shutil.rmtree(os.path.join(root, name))


# The one jax-side helper, run in its own process ----------------------------------------------------------------

def _export_init_main(out_dir: str, argv: list[str]) -> None:
    from jaxtrain import config, data, step, torch_format

    cfg = config.load(argv)
    vocab = data.resolve_vocab_size(cfg.model.vocab_size, data.load(cfg.data, cfg.model.seq_len))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    torch_format.export(step.fresh_state(cfg, vocab), cfg, out_dir)
    os.remove(os.path.join(out_dir, torch_format.OPTIMIZER))  # weights only: both runs start at step 0


if __name__ == "__main__":
    from jaxtrain.errors import UserError, exit_on_user_error

    with exit_on_user_error():
        if len(sys.argv) < 3 or sys.argv[1] != "export-init":
            raise UserError("usage: python -m parity_tests.runs export-init OUT_DIR [--config ...] "
                            "[--section.key=value ...]")
        _export_init_main(sys.argv[2], sys.argv[3:])
