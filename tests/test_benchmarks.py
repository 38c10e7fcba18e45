"""benchmarks/run.py: the table's arithmetic on hand-made rows, and one short run end to end; every benchmark tool's
user errors in one line."""

import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from design_formulas import FP64
from benchmarks import run as bench
from jaxtrain import config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16", "--data.batch_size=8",
        "--optim.grad_accum_steps=2", "--model.vocab_size=64"]


def _row(key, times, precision="bf16"):
    return {"key": key, "name": key, "precision": precision, "times": times, "first_step_s": 1.0,
            "peak_memory": 2e9, "cfg": config.load([])}


def test_table_rates_and_ratios():
    cfg = config.load(TINY)  # 8 x 16 = 128 tokens per step; the matmul is (4*16) x 32 @ 32 x 128
    rows = [_row("jax-bf16", [0.5, 1.0, 2.0]), _row("torch-bf16", [0.25, 0.25]), _row("compile-bf16", [2.0]),
            _row("jax-bf16-k1", [1.0]), _row("jax-bf16-k4", [1.25]), _row("matmul-jax-bf16", [2 * 64 * 32 * 128 / 1e6])]
    text = bench.table(rows, cfg, n_params=10_000, peak=None)
    assert rows[0]["median"] == 128 / 1.0 and rows[0]["low"] == 64 and rows[0]["high"] == 256
    assert rows[5]["median"] == pytest.approx(1e6, rel=FP64)  # FLOP/s of the matmul row: 2mkn / seconds
    assert "jaxtrain bf16 / best torch bf16: 0.25" in text  # 128 tokens/s against torch eager's 512
    assert "accumulation k=4 costs 20.0% of k=1's tokens/s" in text
    assert "| torch-bf16 | 512 (512-512) | 250.0 |" in text and "| 0.25 |" in text  # jaxtrain / this


def test_failed_row_is_reported_not_fatal():
    rows = [_row("jax-bf16", [1.0]), {**_row("torch-bf16", []), "error": "OutOfMemoryError: CUDA out of memory"}]
    text = bench.table(rows, config.load(TINY), n_params=10_000, peak=None)
    assert "| torch-bf16 | failed: OutOfMemoryError: CUDA out of memory |" in text


def test_a_row_that_fails_after_its_warm_up_is_reported_and_the_others_measured(monkeypatch):
    """A row whose process fails in its second round (memory a later step needs) or dies: it was a RuntimeError
    traceback, and every other row's figures and the JSON were lost. Now the row says so and the others run on."""
    class Process:
        def __init__(self, row, synthetic):
            self.warmup, self.calls = {"first_step_s": 1.0, "warmup_s": 2.0}, 0
            self.fails = {"jaxtrain bf16": {"error": "XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory"},
                          "torchref eager bf16": {"error": "its process died (exit -9); its output above says why"}
                          }.get(row.name)

        def times(self, n):
            self.calls += 1
            return self.fails if self.fails and self.calls == 2 else [0.5] * n

        def peak_memory(self):
            return 10**9

        def close(self):
            pass

    monkeypatch.setattr(bench.workers, "Worker", Process)
    args = bench.parser().parse_args(["--rows", "jax-bf16,torch-bf16,jax-fp32", "--rounds", "3", "--steps", "2"])
    rows = bench.measure(config.load(TINY), ["jax-bf16", "torch-bf16", "jax-fp32"], args, lambda rows: None)
    rows = {r["key"]: r for r in rows}
    assert rows["jax-bf16"]["error"] == "times: XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert rows["torch-bf16"]["error"] == "times: its process died (exit -9); its output above says why"
    assert rows["jax-bf16"]["times"] == rows["torch-bf16"]["times"] == [] and rows["jax-bf16"]["peak_memory"] is None
    assert rows["jax-fp32"]["times"] == [0.5] * 6 and "error" not in rows["jax-fp32"]
    text = bench.table(list(rows.values()), config.load(TINY), n_params=10_000, peak=None)
    assert "| jaxtrain bf16 | failed: times: XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory |" in text


