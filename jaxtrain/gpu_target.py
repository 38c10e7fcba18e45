"""Compiling for a GPU this machine does not have, through jax's CUDA plugin.

The dry run (dryrun.py) and benchmarks/roofline.py compile the train step for an H100, H200 or A100 on a machine
without one: jax.experimental.topologies gives compile-only devices for a target description, and XLA:GPU compiles
for them as it would on the GPU (its fusions, cuBLAS and cuDNN calls, its buffer assignment), runs nothing, and
needs no driver. The description is XLA's device spec for that GPU (gpu_specs/<target>.txtpb) plus the cuDNN and
CUDA versions the plugin would compile against (the installed nvidia wheels').

The plugin is jax's `cuda12` extra, several GB of nvidia wheels, so it is not a dependency of jaxtrain:
`plugin_fix()` says what to install.
"""

import importlib.metadata
import importlib.util
import os

SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")
TARGETS = tuple(sorted(name.removesuffix(".txtpb") for name in os.listdir(SPECS_DIR) if name.endswith(".txtpb")))
GPUS_PER_HOST = 8  # an HGX/DGX node's: a larger count is laid out as hosts of 8


def plugin_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("jax_plugins", "jax_plugins.xla_cuda12"))


def plugin_fix() -> str:
    return f'pip install "jax[cuda12]=={importlib.metadata.version("jax")}"'


def machine_has_gpu() -> bool:
    """Whether an NVIDIA driver is loaded here, known without starting jax's backends."""
    return os.path.exists("/dev/nvidiactl")


def allow_compile_only() -> None:
    """Let the plugin load on a machine without a GPU. Its version check would call cuInit, fail, and leave jax
    without a "cuda" platform to describe a topology for. Must run before jax starts its backends."""
    if not machine_has_gpu():
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def target_config(target: str) -> str:
    """`target`'s text proto for jax's CUDA topology: the stored device spec, plus the cuDNN and CUDA runtime
    versions of the installed nvidia wheels (what the plugin would compile against)."""
    with open(os.path.join(SPECS_DIR, f"{target}.txtpb")) as f:
        spec = f.read()
    cudnn = importlib.metadata.version("nvidia-cudnn-cu12").split(".")
    cuda = importlib.metadata.version("nvidia-cuda-runtime-cu12").split(".")
    return (spec + f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}\n"
            f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} patch: 0 }}\n")


def devices(target: str, n: int) -> list:
    """n compile-only `target` GPUs: one host's, or hosts of GPUS_PER_HOST where n is a larger multiple of it."""
    from jax.experimental import topologies
    hosts = n // GPUS_PER_HOST if n > GPUS_PER_HOST and n % GPUS_PER_HOST == 0 else 1
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                            topology=f"1x{hosts}x{n // hosts}")
    return topology.devices
