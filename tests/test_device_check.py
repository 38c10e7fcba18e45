"""benchmarks/device_check.py, the prepared GPU session: each stage is a command its tool takes (so the script cannot
rot while no GPU is lent), and the runner keeps to its budget, stops a stage at its cap with the processes it
started, measures the table with XLA's norm when the kernels' tests fail, and writes a summary of every stage."""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import pytest
import yaml

import processes
from benchmarks import device_check, profile, run as bench
from jaxtrain import hopper_gemm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _after_module(args: list[str], module: str) -> list[str] | None:
    return args[2:] if args[:2] == ["-m", module] else None


@pytest.mark.parametrize("norm", ["auto", "xla"])
def test_each_benchmark_stage_is_a_command_its_tool_takes(norm, tmp_path, monkeypatch):
    """The flags through the tool's own parser, the overrides through config.load (an unknown key or a bad value
    is refused there), the rows through benchmarks.run's check; the norm as the runner substitutes it."""
    monkeypatch.chdir(REPO)
    seen = set()
    for stage in device_check.STAGES + device_check.ON_REQUEST:
        args = device_check.stage_args(stage, norm, str(tmp_path))
        for module, tool in (("benchmarks.run", bench), ("benchmarks.profile", profile)):
            rest = _after_module(args, module)
            if rest is None:
                continue
            parsed, overrides = tool.parser().parse_known_args(rest)
            cfg = bench.resolved_config(overrides, parsed.synthetic)
            assert cfg.model.seq_len == 1024 and cfg.model.d_model == 768, stage.name  # GPT-2 124M
            assert cfg.model.norm == norm, stage.name
            if tool is bench:
                assert bench.row_keys(parsed.rows) and parsed.json == str(tmp_path / f"{stage.name}.json")
            seen.add(stage.name)
    assert seen == {"step", "step_kernels", "step_stream", "step_gelu", "step_head", "step_qkv", "step_fc", "profile",
                    "table", "step_excess", "recipe", "recipe_kernels", "table_recipe", "recipe_micro60"}


