"""A jaxtrain process never loads torch, though torch is installed here (the [test] extra brings it): not the trainer,
not the converter, not the sampler, not the evaluator, not --help. Python's -X importtime lists every module a process
imports, lazily imported ones included, on stderr; no line may name torch or one of its submodules. Nor, off a GPU,
does it run the code of Pallas's GPU backends, which only the GPU kernels use (imported on first use, first_use.py:
Mosaic GPU's 0.4 s of a start, Triton's 0.14 s)."""

import importlib.util
import re
import subprocess
import sys

from jaxtrain import embedded_corpus
from test_run import small_args

TORCH_IMPORT = re.compile(r"^import time:.*\|\s+torch(\.|$)", re.M)
GPU_PALLAS_IMPORT = re.compile(r"^import time:.*\|\s+jax\._src\.pallas\.(mosaic_gpu|triton)\.core$", re.M)


def imports_of(*args: str, how: str = "-m") -> str:
    """The -X importtime report of `python -m *args` (or of `python -c code`, how="-c")."""
    proc = subprocess.run([sys.executable, "-X", "importtime", how, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_torch_is_installed_so_the_checks_below_mean_something():
    assert importlib.util.find_spec("torch") is not None
    assert TORCH_IMPORT.search(imports_of("torchref.run", "--help"))  # the pattern does find torch's imports


def test_training_and_converting_never_import_torch_nor_gpu_pallas(tmp_path, cache_dir, wandb_offline):
    """Training with every logger on: TensorBoard, and W&B (offline; wandb has integrations with torch that it
    imports lazily)."""
    out = tmp_path / "run"
    trained = imports_of("jaxtrain.run", *small_args(out, cache_dir, "--train.steps=4", "--log.tensorboard=true",
                                                     "--log.wandb=true"))
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert re.search(r"^import time:.*\|\s+wandb\.sdk\.wandb_init$", trained, re.M)  # W&B loaded in this process
    converted = imports_of("jaxtrain.convert", "to-torch", str(out / "checkpoints" / "4"), str(tmp_path / "torch"))
    exported = imports_of("jaxtrain.convert", "to-hf", str(out / "checkpoints" / "4"), str(tmp_path / "hf"))
    sampled = imports_of("jaxtrain.sample", "--run", str(out), "--max_new_tokens", "3")
    evaluated = imports_of("jaxtrain.evaluate", "--from", str(tmp_path / "hf"), "--data",
                           embedded_corpus.folder(cache_dir), "--batches", "1")
    for stderr in (imports_of("jaxtrain.run", "--help"), trained, converted, exported, sampled, evaluated):
        assert "jaxtrain" in stderr and not TORCH_IMPORT.search(stderr), TORCH_IMPORT.findall(stderr)[:5]
        assert not GPU_PALLAS_IMPORT.search(stderr), GPU_PALLAS_IMPORT.findall(stderr)
    # The pattern finds both modules' imports; and hopper_gemm.plgpu and fused_norm.pl_triton read the modules a
    # plain import gives, whichever imported them first
    code = ("from jaxtrain import fused_norm, hopper_gemm; from jax.experimental.pallas import mosaic_gpu, triton; "
            "assert hopper_gemm.plgpu.kernel is mosaic_gpu.kernel; "
            "assert fused_norm.pl_triton.CompilerParams is triton.CompilerParams")
    assert len(GPU_PALLAS_IMPORT.findall(imports_of(code, how="-c"))) == 2
