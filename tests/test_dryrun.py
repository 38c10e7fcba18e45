"""--run.dry_run: the memory table of a pod config on fake devices, the verdict, and the real run's own check."""

import math
import os
import resource
import subprocess
import sys
import typing

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

from jaxtrain import checkpoint, config, dryrun, mesh as mesh_lib, target_devices
from jaxtrain.errors import UserError

GIB = 2**30


def gpt2_params(L: int, d: int, V: int, T: int) -> int:
    """GPT-2's parameter count written out: embeddings, per block two LayerNorms, c_attn, attn c_proj, c_fc and
    mlp c_proj with biases, the final LayerNorm; the head is tied."""
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return V * d + T * d + L * block + 2 * d


def dry_run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain.run", "--config", "configs/pod-fsdp.yaml",
                           "--run.dry_run=true", "--run.dry_run_devices=64", "--model.n_layer=2", *overrides],
                          capture_output=True, text=True, timeout=600)


def table_value(stdout: str, row: str) -> float:
    return float(next(line for line in stdout.splitlines() if line.startswith(f"| {row}")).split("|")[2])


def test_pod_config_on_64_fake_devices():
    """No data folder, no run folder, no accelerator: the pod config compiles for its (8, 8) mesh of 64 devices and
    every fp32 state array is split 8 ways (every dimension of GPT-2 124M divides by 8)."""
    proc = dry_run()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "on 64 x cpu as mesh (data 8, fsdp 8)" in proc.stdout
    params_gib = gpt2_params(2, 768, 50304, 1024) * 4 / 8 / GIB
    # The table prints GiB to 3 decimals: 1e-3 is its rounding.
    assert table_value(proc.stdout, "params (fp32)") == pytest.approx(params_gib, abs=1e-3)
    assert table_value(proc.stdout, "AdamW moments (fp32)") == pytest.approx(2 * params_gib, abs=1e-3)
    assert table_value(proc.stdout, "gradient accumulator (fp32)") == pytest.approx(params_gib, abs=1e-3)
    # GPT-2 124M's activations for a device's micro-batch of 1024-token sequences are GiBs; 0.1 catches a lost row.
    assert table_value(proc.stdout, "step temporaries (activations, gradients, XLA buffers)") > 0.1
    # fake devices and no target: nothing to judge against, and the line says what would be
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "not judged: 64 fake devices have no memory of their own; give run.target_device (one of v4, v5e, ")


def test_what_cannot_fit_is_refused_with_the_levers():
    """128 sequences of 1024 per device and per micro-batch: tens of GiB of activations, more than a v5e's 16, by
    XLA:CPU's estimate and by XLA:TPU (with libtpu) alike."""
    proc = dry_run("--data.batch_size=8192", "--run.target_device=v5e")
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: does not fit:")
    assert all(lever in error for lever in ("mesh.fsdp", "optim.grad_accum_steps", "model.remat"))
    if target_devices.compiler_installed("v5e"):  # XLA:TPU itself refuses to compile it, naming its need
        assert "XLA for TPU v5 lite says RESOURCE_EXHAUSTED" in error and "exceeds available HBM" in error
    else:
        assert "v5e's 16 GiB" in error
        assert "| **total** |" in proc.stdout  # the table comes first, so the user sees what to cut
    fits = dry_run("--run.target_device=v5p")  # 95 GiB
    assert fits.returncode == 0 and "fits:" in fits.stderr