def test_the_recipe_stages_train_at_the_configs_own_batch(tmp_path, monkeypatch):
    """recipe, recipe_kernels and table_recipe measure GPT-2 124M as `python -m jaxtrain.run --config
    configs/gpt2-124m.yaml` trains it (the YAML's batch and micro-batches, read here apart from jaxtrain's loader), the
    last two with the four gemm kernels, as recipe_micro60 in half as many micro-batches; `step` and `table` at the
    README table's 128 in 4."""
    monkeypatch.chdir(REPO)
    with open("configs/gpt2-124m.yaml") as f:
        recipe = yaml.safe_load(f)
    by_name = {s.name: s for s in device_check.STAGES + device_check.ON_REQUEST}
    kernels = {"gelu_grad", "head_lse", "qkv_grad", "gelu_fwd"}
    own = (recipe["data"]["batch_size"], recipe["optim"]["grad_accum_steps"])
    expected = {"recipe": (own, set()), "recipe_kernels": (own, kernels), "table_recipe": (own, kernels),
                "recipe_micro60": ((own[0], own[1] // 2), kernels), "step": ((128, 4), set()),
                "table": ((128, 4), set())}
    for name, (batch, pallas) in expected.items():
        args = device_check.stage_args(by_name[name], "auto", str(tmp_path))
        parsed, overrides = bench.parser().parse_known_args(args[2:])
        cfg = bench.resolved_config(overrides, parsed.synthetic)
        assert (cfg.data.batch_size, cfg.optim.grad_accum_steps) == batch, name
        assert {k for k in kernels if getattr(cfg.model, k) == "pallas"} == pallas, name
    assert by_name["recipe"] in device_check.STAGES and by_name["recipe_kernels"] in device_check.STAGES


@pytest.mark.skipif(jax.default_backend() != "gpu" and not hopper_gemm.interpreter_available(),
                    reason="no GPU, and no Mosaic GPU interpreter in this jax that runs the kernels")
@pytest.mark.parametrize("kernel,tests,test_file,module,option,small", [
    ("gelu", "gelu", "tests/test_gelu_gemm.py", "benchmarks.gelu_gemm", "--model.gelu_grad=pallas",
     ["--rows", "128", "--d", "64", "--tiles", "64x64x2x8"]),
    ("head", "head", "tests/test_head_lse.py", "benchmarks.head_lse", "--model.head_lse=pallas",
     ["--rows", "128", "--d", "64", "--vocab", "768", "--tiles", "128x192x2x8"]),
    ("qkv", "qkv", "tests/test_qkv_grad.py", "benchmarks.qkv_grad", "--model.qkv_grad=pallas",
     ["--rows", "128", "--d", "128", "--tiles", "128x64x2x8x32"]),
    ("fc", "gelu", "tests/test_gelu_gemm.py", "benchmarks.gelu_fwd", "--model.gelu_fwd=pallas",
     ["--rows", "128", "--d", "64", "--tiles", "128x64x2x8"])])
def test_a_gemm_kernels_stages_run_its_tests_its_benchmark_and_the_step_with_it(kernel, tests, test_file, module,
                                                                                option, small, tmp_path):
    """<tests>_tests collects every test of its file (c_fc's kernel's are in gelu_gemm's: one module, two
    kernels); <kernel>_ab runs (here on a few rows, through the interpreter) and prints a row per setting, each as
    right as XLA's result; step_<kernel> (on request) is `step` with the kernel on, step_kernels `step` with all
    four."""
    by_name = {s.name: s for s in device_check.STAGES + device_check.ON_REQUEST}
    args = _after_module(list(by_name[f"{tests}_tests"].args), "pytest")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "--collect-only", "-q", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert args[-1] == test_file and "-k" not in args  # the whole file
    assert proc.returncode == 0 and proc.stdout.startswith(f"{test_file}: "), proc.stdout[-2000:]
    assert by_name[f"{kernel}_ab"].args == ("-m", module)
    proc = subprocess.run([sys.executable, *by_name[f"{kernel}_ab"].args, *small, "--iters", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| kernel ")]
    rows = [line.split(" | ") for line in lines]
    tiles = small[-1].split(",")
    names = [(t.split("x")[:2], t.split("x")[4:]) for t in tiles]  # m x n, and k where given
    assert [r[0] for r in rows] == [f"| kernel {m}x{n}{f', k {k[0]}' if k else ''}, 2 stages, snake 8"
                                    for (m, n), k in names]
    assert all(float(r[3]) > 99 for r in rows)  # elements equal to XLA's: sum orders alone differ
    assert all(r[4].rstrip(" |") == "0" and line.endswith(" 0 |") for r, line in zip(rows, lines))  # none further
    assert by_name[f"step_{kernel}"].args == by_name["step"].args + (option,)
    assert by_name["step_kernels"].args == by_name["step"].args + (
        "--model.gelu_grad=pallas", "--model.head_lse=pallas", "--model.qkv_grad=pallas", "--model.gelu_fwd=pallas")
    assert by_name[f"{tests}_tests"] in device_check.STAGES  # gelu_ab in STAGES too, the other three on request
    assert by_name[f"{kernel}_ab"] in (device_check.STAGES if kernel == "gelu" else device_check.ON_REQUEST)


def test_the_ab_stages_differ_in_their_xla_flags_alone(tmp_path):
    step, excess = (next(s for s in device_check.STAGES + device_check.ON_REQUEST if s.name == n)
                    for n in ("step", "step_excess"))
    assert step.args == excess.args and step.env == ()
    assert excess.env == (("XLA_FLAGS", "--xla_allow_excess_precision=true"),)


def test_the_kernels_stage_selects_the_norm_tests_but_the_mesh_one():
    """One GPU has no (2, 2) mesh: the mesh test is left out, every other test of the file is run. The device image
    has no pytest-xdist (`-p no:xdist` here), so the stage must not take pyproject's `-n auto`."""
    stage = next(s for s in device_check.STAGES if s.name == "kernels")
    args = _after_module(list(stage.args), "pytest")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "--collect-only", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    everything = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_fused_norm.py"],
                                cwd=REPO, capture_output=True, text=True, timeout=300).stdout
    assert collected and not any("mesh" in line for line in collected)
    assert len(collected) == sum("::" in line and "mesh" not in line for line in everything.splitlines())


def test_the_model_tests_stages_select_the_bit_for_bit_tests():
    """The tests that failed on an H100 (test_mlp_uses_exact_gelu, test_linear_bf16_is_torchs' four cases) and the
    written-out attention's bit-for-bit test (its two roundings are what excess precision may drop), cuDNN's
    attention against the written-out one, the q, k, v gemms' tests and the loss's logsumexp (a GPU reduces it in a
    tree of its own); nothing else of test_model.py, test_autocast.py and test_loss.py, which take minutes there."""
    stages = [s for s in device_check.STAGES if s.name.startswith("model_tests")]
    assert [s.env for s in stages] == [()]
    args = _after_module(list(stages[0].args), "pytest")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "--collect-only", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    collected = sorted(line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line)
    blocks = [f"test_column_blocks_are_the_linear_split_and_take_its_gradient[{platform}-{precision}-{bias}]"
              for platform in ("cpu", "gpu") for precision in ("bf16", "fp32") for bias in (False, True)]
    torch_bits = [f"test_linear_bf16_is_torchs[{platform}-{bias}]" for platform in ("cpu", "gpu")
                  for bias in (False, True)]
    lse = [f"test_logsumexp_is_float64s_within_its_chains_rounding[{v}-{chain}]"
           for v, chain in ((50304, 850), (4096, 1028), (256, 257), (2053, 2053))]
    lse += ["test_logsumexp_reads_the_logits_once_in_chains_of_at_most_1024", "test_logsumexp_of_minus_infinity"]
    attention = [f"test_written_out_attention_bf16_is_torchs[{platform}-{head_size}]" for platform in ("cpu", "gpu")
                 for head_size in (16, 32, 64)]
    singles = ["test_cudnn_attention_matches_the_written_out_one", "test_mlp_uses_exact_gelu",
               "test_remat_dots_keeps_the_column_blocks"]
    assert collected == sorted(blocks + torch_bits + attention + lse + singles)


def test_a_stages_env_reaches_its_process_and_its_log_line(tmp_path):
    code = "import os; print('got', os.environ['XLA_FLAGS'])"
    stage = device_check.Stage("flagged", "a stage with env", ("-c", code), 0, 30, env=(("XLA_FLAGS", "--xla_x=1"),))
    results = device_check.run_stages([stage], str(tmp_path), budget_s=60)
    log = (tmp_path / "session.log").read_text()
    assert results[0]["outcome"] == "passed" and "got --xla_x=1" in log
    assert "===== flagged: XLA_FLAGS=--xla_x=1 python -c import os;" in log


def test_the_env_stage_runs_and_names_the_versions():
    stage = next(s for s in device_check.STAGES if s.name == "env")
    proc = subprocess.run([sys.executable, *stage.args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "jax 0." in proc.stdout and "devices: [CpuDevice(id=0)]" in proc.stdout


def test_the_logsumexp_stage_times_both_reductions():
    """Run here on a small array (on a CPU both are jax.nn.logsumexp's: loss.logsumexp's one read is the GPU's)."""
    stage = next(s for s in device_check.ON_REQUEST if s.name == "lse_ab")
    assert stage.args[2:] == ("16384", "50304")  # GPT-2 124M's micro-batch of 16 x 1024 tokens, its vocabulary
    proc = subprocess.run([sys.executable, *stage.args[:2], "64", "1000"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["one read (loss.logsumexp)", "two reads (jax.nn.logsumexp)"]
    for line in lines:  # GB/s: 64 x 1000 bf16 logits (128,000 bytes) over the line's milliseconds
        ms, gb_s = (float(word) for word in re.findall(r"([\d.]+) (?:ms|GB/s)", line))
        # both printed rounded: GB/s to 0.05, ms to 0.0005, which moves 0.128 / ms by up to 0.128 * 0.0005 / ms^2
        bound = 0.05 + 0.128 * 0.0005 / (ms - 0.0005) ** 2
        assert line.endswith("GB/s of one read of the logits") and gb_s == pytest.approx(0.128 / ms, abs=bound)


def _stage(name, code, expect_s=0, cap_s=30, **kw):
    return device_check.Stage(name, f"{name} stage", ("-c", code, "--model.norm={norm}"), expect_s, cap_s, **kw)


def test_a_stage_past_its_cap_is_stopped_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    results = device_check.run_stages([_stage("slow", code, cap_s=3), _stage("next", "print('next ran')")],
                                      str(tmp_path), budget_s=60)
    assert time.monotonic() - t0 < 30  # 3 s of cap, not 60 s of sleep (the bound: process start-up on 2 busy cores)
    assert results[0]["outcome"] == "stopped at its cap of 3s" and results[1]["outcome"] == "passed"
    assert processes.ended_within(int(pid_file.read_text()))
    log = (tmp_path / "session.log").read_text()
    assert "started" in log and "next ran" in log and "===== slow: stopped at its cap of 3s" in log


def test_the_budget_starts_no_stage_it_cannot_cover(tmp_path):
    stages = [_stage("first", "import time; time.sleep(2)", expect_s=1),
              _stage("big", "print('big ran')", expect_s=100),
              _stage("small", "print('small ran')", expect_s=1)]
    results = device_check.run_stages(stages, str(tmp_path), budget_s=20)
    outcomes = [r["outcome"] for r in results]
    assert outcomes[0] == "passed" and outcomes[2] == "passed"
    assert outcomes[1].startswith("not run: ") and outcomes[1].endswith("s of the budget left")
    assert "big ran" not in (tmp_path / "session.log").read_text()


def test_a_stage_is_stopped_where_the_budget_ends_before_its_cap(tmp_path):
    results = device_check.run_stages([_stage("long", "import time; time.sleep(60)", cap_s=60)], str(tmp_path),
                                      budget_s=3)
    assert results[0]["outcome"] == "stopped where the budget ended, after 3s" and results[0]["seconds"] < 30


def test_a_sigterm_to_the_runner_stops_its_stage_and_keeps_the_summary_of_what_ran(tmp_path):
    """The device tool ends a command at its limit: the stage running then is stopped with what it started (it
    would hold the GPU past the runner), no other starts, and summary.md holds the stages before it."""
    previous = signal.signal(signal.SIGTERM, device_check._terminate)
    pid_file = tmp_path / "stage.pid"
    try:
        results = device_check.run_stages(
            [_stage("first", "print('first ran')"),
             _stage("cut", f"import os, signal, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                           f"os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)"),
             _stage("after", "print('after ran')")], str(tmp_path), budget_s=60)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [r["outcome"] for r in results] == ["passed", "stopped: the runner was sent SIGTERM",
                                               "not run: the runner was sent SIGTERM"]
    assert processes.ended_within(int(pid_file.read_text()))
    summary = (tmp_path / "summary.md").read_text()  # written after each stage, as a killed runner leaves it
    assert "| first | passed |" in summary and "first ran" in summary


def test_a_kernels_stages_are_not_run_where_its_tests_failed_in_the_same_call(tmp_path):
    """No figure of a kernel whose tests failed: its stages say why they did not run; a stage needing tests this
    call did not run (a rerun of some stages) runs."""
    stages = [_stage("head_tests", "raise SystemExit(1)"), _stage("qkv_tests", "pass"),
              _stage("step_head", "print('head measured')", needs=("head_tests",)),
              _stage("step_qkv", "print('qkv measured')", needs=("qkv_tests",)),
              _stage("step_gelu", "print('gelu measured')", needs=("gelu_tests",))]
    results = device_check.run_stages(stages, str(tmp_path), budget_s=60)
    assert [r["outcome"] for r in results] == ["failed (exit 1)", "passed", "not run: head_tests did not pass",
                                               "passed", "passed"]
    assert "head measured" not in (tmp_path / "session.log").read_text()


def test_every_stage_measuring_a_gemm_kernel_needs_that_kernels_tests():
    for stage in device_check.STAGES + device_check.ON_REQUEST:
        kernels = [k for k, flag in device_check.KERNEL_OPTIONS.items() if flag in stage.args]
        wanted = {"gelu": "gelu_tests", "fc": "gelu_tests", "head": "head_tests", "qkv": "qkv_tests"}
        assert {wanted[k] for k in kernels} <= set(stage.needs), stage.name


@pytest.mark.parametrize("kernels_exit,norm", [(0, "auto"), (1, "xla")])
def test_failed_kernel_tests_measure_the_table_with_xlas_norm(tmp_path, kernels_exit, norm):
    stages = [_stage("kernels", f"raise SystemExit({kernels_exit})"),
              _stage("table", "import sys; print('table got', *sys.argv[1:])")]
    device_check.run_stages(stages, str(tmp_path), budget_s=60)
    assert f"table got --model.norm={norm}" in (tmp_path / "session.log").read_text()


def test_a_required_stage_that_fails_stops_the_rest_and_the_summary_says_so(tmp_path):
    stages = [_stage("env", "import sys; print('no jax here'); sys.exit(3)", required=True),
              _stage("table", "print('table ran')", json=True)]
    results = device_check.run_stages(stages, str(tmp_path), budget_s=60)
    summary = device_check.write_summary(results, str(tmp_path))
    assert [r["outcome"] for r in results] == ["failed (exit 3)", "not run: env failed"]
    assert "| env | failed (exit 3) |" in summary and "| table | not run: env failed | 0 |" in summary
    assert "no jax here" in summary  # a failed stage's last lines
    assert (tmp_path / "summary.md").read_text() == summary


def test_the_summary_holds_each_stages_own_output_and_the_json_path(tmp_path):
    stages = [_stage("a", "print('| row a |'); print('caf\\u00e9')"), _stage("b", "import sys; print(sys.argv[-2:])",
                                                                          json=True)]
    summary = device_check.write_summary(device_check.run_stages(stages, str(tmp_path), 60), str(tmp_path))
    section_a = summary.split("## a: ")[1].split("## b: ")[0]
    assert "| row a |" in section_a and "café" in section_a and "--json" not in section_a
    assert repr(["--json", str(tmp_path / "b.json")]) in summary.split("## b: ")[1]


def test_list_names_every_stage_within_the_tool_call():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--list"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert [line.split()[0] for line in proc.stdout.splitlines()] == [
        s.name for s in device_check.STAGES + device_check.ON_REQUEST]
    assert all("--stages only" in line for line in proc.stdout.splitlines()[len(device_check.STAGES):])
    assert sum(s.expect_s for s in device_check.STAGES) <= device_check.BUDGET_S  # the default budget runs them all


def test_an_out_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--out", str(tmp_path / "file" / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "choose another folder" in proc.stderr


def test_stages_runs_the_named_stages_in_their_order_and_refuses_an_unknown_one(tmp_path):
    """--stages step,env: the two, in that order (what a lease's last minutes rerun); a name no stage has is one
    line naming it and the stages, exit 2, nothing run."""
    assert [s.name for s in device_check.chosen_stages("step,env")] == ["step", "env"]
    assert device_check.chosen_stages(None) == device_check.STAGES
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--out", str(tmp_path), "--stages",
                           "step,stpe"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --stages: no stage stpe; the stages are env,")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "session.log").exists()
