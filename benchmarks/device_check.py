"""The GPU measurements issue 11 still needs, as one call of the device tool, in order of value, inside a time budget.

A lent GPU comes with 15 minutes of device time a task, the machine's start included, and one command runs at most
10 minutes: there is no time to think between commands. So the commands are prepared here, and this module runs them
there one after the other, each under its own time cap, and stops starting new ones when the budget would not cover
them (and says so). Every stage's output goes to one log; a summary names each stage's exit, time and result lines.

Here, once (the pure-Python packages the device image lacks, as wheels for its Python 3.12; `.whl/` is ignored):

    python -m benchmarks.device_check --wheels .whl

There, as the device tool's command (kind nvidia-h100-x1, the card of the README's table, where `status` lists it;
some sessions are lent only nvidia-h200, where the same stages run and the results name that card; carry
[".whl"]; timeout_s 600, a command's most: with the machine's start, about 12 of the 15 minutes):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. &&
    python3 -m benchmarks.device_check --out $OUT --budget-s 575

`--list` prints the stages and their caps. If the norm kernels' tests fail (stage `kernels`: their Triton lowering,
which this CPU cannot run), the steps are measured with `--model.norm=xla`, so the README's figures are never those of
wrong math. A stage's `env` sets variables for it alone (`XLA_FLAGS` for an A/B of an XLA option). Only the standard
library here: the `env` stage is what reports a package the image lacks.
"""

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time