def test_by_xla_cpus_estimate_only_a_step_over_the_target_at_its_largest_overstatement_is_refused(capsys):
    """XLA:CPU's temporaries overstate a GPU's up to 4.1x (measured): 10 GiB of state and 200 of temporaries are
    10 + 200 / 4.1 = 58.8 GiB at least, under an H100's 72 usable, so that may fit (exit 0, saying so); before, it
    was refused, as GPT-2 124M at 32 sequences a micro-batch for an A100 is (55.8 GiB by XLA:CPU, 16.1 by XLA:GPU).
    With 300 GiB of temporaries, 83.2 GiB at least: refused. The target's own compiler's figure is judged as it is."""
    gib = 2**30

    def verdict(state_gib, temporaries_gib, estimated):
        rows = [("params (fp32)", state_gib * gib), (dryrun.TEMPORARIES, temporaries_gib * gib)]
        return dryrun._verdict("h100", rows, (state_gib + temporaries_gib) * gib, estimated)

    assert verdict(10, 200, estimated=True) is None
    assert "may not fit: 210.00 GiB of h100's 79 GiB per device" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"^does not fit: 310.00 GiB of h100's 79 GiB .* by XLA:CPU, 83.17 GiB with"):
        verdict(10, 300, estimated=True)
    assert verdict(10, 61, estimated=False) is True  # 71 GiB: 90% of 79.11 (XLA's spec: 84,942,979,072 bytes) is 71.2
    with pytest.raises(UserError, match=r"^does not fit: 72.00 GiB of h100's 79 GiB per device \(91%; 90% usable\); "
                                        r"levers"):
        verdict(10, 62, estimated=False)


def test_a_dry_run_on_this_machines_devices_judges_them_as_a_run_here_would(monkeypatch, capsys):
    """Without run.target_device it printed the table and no verdict (63 GiB on this 23.5 GiB host: exit 0), where
    the real run refuses the config for the host's memory. Now the real run's check, and its refusal."""
    cfg = config.load(["--config", "configs/tiny.yaml", "--run.dry_run=true", "--model.vocab_size=256"])
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: 2**50)
    assert dryrun.report(cfg)["fits"] is True
    assert "fits this machine: 1048576.00 GiB of host memory for" in capsys.readouterr().err
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: 2**20)
    with pytest.raises(UserError, match=r"^the train step needs .* and this host has 0.00 GiB of memory; levers"):
        dryrun.report(cfg)
    monkeypatch.setattr(dryrun, "use_fake_devices", lambda n: None)  # jax started: its 1 CPU stands in for them
    fake = config.load(["--config", "configs/tiny.yaml", "--run.dry_run=true", "--model.vocab_size=256",
                        "--run.dry_run_devices=1"])  # fake devices: not this machine's, not judged as them
    assert dryrun.report(fake)["fits"] is None and "fits this machine" not in capsys.readouterr().err


def test_a_tpu_target_without_a_chip_count_asks_for_one_with_libtpu(monkeypatch):
    """With libtpu and no run.dry_run_devices, the dry run asked libtpu for one chip, and refused the count 1 as
    "run.dry_run_devices=1", which the user never gave. Now it asks for the slice's chip count."""
    cfg = config.load(["--config", "configs/tiny.yaml", "--run.dry_run=true", "--run.target_device=v5e"])
    monkeypatch.setattr(target_devices, "compiler_installed", lambda target: True)
    monkeypatch.setattr(target_devices, "machine_has", lambda target: False)
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # what allow_compile_only sets, restored after the test
    with pytest.raises(UserError) as refused:
        dryrun._devices(cfg)
    assert str(refused.value) == ("run.target_device=v5e compiles for a slice of v5e chips with libtpu: give its "
                                  "chip count as run.dry_run_devices, a power of 2 of at least 4 chips (e.g. 64 "
                                  "for v5e-64)")


def test_target_devices_are_the_memory_table_keys():
    literal = typing.get_args(typing.get_args(config.RunConfig.__annotations__["target_device"])[0])
    assert set(literal) == set(dryrun.DEVICE_MEMORY)
    # a GPU's memory is its own XLA device spec's device_memory_size (an H100's 84,942,979,072 bytes: 79.11 GiB)
    assert {gpu: round(dryrun.DEVICE_MEMORY[gpu] / 2**30, 2) for gpu in target_devices.GPUS} == {
        "a100-40gb": 39.42, "a100-80gb": 79.26, "h100": 79.11, "h200": 141.0}
    # every GPU target has a device spec, every TPU one a torus
    assert set(target_devices.GPUS) == {"a100-40gb", "a100-80gb", "h100", "h200"}
    assert set(target_devices.GPUS) | set(target_devices.TPU_AXES) == set(literal)


