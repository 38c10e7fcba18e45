"""--run.dry_run: the memory table of a pod config on fake devices, the verdict, and the real run's own check."""

import subprocess
import sys
import typing

import jax
import jax.numpy as jnp
import pytest

from jaxtrain import checkpoint, config, dryrun, gpu_target, mesh as mesh_lib
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
    assert table_value(proc.stdout, "params (fp32)") == pytest.approx(params_gib, abs=1e-3)
    assert table_value(proc.stdout, "AdamW moments (fp32)") == pytest.approx(2 * params_gib, abs=1e-3)
    assert table_value(proc.stdout, "gradient accumulator (fp32)") == pytest.approx(params_gib, abs=1e-3)
    assert table_value(proc.stdout, "step temporaries (activations, gradients, XLA buffers)") > 0.1


def test_what_cannot_fit_is_refused_with_the_levers():
    """32 sequences of 1024 per device and per micro-batch: tens of GiB of activations, more than a v5e's 16."""
    proc = dry_run("--data.batch_size=2048", "--run.target_device=v5e")
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: does not fit:") and "v5e's 16 GiB" in error
    assert all(lever in error for lever in ("mesh.fsdp", "optim.grad_accum_steps", "model.remat"))
    assert "| **total** |" in proc.stdout  # the table comes first, so the user sees what to cut
    fits = dry_run("--run.target_device=v5p")  # 95 GiB
    assert fits.returncode == 0 and "fits:" in fits.stderr


def test_target_devices_are_the_memory_table_keys():
    literal = typing.get_args(typing.get_args(config.RunConfig.__annotations__["target_device"])[0])
    assert set(literal) == set(dryrun.DEVICE_MEMORY)
    assert set(gpu_target.TARGETS) == {"a100-40gb", "a100-80gb", "h100", "h200"}  # every GPU target has a spec


# Long sequences over a narrow model: one layer's causal scores, B x nh x T x T in bf16 (64 MiB here), outweigh
# the rest of its activations (B x T x d_model floats, some tens of them: a few MiB), so whether the compiled step
# holds them shows in its temporaries.
LONG = ("--config", "configs/tiny.yaml", "--model.n_layer=1", "--model.d_model=64", "--model.n_head=4",
        "--model.seq_len=2048", "--data.batch_size=2", "--model.vocab_size=256", "--run.dry_run=true")
SCORES_BYTES = 2 * 4 * 2048 * 2048 * 2


def long_dry_run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain.run", *LONG, *overrides],
                          capture_output=True, text=True, timeout=600)


def test_gpu_target_without_the_cuda_plugin_says_the_figure_is_xla_cpus():
    if gpu_target.plugin_installed():
        pytest.skip("jax's CUDA plugin is installed here: this path needs an environment without it")
    proc = long_dry_run("--run.target_device=h100", "--run.dry_run_devices=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compiled by XLA:CPU for 1 fake devices" in proc.stdout
    # XLA:CPU's written-out attention keeps the scores for the backward pass.
    assert table_value(proc.stdout, "step temporaries") * GIB >= SCORES_BYTES
    verdict = proc.stderr.strip().splitlines()[-1]
    assert verdict.startswith("fits:") and "overstate a GPU's" in verdict and gpu_target.plugin_fix() in verdict


@pytest.mark.skipif(not gpu_target.plugin_installed(), reason="needs jax's CUDA plugin (no GPU)")
@pytest.mark.parametrize("devices", [1, 16])
def test_gpu_target_compiles_for_that_gpu(devices):
    """With the plugin the step is XLA:GPU's for compile-only H100s, with cuDNN's attention: its temporaries hold
    no layer's scores. 16 devices are two hosts of 8 (the state's split is test_pod_config_on_64_fake_devices')."""
    proc = long_dry_run("--run.target_device=h100", f"--run.dry_run_devices={devices}", f"--mesh.fsdp={devices}",
                        f"--data.batch_size={2 * devices}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"on {devices} x NVIDIA H100 80GB HBM3 as mesh (data 1, fsdp {devices})" in proc.stdout
    assert "compiled by XLA:GPU for h100, ahead of time" in proc.stdout
    assert table_value(proc.stdout, "step temporaries") * GIB < SCORES_BYTES / 2
    assert proc.stderr.strip().splitlines()[-1].startswith("fits:") and "XLA:CPU" not in proc.stderr


class FakeDevice:
    device_kind = "fake accelerator"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit} if self.limit else None


def test_real_run_check_refuses_a_step_bigger_than_the_device():
    cfg = config.load(["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16",
                       "--model.vocab_size=64", "--data.batch_size=4", "--train.precision=fp32"])
    mesh = mesh_lib.make_mesh(cfg)
    abstract = checkpoint.abstract_state(cfg, 64, mesh)
    compiled = dryrun.compiled_step(cfg, abstract, mesh)
    _, total = dryrun.memory_table(abstract, compiled)
    dryrun.check_fits(compiled, abstract, FakeDevice(None))  # a CPU: no limit, no check
    dryrun.check_fits(compiled, abstract, FakeDevice(total))  # exactly enough
    with pytest.raises(UserError, match="levers: mesh.fsdp"):
        dryrun.check_fits(compiled, abstract, FakeDevice(total - 1))
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    assert total >= state_bytes  # one device holds all of the unsharded state, and more
    assert jnp.dtype(jax.tree.leaves(abstract.params)[0].dtype) == jnp.float32