# benchmarks.run's settings for GPT-2 124M on one GPU: the README's table (batch 128 x 1024 in 4 micro-batches).
GPT2 = ("--config", "configs/gpt2-124m.yaml", "--synthetic", "--one-at-a-time", "--only", "throughput")
TABLE = ("--rounds", "3", "--steps", "6", "--data.batch_size=128", "--optim.grad_accum_steps=4")
AB = ("--rounds", "2", "--steps", "6", "--rows", "jax-bf16")
TABLE_ROWS = ("--rows", "jax-bf16,torch-bf16,compile-bf16,matmul-jax-bf16,matmul-torch-bf16")
# nvJitLink: jax >= 0.12's Mosaic GPU compiles through it where installed, and ptxas then ignores the kernels'
# setmaxnreg (benchmarks/NOTES.md, "The three kernels on the jax a GPU runs")
ENV_SCRIPT = """
import importlib.metadata as m, shutil, subprocess
for p in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "draccus",
          "torch", "triton", "nvidia-nvjitlink-cu12", "nvidia-nvjitlink-cu13", "nvidia-nvjitlink"):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, "not installed")
if shutil.which("nvidia-smi"): print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout)
import jax; print("devices:", jax.devices())
import jaxtrain.run, torchref.run, benchmarks.run, benchmarks.profile  # what every stage below imports
"""
# loss.logsumexp's one read of the logits (a variadic reduction: 2.6x its roofline in the 2026-11-28 profile) against
# jax.nn.logsumexp's two, on bf16 logits of GPT-2 124M's micro-batch of 16 (rows, vocabulary: argv) cast up in the
# reduction as in the step: which is faster on the GPU, and at what fraction of its bandwidth.
LSE_SCRIPT = """
import sys, time, jax, jax.numpy as jnp
from jaxtrain import loss
rows, vocab = (int(a) for a in sys.argv[1:3])
x = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32).astype(jnp.bfloat16)
for name, f in (("one read (loss.logsumexp)", loss.logsumexp), ("two reads (jax.nn.logsumexp)",
                lambda x: jax.nn.logsumexp(x, axis=-1))):
    run = jax.jit(lambda x: f(x.astype(jnp.float32)))
    run(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(20):
        out = run(x)
    out.block_until_ready()
    ms = (time.perf_counter() - t0) / 20 * 1e3
    print(f"{name}: {ms:.3f} ms, {x.nbytes / ms / 1e6:.1f} GB/s of one read of the logits")
"""
BUDGET_S = 580  # no stage runs past it; the device tool's timeout_s of 600 adds the wheels' install and slack
WHEELS = ("draccus", "mergedeep", "toml")  # draccus and its needs: the device image lacks them (KINDS.md)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One command (the arguments after `python`), what it tells, the seconds it is expected to take (it is not
    started with less left) and its cap (it is stopped there). `{norm}` in its arguments is the norm the step is
    measured with: `auto` (the GPU's default, the Pallas kernels) unless the kernels' tests failed, then `xla`."""
    name: str
    why: str
    args: tuple[str, ...]
    expect_s: int
    cap_s: int
    required: bool = False  # a failure stops the stages after it
    needs: tuple[str, ...] = ()  # stages whose failure in this call skips it (kernels whose tests failed)
    json: bool = False  # benchmarks.run writes its results to <out>/<name>.json
    env: tuple[tuple[str, str], ...] = ()  # set for its process, over the runner's environment


# XLA:GPU's default, under which it may drop a bf16 rounding that an fp32 consumer follows; the step compiles without
# it (autocast.rounding_options), and a user's XLA_FLAGS win over the step's options.
EXCESS = (("XLA_FLAGS", "--xla_allow_excess_precision=true"),)
MODEL_TESTS = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short", "tests/test_model.py",
               "tests/test_autocast.py", "tests/test_loss.py", "-k",
               "(exact_gelu or linear_bf16_is_torchs or written_out_attention or cudnn_attention_matches or "
               "column_blocks or logsumexp) and not onednn")  # a CPU's oneDNN dots: not a GPU's business
STEP = ("-m", "benchmarks.run", *GPT2, *AB, "--data.batch_size=128", "--optim.grad_accum_steps=4",
        "--model.norm={norm}")
# The config's own batch (480 x 1024 in 16 micro-batches of 30), as `python -m jaxtrain.run --config
# configs/gpt2-124m.yaml` trains on one GPU: the optimizer's update and the weights' casts once a window of 16, not 4.
RECIPE = ("-m", "benchmarks.run", *GPT2, *AB, "--model.norm={norm}")
KERNEL_TESTS = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short")
KERNEL_OPTIONS = {"gelu": "--model.gelu_grad=pallas", "head": "--model.head_lse=pallas",
                  "qkv": "--model.qkv_grad=pallas", "fc": "--model.gelu_fwd=pallas"}  # the four Hopper gemm kernels
# What a stage measuring a gemm kernel needs to have passed where it ran in the same call: no figure of wrong math.
KERNEL_TESTS_OF = {"gelu": ("gelu_tests",), "head": ("head_tests",), "qkv": ("qkv_tests",), "fc": ("gelu_tests",)}
ALL_KERNEL_TESTS = ("gelu_tests", "head_tests", "qkv_tests")

STAGES = (
    Stage("env", "versions, the GPU, and whether jaxtrain imports on the image's jax", ("-c", ENV_SCRIPT), 15, 60,
          required=True),
    Stage("kernels", "the norm kernels as Triton compiles them, against float64 formulas and XLA's autodiff "
          "(NOTES stage 0)", ("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                              "tests/test_fused_norm.py", "-k", "not mesh"), 40, 120),
    Stage("step", "jaxtrain's row of the table alone, the A/B's baseline on the same machine", STEP, 45, 100,
          json=True),
    Stage("gelu_tests", "the MLP's two GELU gemm kernels, c_fc's with GELU and c_proj's dx with its gradient "
          "(model.gelu_fwd=pallas, model.gelu_grad=pallas, gelu_gemm.py: never run on a GPU) as Mosaic GPU compiles "
          "them, against float64 and the model without them", KERNEL_TESTS + ("tests/test_gelu_gemm.py",), 55, 150),
    Stage("head_tests", "the head gemm with the logsumexp in its epilogue (model.head_lse=pallas, head_lse.py: never "
          "run on a GPU) as Mosaic GPU compiles it, against float64 and the loss without it",
          KERNEL_TESTS + ("tests/test_head_lse.py",), 35, 120),
    Stage("qkv_tests", "c_attn's dx over q's, k's and v's gradients (model.qkv_grad=pallas, qkv_grad.py: never run "
          "on a GPU) as Mosaic GPU compiles it, against float64 and the model without it",
          KERNEL_TESTS + ("tests/test_qkv_grad.py",), 30, 120),
    Stage("step_kernels", "jaxtrain's row with the four gemm kernels (against `step`: the roofline says -10.8%)",
          STEP + tuple(KERNEL_OPTIONS.values()), 45, 100, json=True, needs=ALL_KERNEL_TESTS),
    Stage("step_stream", "jaxtrain's row with the four gemm kernels and a bf16 residual stream "
          "(model.residual_dtype=bf16, llm.c's numerics; the roofline: -5.9% from step_kernels, -16.1% from `step`)",
          STEP + tuple(KERNEL_OPTIONS.values()) + ("--model.residual_dtype=bf16",), 45, 100, json=True,
          needs=ALL_KERNEL_TESTS),
    Stage("recipe", "jaxtrain's row at the config's own batch, 480 in 16 micro-batches of 30 (the roofline a "
          "sequence against 64 in 4: -3.5%, with the four kernels -4.0%; the once-a-window passes spread over 16)",
          RECIPE, 55, 120, json=True),
    Stage("recipe_kernels", "the same with the four gemm kernels: issue 11's 50% line on the config as it trains",
          RECIPE + tuple(KERNEL_OPTIONS.values()), 55, 120, json=True, needs=ALL_KERNEL_TESTS),
    Stage("model_tests", "test_model's bit-for-bit tests against torch on the GPU, compiled as the step compiles "
          "(six failed under XLA's default excess precision on 2026-11-28, all passed without it), cuDNN's "
          "attention against the written-out one, and the q, k, v gemms (Linear.column_blocks) against the one gemm "
          "split, the loss's one-pass logsumexp against float64", MODEL_TESTS, 40, 90),
    Stage("profile", "where the step's time goes with the four gemm kernels (139.5 ms of GPU time without them, "
          "2026-11-28)", ("-m", "benchmarks.profile", "--config", "configs/gpt2-124m.yaml", "--synthetic",
                          "--data.batch_size=64", "--optim.grad_accum_steps=4", "--model.norm={norm}",
                          *KERNEL_OPTIONS.values()), 50, 120, needs=ALL_KERNEL_TESTS),
    Stage("gelu_ab", "the GELU kernel alone at GPT-2's shapes, five tile settings, against XLA's gemm and GELU "
          "backward (5.79 ms of the 139.5 ms profile) and the gemm alone", ("-m", "benchmarks.gelu_gemm"), 40, 90),
)
# Run only where --stages names them (they do not fit the default budget beside the stages above): the README's
# table, whose command and config are what the step's default is, and the same at the config's own batch (and that
# batch in bigger micro-batches); the cost of torch's roundings, answered twice; each kernel's step alone and three
# of the kernels alone (where step_kernels, gelu_ab and the profile leave it open which one helps); the loss's
# logsumexp alone (a lead the head's kernel may make moot).
ON_REQUEST = (
    Stage("table", "the README's table: jaxtrain bf16 against torchref eager and torch.compile, MFU of 989 TFLOP/s "
          "(NOTES stage 4)", ("-m", "benchmarks.run", *GPT2, *TABLE, "--model.norm={norm}", *TABLE_ROWS), 170, 300,
          json=True),
    Stage("table_recipe", "the same rows at the config's own batch (480 in 16; torch eager's step ~4 s), jaxtrain's "
          "with the four gemm kernels: the table for the README where recipe_kernels reaches 50%",
          ("-m", "benchmarks.run", *GPT2, "--rounds", "3", "--steps", "4", "--model.norm={norm}",
           *KERNEL_OPTIONS.values(), *TABLE_ROWS), 330, 480, json=True, needs=ALL_KERNEL_TESTS),
    Stage("recipe_micro60", "recipe_kernels in 8 micro-batches of 60 (the roofline: -1.3%, the per-micro-batch "
          "gradient accumulation halved; 28.8 GiB by XLA's memory_analysis, micro-batch 64 measured 38.8 GB on "
          "2026-11-28): whether the config should take fewer, bigger micro-batches on an 80 GB GPU",
          RECIPE + tuple(KERNEL_OPTIONS.values()) + ("--optim.grad_accum_steps=8",), 55, 120, json=True,
          needs=ALL_KERNEL_TESTS),
    Stage("step_excess", "jaxtrain's row with XLA's excess precision back on (the step compiles without it on a GPU "
          "since 2026-11-28, autocast.rounding_options): what torch's roundings cost (2026-11-28: 272.8 ms without, "
          "275.8 with)", STEP, 40, 100, json=True, env=EXCESS),
    Stage("step_gelu", "jaxtrain's row with the GELU-gradient kernel alone (the roofline: -5.0%)",
          STEP + (KERNEL_OPTIONS["gelu"],), 45, 100, json=True, needs=KERNEL_TESTS_OF["gelu"]),
    Stage("step_head", "jaxtrain's row with the head's kernel alone (the roofline: -2.1%; the profile's logsumexp "
          "pass, 5.11 ms of 139.5, gone)", STEP + (KERNEL_OPTIONS["head"],), 45, 100, json=True,
          needs=KERNEL_TESTS_OF["head"]),
    Stage("step_qkv", "jaxtrain's row with c_attn's dx kernel alone (the roofline: -1.0%; the profile's "
          "concatenation, 2.15 ms of 139.5, gone)", STEP + (KERNEL_OPTIONS["qkv"],), 45, 100, json=True,
          needs=KERNEL_TESTS_OF["qkv"]),
    Stage("step_fc", "jaxtrain's row with c_fc's kernel alone (the roofline: -2.6%; beside the other three -2.9%; "
          "GELU's pass, 4.21 ms of 139.5, gone)", STEP + (KERNEL_OPTIONS["fc"],), 45, 100, json=True,
          needs=KERNEL_TESTS_OF["fc"]),
    Stage("head_ab", "the head's kernel alone at GPT-2's shapes, five tile settings, against XLA's gemm and "
          "logsumexp and the gemm alone", ("-m", "benchmarks.head_lse"), 40, 90),
    Stage("qkv_ab", "c_attn's dx kernel alone at GPT-2's shapes, five tile settings, against XLA's concatenation "
          "and gemm (the concatenation: 2.15 ms of the profile) and the gemm alone", ("-m", "benchmarks.qkv_grad"),
          40, 90),
    Stage("fc_ab", "c_fc's kernel with the bias and GELU alone at GPT-2's shapes, five tile settings, against XLA's "
          "gemm and GELU (4.21 ms of the profile) and the gemm alone", ("-m", "benchmarks.gelu_fwd"), 40, 90),
    Stage("lse_ab", "the loss's logsumexp alone, one read against two (NOTES, the profile against the roofline)",
          ("-c", LSE_SCRIPT, "16384", "50304"), 25, 60),
)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="the folder for session.log, summary.md and the tables' JSON (there: $OUT)")
    what.add_argument("--wheels", help="here: download the wheels the device image lacks into this folder")
    what.add_argument("--list", action="store_true", help="print the stages and their times")
    ap.add_argument("--budget-s", type=int, default=BUDGET_S, help="seconds for all the stages together")
    ap.add_argument("--stages", help="comma-separated stage names, run in this order (default: all, as --list)")
    args = ap.parse_args(argv)
    stages = chosen_stages(args.stages)
    if args.list:
        width = max(len(s.name) for s in STAGES + ON_REQUEST)
        print("\n".join(f"{s.name:{width}} expect {s.expect_s:3d}s cap {s.cap_s:3d}s  {s.why}" for s in STAGES))
        print("\n".join(f"{s.name:{width}} expect {s.expect_s:3d}s cap {s.cap_s:3d}s  --stages only: {s.why}"
                        for s in ON_REQUEST))
    elif args.wheels:
        download_wheels(args.wheels)
    else:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            print(f"error: --out {args.out!r}: {e.strerror}; choose another folder", file=sys.stderr)
            sys.exit(2)
        signal.signal(signal.SIGTERM, _terminate)
        try:
            results = run_stages(stages, args.out, args.budget_s)
        except Terminated:  # between two stages: summary.md holds every stage that ran
            sys.exit(128 + signal.SIGTERM)
        print(write_summary(results, args.out))


def chosen_stages(names: str | None) -> tuple[Stage, ...]:
    """--stages' names as stages (a rerun of some inside a lease's last minutes, or one ON_REQUEST); every stage of
    STAGES where none is named."""
    if names is None:
        return STAGES
    by_name = {s.name: s for s in STAGES + ON_REQUEST}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        print(f"error: --stages: no stage {', '.join(unknown)}; the stages are {', '.join(by_name)}", file=sys.stderr)
        sys.exit(2)
    return tuple(by_name[n] for n in names.split(","))


def download_wheels(folder: str) -> None:
    """This venv's versions of WHEELS, as wheels for the device's Python 3.12 (pure Python: any platform's do)."""
    import importlib.metadata
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "-d", folder, *pins], check=True)
    print(f"{folder}: {', '.join(sorted(os.listdir(folder)))}")