def test_a_row_whose_memory_cannot_be_read_keeps_its_times_and_an_error_holding_a_bar_stays_in_its_cell(
        monkeypatch, capsys):
    """A failed peak-memory request made the row a failure with no times, after all its rounds were measured; an
    error text holding '|' (a shell's pipe in a message) split its table row into more cells."""
    class Process:
        def __init__(self, row, synthetic):
            self.warmup, self.name = {"first_step_s": 1.0}, row.name

        def times(self, n):
            return [0.5] * n if self.name == "jaxtrain bf16" else {"error": "RuntimeError: a | b"}

        def peak_memory(self):
            return {"error": "RuntimeError: memory_stats() is None"}

        def close(self):
            pass

    monkeypatch.setattr(bench.workers, "Worker", Process)
    args = bench.parser().parse_args(["--rounds", "2", "--steps", "3"])
    rows = bench.measure(config.load(TINY), ["jax-bf16", "jax-fp32"], args, lambda rows: None)
    assert rows[0]["times"] == [0.5] * 6 and "error" not in rows[0] and rows[0]["peak_memory"] is None
    assert "  jaxtrain bf16: no peak memory (RuntimeError: memory_stats() is None)" in capsys.readouterr().out
    text = bench.table(rows, config.load(TINY), n_params=10_000, peak=None)
    row_line = next(line for line in text.splitlines() if line.startswith("| jaxtrain bf16 |"))
    assert row_line.startswith("| jaxtrain bf16 | 256 (256-256) | 500.0 |") and "| n/a |" in row_line
    failed = next(line for line in text.splitlines() if line.startswith("| jaxtrain fp32 |"))
    assert failed == "| jaxtrain fp32 | failed: times: RuntimeError: a \\| b | | | | | | |"
    assert len(failed.replace("\\|", "").split("|")) == len(row_line.split("|"))  # as many cells


def test_one_row_at_a_time_writes_each_row_once_it_is_measured(tmp_path, monkeypatch, capsys):
    """--one-at-a-time: each row's times are printed and in --json's file as soon as its process ends, so a run
    killed during a later row (a GPU session's limit) keeps them; before, nothing was printed or written until the
    last row and the save's cost were done."""
    class Process:
        def __init__(self, row, synthetic):
            self.warmup, self.seconds = {"first_step_s": 1.0}, {"jaxtrain bf16": 0.5, "jaxtrain fp32": 0.25}[row.name]

        def times(self, n):
            return [self.seconds] * n

        def peak_memory(self):
            return 10**9

        def close(self):
            pass

    monkeypatch.setattr(bench.workers, "Worker", Process)
    out, seen = tmp_path / "rows.json", []
    args = bench.parser().parse_args(["--one-at-a-time", "--rounds", "2", "--steps", "3"])

    def measured(rows):
        bench.write_json(str(out), {"device": "cpu", "rows": rows})
        seen.append({r["key"]: r["times"] for r in json.loads(out.read_text())["rows"]})

    bench.measure(config.load(TINY), ["jax-bf16", "jax-fp32"], args, measured)
    assert seen == [{"jax-bf16": [0.5] * 6, "jax-fp32": []}, {"jax-bf16": [0.5] * 6, "jax-fp32": [0.25] * 6}]
    lines = [line for line in capsys.readouterr().out.splitlines() if "measured" in line]
    assert lines == ["  measured jaxtrain bf16: median 500.0 ms of 6 steps",
                     "  measured jaxtrain fp32: median 250.0 ms of 6 steps"]


def test_a_row_whose_process_dies_answers_with_the_error():
    """The parent's side of a row process killed mid-run (the kernel's OOM killer): an error to report, not an
    exception that ends the benchmark."""
    from benchmarks import workers

    worker = workers.Worker(workers.Row("jax", "jaxtrain", config.load([*TINY, "--model.vocab_size=256"]), ()),
                            synthetic=True)
    assert "error" not in worker.warmup, worker.warmup
    os.kill(worker._process.pid, signal.SIGKILL)
    worker._process.join(timeout=60)
    assert worker.times(1) == {"error": "its process died (exit -9); its output above says why"}
    worker.close()