@pytest.mark.parametrize("target,chips,name", [
    ("v5e", 4, "v5e:2x2"), ("v5e", 8, "v5e:2x4"), ("v5e", 64, "v5e:8x8"), ("v6e", 128, "v6e:8x16"),
    ("v6e", 256, "v6e:16x16"), ("v4", 4, "v4:2x2x1"), ("v4", 16, "v4:2x2x4"), ("v5p", 32, "v5p:2x4x4"),
    ("v5p", 64, "v5p:4x4x4"), ("v5p", 128, "v5p:4x4x8"), ("v5p", 256, "v5p:4x8x8")])
def test_tpu_slices_are_named_as_cloud_tpu_names_them(target, chips, name):
    """The names of Cloud TPU's slice shapes (v5litepod-64 is 8x8, v5p-128's 64 chips 4x4x4, v4-8's 4 chips
    2x2x1), written out."""
    assert target_devices.tpu_topology(target, chips) == name


@given(target=st.sampled_from(sorted(target_devices.TPU_AXES)), chips=st.integers(-4, 5000))
def test_a_tpu_slice_covers_its_chips_or_is_refused(target, chips):
    """Every power of 2 from 4 chips is a slice of exactly that many chips; every other count is refused."""
    if chips >= 4 and chips & (chips - 1) == 0:
        dims = target_devices.tpu_topology(target, chips).split(":")[1].split("x")
        assert math.prod(map(int, dims)) == chips and len(dims) == target_devices.TPU_AXES[target]
    else:
        with pytest.raises(UserError, match="power of 2"):
            target_devices.tpu_topology(target, chips)


# Long sequences over a narrow model: one layer's causal scores, B x nh x T x T in bf16 (64 MiB here), outweigh
# the rest of its activations (B x T x d_model floats, some tens of them: a few MiB), so whether the compiled step
# holds them shows in its temporaries.
LONG = ("--config", "configs/tiny.yaml", "--model.n_layer=1", "--model.d_model=64", "--model.n_head=4",
        "--model.seq_len=2048", "--model.vocab_size=256", "--run.dry_run=true")
SCORES_BYTES = 2 * 4 * 2048 * 2048 * 2