def run_stages(stages, out: str, budget_s: float) -> list[dict]:
    """Each stage in turn while the budget covers its expected time; its output appended to <out>/session.log, and
    summary.md rewritten after it: a runner killed later (the device tool's limit) keeps what it measured."""
    deadline, norm, stopped = time.monotonic() + budget_s, "auto", None
    results = []
    with open(os.path.join(out, "session.log"), "ab") as log:
        for stage in stages:
            left = deadline - time.monotonic()
            failed = [r["stage"].name for r in results if r["outcome"] != "passed" and r["stage"].name in stage.needs]
            stopped_here = stopped or (f"{failed[0]} did not pass" if failed else None)
            if stopped_here or left < stage.expect_s:
                why = f"not run: {stopped_here}" if stopped_here else f"not run: {left:.0f}s of the budget left"
                results.append({"stage": stage, "outcome": why, "seconds": 0.0})
                continue
            result = run_one(stage, stage_args(stage, norm, out), min(stage.cap_s, left), stage.cap_s, log)
            results.append(result)
            write_summary(results, out)
            if stage.name == "kernels" and result["outcome"] != "passed":
                norm = "xla"  # the table is not measured on kernels whose math the tests refused
            if result["outcome"] == TERMINATED:
                stopped = "the runner was sent SIGTERM"
            elif stage.required and result["outcome"] != "passed":
                stopped = f"{stage.name} failed"
    return results