def test_one_short_run(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *TINY, "--synthetic", "--rounds", "2", "--steps", "1",
         "--rows", "jax-bf16,torch-bf16,matmul-jax-bf16", "--only", "throughput", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["key"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"jax-bf16", "torch-bf16", "matmul-jax-bf16"}
    assert all(len(r["times"]) == 2 and r["median"] > 0 and "error" not in r for r in rows.values())
    assert rows["jax-bf16"]["peak_memory"] > 0  # the row's own process's peak RSS
    assert "jaxtrain bf16 / best torch bf16:" in proc.stdout


def test_profile_puts_each_hlo_op_in_its_category():
    """A hand-written optimized module: a YNNPACK fusion holding a dot (and an add) is a matmul, one holding only an
    add is elementwise; a transpose-and-convert fusion is data movement; a fusion with a reduce is a reduction; the
    loop, a cuDNN attention call, a cuBLAS gemm and an all-reduce are what they are; jaxtrain's own kernels by their
    names."""
    from benchmarks.profile import hlo_categories
    hlo = """HloModule m

%fused_dot (p0: bf16[8,4], p1: bf16[4,2]) -> f32[8,2] {
  %param_0 = bf16[8,4]{1,0} parameter(0)
  %param_1 = bf16[4,2]{1,0} parameter(1)
  %dot.1 = f32[8,2]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %add.1 = f32[8,2]{1,0} add(%dot.1, %dot.1)
}

%fused_add (p0: f32[8,2]) -> f32[8,2] {
  %param_0.1 = f32[8,2]{1,0} parameter(0)
  ROOT %add.2 = f32[8,2]{1,0} add(%param_0.1, %param_0.1)
}

%fused_copy (p0: f32[8,2]) -> bf16[2,8] {
  %param_0.2 = f32[8,2]{1,0} parameter(0)
  %transpose.1 = f32[2,8]{1,0} transpose(%param_0.2), dimensions={1,0}
  ROOT %convert.1 = bf16[2,8]{1,0} convert(%transpose.1)
}

%fused_sum (p0: f32[8,2], p1: f32[]) -> f32[2] {
  %param_0.3 = f32[8,2]{1,0} parameter(0)
  %param_1.3 = f32[] parameter(1)
  ROOT %reduce.1 = f32[2]{0} reduce(%param_0.3, %param_1.3), dimensions={0}, to_apply=%region
}

%sliced_gemm (p0: bf16[8,4], p1: bf16[8,2]) -> bf16[8,2] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[8,2]{1,0} parameter(1)
  %s0 = bf16[4,2]{1,0} slice(%p1), slice={[0:4], [0:2]}
  ROOT %k = bf16[8,2]{1,0} custom-call(%p0, %s0), custom_call_target="mosaic_gpu_v2", \
metadata={op_name="jit(train_step)/transpose(jvp())/hopper_gemm_pairs3/gemm_qkv_grad/mpmd_map"}
}

ENTRY %main (a: bf16[8,4], b: bf16[4,2]) -> f32[2] {
  %a = bf16[8,4]{1,0} parameter(0)
  %b = bf16[4,2]{1,0} parameter(1)
  %ynn_fusion.3 = f32[8,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %ynn_fusion.4 = f32[8,2]{1,0} fusion(%ynn_fusion.3), kind=kCustom, calls=%fused_add
  %transpose_copy_fusion = bf16[2,8]{1,0} fusion(%ynn_fusion.4), kind=kLoop, calls=%fused_copy
  %while.2 = (s32[], f32[8,2]{1,0}) while(%t), condition=%cond, body=%body
  %custom-call.7 = (bf16[8,2]{1,0}, u8[0]{0}) custom-call(%a, %b), custom_call_target="__cudnn$fmhaSoftmax"
  %custom-call.8 = (f32[8,2]{1,0}, s8[64]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
  %all-reduce.1 = f32[8,2]{1,0} all-reduce(%ynn_fusion.4), replica_groups={}, to_apply=%region
  %pallas_call.0 = (bf16[8,2]{1,0}, f32[8]{0}) custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", \
metadata={op_name="jit(train_step)/jvp()/pallas_call"}, backend_config={grid_x = 1 : i32, name = "_norm_forward_kernel"}
  %mpmd_map.3 = bf16[8,2]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", \
metadata={op_name="jit(train_step)/transpose(jvp())/hopper_gemm/gemm_gelu_grad/mpmd_map"}
  %mpmd_map.5 = bf16[8,2]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", \
metadata={op_name="jit(train_step)/jvp()/another/mpmd_map"}
  %dynamic-slice-fusion.2 = bf16[8,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%sliced_gemm
  ROOT %reduce_fusion = f32[2]{0} fusion(%ynn_fusion.4, %c), kind=kLoop, calls=%fused_sum
}
"""
    categories = hlo_categories(hlo)
    assert {name: categories[name] for name in ("ynn_fusion.3", "ynn_fusion.4", "transpose_copy_fusion", "while.2",
                                                "custom-call.7", "reduce_fusion", "custom-call.8", "all-reduce.1")} == {
        "ynn_fusion.3": "matmul", "ynn_fusion.4": "elementwise", "transpose_copy_fusion": "copy/transpose",
        "while.2": "other", "custom-call.7": "attention", "reduce_fusion": "reduction",
        "custom-call.8": "matmul", "all-reduce.1": "collective"}
    # jaxtrain's kernels: fused_norm's (a Triton custom call named for it), hopper_gemm's (a Mosaic GPU call in its
    # name scope, also inside a fusion with its operand's slices); another Mosaic GPU call is none of them
    assert {name: categories[name] for name in ("pallas_call.0", "mpmd_map.3", "dynamic-slice-fusion.2",
                                                "mpmd_map.5")} == {
        "pallas_call.0": "norm kernels", "mpmd_map.3": "matmul", "dynamic-slice-fusion.2": "matmul",
        "mpmd_map.5": "other"}


def test_profile_puts_each_gpu_kernel_name_in_its_category():
    """Kernel names from the H100 profiles (benchmarks/results/h100-2026-11-28.md), and jaxtrain's own kernels' as a
    GPU names them: Triton names a kernel for its function (fused_norm's "_forward_kernel__1" on 2026-11-28, now
    named for the norm), Mosaic GPU for kernel_name with "_mosaic_gpu_kernel" (ptxas's report)."""
    from benchmarks.profile import category
    from jaxtrain import fused_norm, hopper_gemm
    names = {"nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN": "matmul",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1": "attention",
             "loop_convert_fusion_12": "loop/elementwise fusion", "input_reduce_fusion_3": "reduction",
             f"{fused_norm._norm_forward_kernel.__name__}__1": "norm kernels",
             fused_norm._norm_backward_kernel.__name__: "norm kernels",
             f"{hopper_gemm.kernel_name('model.head_lse=pallas')}_mosaic_gpu_kernel": "matmul"}
    assert {name: category(name) for name in names} == names


@pytest.mark.parametrize("tool,own_flag", [("run", "--rounds"), ("profile", "--steps"), ("roofline", "--top"),
                                           ("xla_flags", "--target")])
def test_help_names_the_config_and_its_overrides(capsys, tool, own_flag):
    """--config and --section.key=value go on to config.load, unseen by argparse: each tool's help says so in its
    epilog."""
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{tool}").main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "  --config FILE.yaml " in out and "  --section.key=VALUE " in out
    assert own_flag in out  # argparse's own flags, as before


@pytest.mark.parametrize("tool,flags,message", [
    ("run", ["--model.n_layerz=1"], "unknown config key 'model.n_layerz'; did you mean model.n_layer?"),
    ("profile", ["--model.n_layerz=1"], "unknown config key 'model.n_layerz'; did you mean model.n_layer?"),
    ("roofline", ["--model.n_layerz=1"], "unknown config key 'model.n_layerz'; did you mean model.n_layer?"),
    ("xla_flags", ["--target", "cpu", "--model.n_layerz=1"], "unknown config key 'model.n_layerz'"),
    ("run", ["--synthetic", "--model.vocab_size=null"], "--synthetic needs model.vocab_size"),
    ("run", ["--rows", "jax-bf16,nope"], "unknown --rows ['nope']; choose from jax-bf16,"),
    ("run", ["--rows", ","], "--rows=',' names no row; give one or more, comma-separated, of jax-bf16,"),
    ("run", ["--synthetic", "--model.vocab_size=256", "--only", "throughput", "--rows", "jax-bf16-k4",
             "--data.batch_size=6"],
     "jaxtrain bf16, k=4: data.batch_size=6 is not divisible by optim.grad_accum_steps=4"),
    ("run", ["--only", "save", "--rows", "jax-bf16"],
     "--rows is for the throughput rows, which --only save does not run; drop it, or drop --only save"),
    ("run", ["--only", "save", "--peak-tflops", "989"], "--peak-tflops is for the throughput rows")])
def test_user_errors_are_one_line_exit_2(tool, flags, message):
    """A config or flag the user can fix ends each tool in jaxtrain's one line, exit code 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{tool}", "--config", "configs/tiny.yaml", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr[-2000:]


def test_rates_are_work_over_the_median_time():
    """With an even number of steps the median of per-step rates is not the rate of the median step: tokens/s, its
    min-max, the step ms and MFU all come from the step times (128 tokens a step, steps of 1 s and 3 s)."""
    rows = [_row("jax-bf16", [1.0, 3.0]), _row("matmul-jax-bf16", [1.0, 4.0])]
    bench.table(rows, config.load(TINY), n_params=10_000, peak=1e6)
    jax_row, matmul_row = rows
    assert (jax_row["median"], jax_row["low"], jax_row["high"], jax_row["step_ms"]) == (64, 128 / 3, 128, 2000)
    flops = 2 * 64 * 32 * 128  # the matmul's 2mkn
    assert (matmul_row["median"], matmul_row["low"], matmul_row["high"]) == (flops / 2.5, flops / 4, flops)
    flops_per_token = 6 * (10_000 - 16 * 32) + 12 * 1 * 32 * 16  # nanoGPT's: 6N (wpe not in N) + 12 L d T
    assert jax_row["mfu_peak"] == pytest.approx(64 * flops_per_token / 1e6, rel=FP64)
    assert jax_row["mfu_ceiling"] == pytest.approx(64 * flops_per_token / (flops / 2.5), rel=FP64)


def test_row_configs_are_validated_before_any_process_starts(monkeypatch):
    """The k=4 row sets optim.grad_accum_steps=4, which 6 sequences do not divide: the trainer's own check says so,
    naming the row, before a row's process starts (it used to run, and fail into the table as a row)."""
    def no_process(row, synthetic):
        raise AssertionError(f"row {row.name!r}'s process started before every row's config was checked")

    monkeypatch.setattr(bench.workers, "Worker", no_process)
    args = bench.parser().parse_args(["--rows", "jax-bf16,jax-bf16-k4"])
    with pytest.raises(bench.UserError, match=r"^jaxtrain bf16, k=4: data.batch_size=6 is not divisible by "
                                              r"optim.grad_accum_steps=4; "):
        bench.measure(config.load([*TINY, "--data.batch_size=6"]), ["jax-bf16", "jax-bf16-k4"], args, print)


def test_json_carries_the_save_table(tmp_path, monkeypatch, capsys):
    """--only save --json: the JSON holds the save table's figures, the numbers the printed table shows. Hand-made
    pair times: a plain step of 2.0 s (median of 1, 3, 2, 2); async saves held the loop 0.1 and 0.3 s and cost 0.5
    and 0.7 s; sync saves 0.5 and 0.7 s, costing 1.0 and 0.8 s."""
    from benchmarks import save_cost
    times = {"async (checkpoint.async_save=true)": [{"plain": 1.0, "held": 0.1, "saved": 1.5},
                                                    {"plain": 3.0, "held": 0.3, "saved": 3.7}],
             "sync (checkpoint.async_save=false)": [{"plain": 2.0, "held": 0.5, "saved": 3.0},
                                                    {"plain": 2.0, "held": 0.7, "saved": 2.8}]}
    monkeypatch.setattr(save_cost, "measure", lambda cfg, train_step, state, window, pairs: times)
    out = tmp_path / "save.json"
    bench.main([*TINY, "--synthetic", "--only", "save", "--rounds", "1", "--steps", "4", "--json", str(out)])
    saves = json.loads(out.read_text())["save"]
    assert saves["step_ms"] == pytest.approx(2000, rel=FP64) and saves["pairs"] == 2
    expected = [["async (checkpoint.async_save=true)", 200, 600, 0.30],
                ["sync (checkpoint.async_save=false)", 600, 900, 0.45]]
    assert [[r["save"], r["loop_waits_ms"], r["costs_ms"], r["of_step"]] for r in saves["rows"]] == [
        [name, pytest.approx(held, rel=FP64), pytest.approx(cost, rel=FP64), pytest.approx(share, rel=FP64)]
        for name, held, cost, share in expected]
    printed = [[cell.strip() for cell in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
               if line.startswith(("| async", "| sync"))]
    assert printed == [["async (checkpoint.async_save=true)", "200.0", "600.0", "30.0%"],
                       ["sync (checkpoint.async_save=false)", "600.0", "900.0", "45.0%"]]


def test_python_m_save_cost_says_which_command_measures(capsys):
    """`python -m benchmarks.save_cost` (the module's name, a likely guess) did nothing and exited 0."""
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(REPO, "benchmarks", "save_cost.py"), run_name="__main__")
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1
    assert lines[0].startswith("error: ") and "`python -m benchmarks.run --config CONFIG --only save" in lines[0]


def test_profile_counts_the_time_threads_spend_in_ops_at_once():
    """benchmarks.profile's sweep over the CPU's thread timelines against intervals counted by hand: two threads'
    ops overlapping, an op nested in another (the inner one is what runs while it runs), and a gap where neither
    thread is in an op; then its line, the nanoseconds in ms a step and the ops alone by category."""
    from benchmarks import profile
    ms = 1_000_000  # ns
    thread_1 = [(0, 10 * ms, "dot.1"), (2 * ms, 4 * ms, "copy.1"), (30 * ms, 40 * ms, "reduce.1")]
    thread_2 = [(5 * ms, 15 * ms, "fusion.7")]
    by_count, alone = profile.concurrency([thread_1, thread_2])
    # 0-5: thread 1 alone (dot 0-2 and 4-5, copy 2-4); 5-10 both; 10-15 thread 2 alone; 15-30 neither; 30-40 thread 1
    assert dict(by_count) == {0: 15 * ms, 1: 20 * ms, 2: 5 * ms}
    assert dict(alone) == {"dot.1": 3 * ms, "copy.1": 2 * ms, "fusion.7": 5 * ms, "reduce.1": 10 * ms}
    line = profile.concurrency_line([thread_1, thread_2], {"fusion.7": "elementwise"}, steps=2)
    assert line.splitlines()[1:] == ["threads in an op at once, ms per step: 0: 7.5, 1: 10.0, 2: 2.5",
                                     "  one alone: reduction 5.0, elementwise 2.5, matmul 1.5, copy/transpose 1.0"]


def test_profile_puts_each_instructions_kernels_beside_its_roofline():
    """On a GPU: the kernels' time a step summed by the HLO instruction each event names (its `hlo_op` stat; events
    without one, such as a memcpy, left out), then set beside benchmarks.roofline's estimate of that instruction in
    the checked-in H100 module (tests/test_roofline.py's): custom-call.15, c_attn's cuBLAS gemm, (64 x 64) @
    (64 x 192) bf16 to f32, twice a step (its micro-batch loop), against FLOPs and bytes counted here by hand."""
    import types
    from benchmarks import profile
    event = lambda op, us: types.SimpleNamespace(stats=[("hlo_op", op)] if op else [], duration_ns=us * 1000)
    streams = [types.SimpleNamespace(events=[event("custom-call.15", 6), event("custom-call.15", 4),
                                             event(None, 50)]),
               types.SimpleNamespace(events=[event("custom-call.15", 5), event("custom-call.15", 5),
                                             event("fusion.no_such", 3)])]
    ms, kernels = profile.by_instruction(streams, steps=2)
    assert ms == pytest.approx({"custom-call.15": 0.010, "fusion.no_such": 0.0015}, rel=FP64)
    assert kernels == pytest.approx({"custom-call.15": 2, "fusion.no_such": 0.5}, rel=FP64)
    with open(os.path.join(os.path.dirname(__file__), "data", "roofline_tiny_h100.hlo.txt")) as f:
        hlo = f.read()
    target = ("h100", 989e12, 3.35e12)
    gemm, unknown = profile.instruction_rows(ms, kernels, hlo, target, top=5)
    flops = 2 * 64 * 192 * 64 * 2  # two launches a step
    moved = (64 * 64 * 2 + 64 * 192 * 2 + 64 * 192 * 4) * 2
    roof_ms = max(flops / 989e12, moved / 3.35e12) * 1e3
    assert (gemm["op"], gemm["category"], gemm["kernels"]) == ("custom-call.15", "matmul", pytest.approx(2, rel=FP64))
    # the same arithmetic in another order: fp64 rounding apart
    assert gemm["roofline_ms"] == pytest.approx(roof_ms, rel=FP64)
    assert gemm["ratio"] == pytest.approx(0.010 / roof_ms, rel=FP64)
    assert gemm["tflops"] == pytest.approx(flops / 0.010e-3 / 1e12, rel=FP64)
    assert gemm["gbps"] == pytest.approx(moved / 0.010e-3 / 1e9, rel=FP64)
    assert unknown == dict(op="fusion.no_such", category="not in the roofline", kernels=pytest.approx(0.5, rel=FP64),
                           ms=pytest.approx(0.0015, rel=FP64), roofline_ms=None, ratio=None, tflops=None, gbps=None)
    text = profile.against_roofline(ms, kernels, hlo, target, top=5).splitlines()
    assert text[1] == "by HLO instruction, against the roofline (h100: 989 TFLOP/s, 3.35 TB/s):"
    assert text[4].startswith("| custom-call.15 | matmul | 2 | 0.01 | 0.00 | ")
    assert text[5] == "| fusion.no_such | not in the roofline | 0.5 | 0.00 |  |  |  |  |"
    assert "no kernel in the trace names its HLO instruction" in profile.against_roofline(
        *profile.by_instruction([types.SimpleNamespace(events=[event(None, 50)])], 1), hlo, target, top=5)


def test_profile_removes_its_trace_folder(tmp_path, monkeypatch):
    """A profile read its trace from a jaxtrain-profile-* folder it left in the temp folder, one per run."""
    import jax
    import jax.numpy as jnp
    from benchmarks import profile, steps
    double = jax.jit(lambda x: 2 * x)
    monkeypatch.setattr(steps, "jaxtrain", lambda cfg, data: steps.Timed(
        step=lambda: jax.block_until_ready(double(jnp.ones(8))), peak_memory=lambda: 0, program=lambda: ""))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    profile.main([*TINY, "--synthetic", "--steps", "1"])
    assert [name for name in os.listdir(tmp_path) if name.startswith("jaxtrain-profile-")] == []


def test_a_cpu_is_named_with_the_units_its_bf16_matmuls_run_on():
    """The table's device line says whether the CPU has AMX (where torch's oneDNN runs bf16 matmuls on its tiles)
    or AVX-512's bf16 instructions: the bf16 rows' ratio depends on it. Only the first processor's block is read."""
    amx = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 "
           "amx_tile\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu\n")
    assert bench.cpu_in_words(amx, 2) == "Intel(R) Xeon(R) Processor (2 cores, AMX, AVX-512 bf16)"
    epyc = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    assert bench.cpu_in_words(epyc, 2) == "AMD EPYC (2 cores, AVX-512 bf16)"
    bare = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n"
    assert bench.cpu_in_words(bare, 4) == "CPU (4 cores, no bf16 matmul units)"


@pytest.mark.parametrize("row", ["jaxtrain", "torchref"])
def test_a_rows_clock_leaves_out_drawing_its_batch(row, monkeypatch):
    """Both rows draw the step's batch before the clock starts (jaxtrain's drew it inside, torchref's outside):
    a batch that takes 2 s to draw is not in a step the tiny model takes milliseconds for (bound: a step on two
    busy cores, far below 2 s)."""
    from benchmarks import steps
    cfg = config.load([*TINY, "--model.vocab_size=256", "--data.path=null"])
    real_windows = steps.windows

    def slow_windows(cfg, data):
        draw = real_windows(cfg, data)
        return lambda step: (time.sleep(2.0), draw(step))[1]

    monkeypatch.setattr(steps, "windows", slow_windows)
    data = bench.workers.tokens(cfg, synthetic=True)
    timed = steps.jaxtrain(cfg, data) if row == "jaxtrain" else steps.torchref(cfg, data, compiled=False)
    timed.step()  # compiles (jaxtrain) and warms up
    assert timed.step() < 1.5