def long_dry_run(devices: int, *overrides: str) -> subprocess.CompletedProcess:
    """LONG with 2 sequences a device, every state array split over the devices."""
    return subprocess.run([sys.executable, "-m", "jaxtrain.run", *LONG, f"--run.dry_run_devices={devices}",
                           f"--mesh.fsdp={devices}", f"--data.batch_size={2 * devices}", *overrides],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("target,devices,extra", [("h100", 1, "cuda12"), ("v5e", 4, "tpu")])
def test_without_the_targets_compiler_the_verdict_says_the_figure_is_xla_cpus(target, devices, extra):
    if target_devices.compiler_installed(target):
        pytest.skip(f"jax's compiler for {target} is installed here: this path needs an environment without it")
    proc = long_dry_run(devices, f"--run.target_device={target}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"compiled by XLA:CPU for {devices} fake device{'s' * (devices > 1)}\n" in proc.stdout
    # XLA:CPU's written-out attention keeps the scores for the backward pass.
    assert table_value(proc.stdout, "step temporaries") * GIB >= SCORES_BYTES
    verdict = proc.stderr.strip().splitlines()[-1]
    assert verdict.startswith("fits:") and "XLA:CPU's, an estimate" in verdict
    assert f'pip install "jax[{extra}]=={jax.__version__}"' in verdict


@pytest.mark.skipif(not target_devices.compiler_installed("h100"), reason="needs jax's CUDA plugin (no GPU)")
@pytest.mark.parametrize("devices", [1, 16])
def test_gpu_target_compiles_for_that_gpu(devices):
    """With the plugin the step is XLA:GPU's for compile-only H100s, with cuDNN's attention: its temporaries hold
    no layer's scores. 16 devices are two hosts of 8."""
    proc = long_dry_run(devices, "--run.target_device=h100")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"on {devices} x NVIDIA H100 80GB HBM3 as mesh (data 1, fsdp {devices})" in proc.stdout
    assert "compiled by XLA:GPU for h100, ahead of time" in proc.stdout
    assert table_value(proc.stdout, "step temporaries") * GIB < SCORES_BYTES / 2
    assert proc.stderr.strip().splitlines()[-1].startswith("fits:") and "XLA:CPU" not in proc.stderr


@pytest.mark.skipif(not target_devices.compiler_installed("h100"), reason="needs jax's CUDA plugin (no GPU)")
def test_the_head_kernel_holds_the_logits_once():
    """model.head_lse=pallas compiled for an H100: the loss's gradient is written over the kernel's logits, as over
    XLA's gemm's, so the step's temporaries grow by the kernel's small extras (its pairs, 4 MiB here; wte's fp32
    transpose, 8 MiB), not by a second buffer of the micro-batch's logits (32 x 128 tokens x 16,384 in bf16:
    128 MiB)."""
    run = lambda lse: subprocess.run(
        [sys.executable, "-m", "jaxtrain.run", "--config", "configs/tiny.yaml", "--model.vocab_size=16384",
         "--run.dry_run=true", "--run.target_device=h100", "--run.dry_run_devices=1", f"--model.head_lse={lse}"],
        capture_output=True, text=True, timeout=600)
    temporaries = {}
    for lse in ("xla", "pallas"):
        proc = run(lse)
        assert proc.returncode == 0, proc.stderr[-2000:]
        temporaries[lse] = table_value(proc.stdout, "step temporaries") * GIB
    assert temporaries["pallas"] - temporaries["xla"] < 32 * 128 * 16384 * 2 / 4


@pytest.mark.skipif(not target_devices.compiler_installed("v5e"), reason="needs libtpu (no TPU)")
@pytest.mark.parametrize("target,kind", [("v5e", "TPU v5 lite"), ("v5p", "TPU v5")])
def test_tpu_target_compiles_for_that_slice(target, kind):
    """With libtpu the step is XLA:TPU's for a compile-only slice of 4 chips. A wide layer and a large vocabulary
    make the state big enough to read in the table's 3 decimals: each device holds a quarter of it."""
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", "--config", "configs/tiny.yaml", "--model.n_layer=1",
                           "--model.d_model=1024", "--model.n_head=8", "--model.seq_len=64", "--model.vocab_size=50304",
                           "--data.batch_size=8", "--mesh.fsdp=4", "--run.dry_run=true", "--run.dry_run_devices=4",
                           f"--run.target_device={target}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"on 4 x {kind} as mesh (data 1, fsdp 4)" in proc.stdout
    assert f"compiled by XLA:TPU for {target}, ahead of time" in proc.stdout
    params_gib = gpt2_params(1, 1024, 50304, 64) * 4 / 4 / GIB
    assert table_value(proc.stdout, "params (fp32)") == pytest.approx(params_gib, abs=1e-3)
    assert table_value(proc.stdout, "step temporaries") > 0
    assert proc.stderr.strip().splitlines()[-1].startswith("fits:") and "XLA:CPU" not in proc.stderr


class Refused:
    """A lowered step whose compile fails as XLA:TPU's does for a step bigger than its device, or otherwise."""

    def __init__(self, message):
        self.message = message

    def compile(self, compiler_options=None):
        raise jax.errors.JaxRuntimeError(self.message)


def test_a_compiler_refusing_the_step_for_memory_is_a_user_error():
    device = FakeDevice(None)
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (31.87G) "
               "exceeds available HBM (15.75G).\nmore detail")
    with pytest.raises(UserError) as refused:
        dryrun.compile_fitting(Refused(message), device)
    assert str(refused.value) == ("does not fit: XLA for fake accelerator says RESOURCE_EXHAUSTED: Ran out of memory "
                                  "on HBM, the total memory required for HLO temporaries (31.87G) exceeds available "
                                  f"HBM (15.75G); levers: {dryrun.LEVERS}")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # any other failure is not the user's
        dryrun.compile_fitting(Refused("INTERNAL: a compiler bug"), device)


class FakeDevice:
    device_kind = "fake accelerator"

    def __init__(self, limit, platform="fake"):
        self.limit, self.platform = limit, platform

    def memory_stats(self):
        return {"bytes_limit": self.limit} if self.limit else None


def small_step():
    """(abstract state, compiled train step, the step's total bytes) of a one-layer model, on this machine."""
    cfg = config.load(["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16",
                       "--model.vocab_size=64", "--data.batch_size=4", "--train.precision=fp32"])
    mesh = mesh_lib.make_mesh(cfg)
    abstract = checkpoint.abstract_state(cfg, 64, mesh)
    compiled = dryrun.compiled_step(cfg, abstract, mesh)
    return abstract, compiled, dryrun.memory_table(abstract, compiled)[1]


def test_real_run_check_refuses_a_step_bigger_than_the_device():
    abstract, compiled, total = small_step()
    dryrun.check_fits(compiled, abstract, FakeDevice(None))  # an accelerator that reports no limit: no check
    dryrun.check_fits(compiled, abstract, FakeDevice(total))  # exactly enough
    assert dryrun._fits_here(compiled, abstract, FakeDevice(None)) is None  # no limit reported: not judged
    assert dryrun._fits_here(compiled, abstract, FakeDevice(total)) is True
    with pytest.raises(UserError, match="levers: mesh.fsdp"):
        dryrun.check_fits(compiled, abstract, FakeDevice(total - 1))
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    assert total >= state_bytes  # one device holds all of the unsharded state, and more
    assert jnp.dtype(jax.tree.leaves(abstract.params)[0].dtype) == jnp.float32


CPU_ORDER_LEVER = ("XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false (XLA:CPU's memory-minimizing "
                   "order: about 30% less for the step's temporaries; model.remat saves nothing on a CPU without "
                   "it), ")


def test_on_a_cpu_the_step_is_checked_against_the_hosts_memory(monkeypatch):
    """A CPU reports no memory limit: its step is checked against the host's memory, which all of the host's CPU
    devices share (before, nothing was checked, and a step bigger than the host failed in step 1 with XLA's
    RESOURCE_EXHAUSTED traceback). No memory is allocated: the host's is patched. The levers start with XLA:CPU's
    memory-minimizing order where XLA_FLAGS does not set it already."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    abstract, compiled, total = small_step()
    cpu = FakeDevice(None, platform="cpu")
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: total)
    dryrun.check_fits(compiled, abstract, cpu)  # exactly enough
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: total - 1)
    with pytest.raises(UserError, match=r"this host has .* GiB of memory; levers: XLA_FLAGS=\S+ \(.*\), mesh.fsdp"):
        dryrun.check_fits(compiled, abstract, cpu)
    monkeypatch.setattr(dryrun, "memory_table", lambda *args: ([], 40 * GIB))  # figures that read in GiB
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: int(31.5 * GIB))
    with pytest.raises(UserError) as refused:
        dryrun.check_fits_host(compiled, abstract, 1)
    assert str(refused.value) == (f"the train step needs 40.00 GiB and this host has 31.50 GiB of memory; "
                                  f"levers: {CPU_ORDER_LEVER}{dryrun.LEVERS}")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=false")  # set: not offered
    with pytest.raises(UserError) as refused:
        dryrun.check_fits_host(compiled, abstract, 1)
    assert str(refused.value).endswith(f"31.50 GiB of memory; levers: {dryrun.LEVERS}")
    monkeypatch.setattr(dryrun, "memory_table", lambda *args: ([], 10 * GIB))
    dryrun.check_fits_host(compiled, abstract, 3)  # 30 GiB for 3 devices: fits
    with pytest.raises(UserError) as refused:
        dryrun.check_fits_host(compiled, abstract, 4)
    assert str(refused.value).startswith("the train step needs 10.00 GiB per device, 40.00 GiB for 4 CPU devices, "
                                         "and this host has 31.50 GiB of memory; levers: mesh.fsdp")


def test_a_real_run_whose_step_the_host_cannot_hold_is_refused_before_its_state_is_made(tmp_path, cache_dir,
                                                                                       monkeypatch):
    """The state was made first, then the step compiled and checked: a state bigger than the host (a 50M-token
    vocabulary, 25.6 GB) hung in its allocation, deaf to SIGTERM, or ended in RESOURCE_EXHAUSTED's traceback. Now
    the step is compiled from the state's shapes and checked first; no state is made, the run folder stays as it
    was (none)."""
    from test_run import small_args
    from jaxtrain import run
    made, initial_state = [], run.Trainer.initial_state
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: 2**20)  # 1 MiB: no step fits
    monkeypatch.setattr(run.Trainer, "initial_state", lambda self: made.append(1) or initial_state(self))
    out_dir = tmp_path / "run"
    with pytest.raises(UserError, match=r"^the train step needs .* GiB and this host has 0.00 GiB of memory; levers"):
        run.train(config.load(small_args(str(out_dir), cache_dir)))
    assert made == [] and not out_dir.exists()


def _tiny_temporaries(xla_flags: str) -> float:
    """GiB of the step's temporaries in configs/tiny.yaml's dry run on this CPU under `xla_flags`."""
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", "--config", "configs/tiny.yaml",
                           "--run.dry_run=true", "--data.path=null", "--model.vocab_size=256"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "XLA_FLAGS": xla_flags})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return table_value(proc.stdout, "step temporaries")


def test_the_cpu_order_lever_shrinks_the_steps_temporaries():
    """The lever the host's refusal names first acts on the jax installed: measured 0.243 -> 0.173 GiB (-29%) on
    tiny.yaml with jax 0.10.2; a flag XLA ignored or renamed would leave them as they are (the message's "about 30%":
    at least 15% asked here, half the claim, for other XLA versions' schedules)."""
    default, ordered = _tiny_temporaries(""), _tiny_temporaries(dryrun.CPU_MEMORY_ORDER)
    assert ordered < 0.85 * default, (default, ordered)


def test_host_memory_is_the_physical_memory_or_a_lower_container_limit(monkeypatch, tmp_path):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < dryrun.host_memory_bytes() <= physical
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # cgroup v1 without one
    monkeypatch.setattr(dryrun, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(dryrun, "OWN_CGROUPS", str(tmp_path / "absent"))  # unreadable: the roots of v2 and v1
    assert dryrun.host_memory_bytes() == physical
    (tmp_path / "memory.max").write_text("123456789\n")
    assert dryrun.host_memory_bytes() == 123456789
    (tmp_path / "memory" / "job").mkdir()  # a job's own cgroup below the root: its limit binds, and the root's
    (tmp_path / "memory" / "job" / "memory.limit_in_bytes").write_text("5000\n")
    (tmp_path / "own").write_text("0::/\n4:memory:/job\n")
    monkeypatch.setattr(dryrun, "OWN_CGROUPS", str(tmp_path / "own"))
    assert dryrun.host_memory_bytes() == 5000


def test_the_memory_limit_is_this_processs_cgroups_and_those_above_it():
    """A SLURM job's --mem is its own cgroup's limit (/proc/self/cgroup: memory:/slurm/uid_0/job_7), below the
    mount's root, which alone was read: a step over the job's limit was OOM-killed instead of refused."""
    own = "12:pids:/x\n4:memory,cpu:/slurm/uid_0/job_7\n0::/user.slice/job.scope\n"
    assert dryrun.cgroup_limit_files(own, "/cg") == [
        "/cg/memory/slurm/uid_0/job_7/memory.limit_in_bytes", "/cg/memory/slurm/uid_0/memory.limit_in_bytes",
        "/cg/memory/slurm/memory.limit_in_bytes", "/cg/memory/memory.limit_in_bytes",
        "/cg/user.slice/job.scope/memory.max", "/cg/user.slice/memory.max", "/cg/memory.max"]
    assert dryrun.cgroup_limit_files("0::/\n", "/cg") == ["/cg/memory.max"]


def test_a_run_bigger_than_the_cpu_host_is_refused_before_step_1_and_writes_nothing(tmp_path, cache_dir, monkeypatch):
    """The real run's check on a CPU: exit 2's UserError, one line naming the figures and the levers, before step 1;
    the run folder it made for the run is gone again (runlock: its lock file and an empty checkpoints/ were all it
    held). The same command with memory enough then trains in that folder."""
    from jaxtrain import run
    out_dir = tmp_path / "run"
    args = ["--config", "configs/tiny.yaml", f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
            "--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
            "--data.batch_size=4", "--train.steps=2", "--optim.warmup_steps=1", "--train.eval_batches=1",
            "--log.progress=false", "--log.sample_tokens=0"]
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: 2**10)  # 1 KiB: less than the state alone
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(UserError, match=r"^the train step needs \d+\.\d\d GiB and this host has 0\.00 GiB of memory; "
                                        r"levers: XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false "
                                        r".*mesh\.fsdp .*model\.vocab_tiles") as refused:
        run.train(config.load(args))
    assert len(str(refused.value).splitlines()) == 1
    assert not out_dir.exists()
    monkeypatch.setattr(dryrun, "host_memory_bytes", lambda: 2**50)
    assert run.train(config.load(args))["step"] == 2
    assert (out_dir / "config.yaml").exists() and os.listdir(out_dir / "checkpoints") == ["2"]


def test_a_device_count_the_batch_cannot_split_over_is_refused_before_the_devices_exist():
    """100,000 fake devices took all of a 24 GiB host's memory to create before the batch's split was checked; the
    address space is capped here so that a regression fails this test instead of the machine."""
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (12 * 2**30, 12 * 2**30))
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", "--config", "configs/tiny.yaml", "--run.dry_run=true",
                           "--run.dry_run_devices=100000"], capture_output=True, text=True, timeout=300,
                          preexec_fn=cap)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "does not split over 100000 devices" in proc.stderr


def test_an_estimate_for_a_target_is_the_same_with_or_without_a_device_count():
    """Without the target's compiler, XLA:CPU stands in for it: on one fake device (run.dry_run_devices=1) it
    compiled with its memory-minimizing order, on this machine's CPU (no count) with its default, which keeps more
    alive: two figures for one question (configs/small.yaml for a v5e: 1.80 and 2.19 GiB). Now the same."""
    totals = []
    for count in ([], ["--run.dry_run_devices=1"]):
        proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", "--config", "configs/tiny.yaml",
                               "--run.dry_run=true", "--data.path=null", "--model.vocab_size=256",
                               "--run.target_device=v5e", *count],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "XLA_FLAGS": ""})
        assert proc.returncode == 0, proc.stderr[-2000:]
        totals.append(table_value(proc.stdout, "step temporaries"))
    assert totals[0] == totals[1], totals