def stage_args(stage: Stage, norm: str, out: str) -> list[str]:
    args = [a.replace("{norm}", norm) for a in stage.args]
    return args + ["--json", os.path.join(out, f"{stage.name}.json")] if stage.json else args


def run_one(stage: Stage, args: list[str], timeout_s: float, cap_s: float, log) -> dict:
    """Runs one stage in its own process group (benchmarks.run starts a process per row), killed whole at the
    timeout (its cap, or the budget's end where that comes first) or when the runner is sent SIGTERM; its output
    goes to the log between a header and a footer."""
    _write(log, f"\n===== {stage.name}: {command_line(args, stage.env)}\n")
    start, t0 = log.tell(), time.monotonic()
    proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **dict(stage.env)))
    try:
        rc = proc.wait(timeout=timeout_s)
        outcome = "passed" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        outcome = f"stopped at its cap of {cap_s:.0f}s" if timeout_s >= cap_s else \
            f"stopped where the budget ended, after {timeout_s:.0f}s"
    except Terminated:
        outcome = TERMINATED
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group: the stage, or what it left running
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.monotonic() - t0
    log.seek(0, os.SEEK_END)  # past what the stage wrote through the same open file
    _write(log, f"===== {stage.name}: {outcome} in {seconds:.1f}s\n")
    return {"stage": stage, "outcome": outcome, "seconds": seconds, "start": start, "args": args}


class Terminated(Exception):
    """SIGTERM to the runner (the device tool at its limit, or a person): the running stage is stopped with its
    processes, which would hold the GPU on past the runner, and no other stage starts."""


TERMINATED = "stopped: the runner was sent SIGTERM"


def _terminate(signum, frame):
    raise Terminated


def command_line(args: list[str], env: tuple[tuple[str, str], ...] = ()) -> str:
    return " ".join([*(f"{k}={v}" for k, v in env), "python", *("<script>" if "\n" in a else a for a in args)])


def _write(log, text: str) -> None:
    log.write(text.encode())
    log.flush()


def write_summary(results: list[dict], out: str) -> str:
    """summary.md: a line per stage, then the end of each stage's output (a passed stage's last 80 lines: the tables,
    pytest's closing line; a failed one's last 25)."""
    with open(os.path.join(out, "session.log"), "rb") as f:
        log = f.read()
    lines = ["| stage | outcome | s | what it tells |", "|---|---|---|---|"]
    lines += [f"| {r['stage'].name} | {r['outcome']} | {r['seconds']:.0f} | {r['stage'].why} |" for r in results]
    for r in results:
        if "args" not in r:
            continue
        output = log[r["start"]:].decode(errors="replace").split(f"===== {r['stage'].name}: ", 1)[0].splitlines()
        lines += ["", f"## {r['stage'].name}: {command_line(r['args'], r['stage'].env)}", "",
                  *output[-(80 if r["outcome"] == "passed" else 25):]]
    summary = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
