"""Compile-only devices of an accelerator this machine does not have: what the dry run compiles for.

`run.target_device` names a GPU or a TPU generation. Where jax's compiler for it is installed, XLA compiles the train
step for a described topology of those devices as it would on them (their fusions, kernels and buffer assignment),
runs nothing, and needs no accelerator: MaxText's train_compile does the same for TPU pods.
- GPUs: jax's CUDA plugin (`jax[cuda12]`) and XLA's device spec of the GPU (gpu_specs/<target>.txtpb), plus the
  cuDNN and CUDA versions the plugin would compile against (the installed nvidia wheels'); hosts of 8.
- TPUs: libtpu (`jax[tpu]`) and the slice's topology name (e.g. v5e:8x8), hosts of libtpu's default 4 chips.
Neither is a dependency of jaxtrain (several GB of nvidia wheels; libtpu loads on every jax start): `install_fix`
says what to install.
"""

import glob
import importlib.metadata
import importlib.util
import math
import os

from jaxtrain.errors import UserError

SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")
GPUS = tuple(sorted(name.removesuffix(".txtpb") for name in os.listdir(SPECS_DIR) if name.endswith(".txtpb")))
GPUS_PER_HOST = 8  # an HGX/DGX node's: a larger count is laid out as hosts of 8
TPU_AXES = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}  # the torus's dimensions, for the slice's topology name
MEGACORE = ("v4", "v5p")  # two TensorCores a chip, one jax device
TPU_MIN_CHIPS = 4  # libtpu's default host, 2x2 chips: the smallest topology it describes


def compiler_installed(target: str) -> bool:
    needs = ("jax_plugins", "jax_plugins.xla_cuda12") if target in GPUS else ("libtpu",)
    return all(importlib.util.find_spec(m) is not None for m in needs)


def install_fix(target: str) -> str:
    extra = "cuda12" if target in GPUS else "tpu"
    return f'pip install "jax[{extra}]=={importlib.metadata.version("jax")}"'


def machine_has(target: str) -> bool:
    """Whether this machine has that kind of accelerator (a GPU driver, a TPU's device files), known without
    starting jax's backends."""
    if target in GPUS:
        return os.path.exists("/dev/nvidiactl")
    return has_tpu_device_files()


def has_tpu_device_files() -> bool:
    """Whether this machine has a TPU's device files (/dev/accel*, or /dev/vfio/N on the generations using VFIO)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def allow_compile_only(target: str) -> None:
    """Let jax load the compiler on a machine without the accelerator; must run before jax starts its backends.
    The CUDA plugin's version check would call cuInit, fail, and leave jax no "cuda" platform to describe; libtpu
    takes a lockfile that would refuse every other process (a second dry run, a test's parent) that loads it."""
    if machine_has(target):
        return
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK" if target in GPUS else "ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def devices(target: str, n: int | None) -> list:
    """n compile-only devices of `target`: one GPU where n is None; a TPU slice needs its count."""
    from jax.experimental import topologies
    if target in GPUS:
        n = n or 1
        hosts = n // GPUS_PER_HOST if n > GPUS_PER_HOST and n % GPUS_PER_HOST == 0 else 1
        return topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                            topology=f"1x{hosts}x{n // hosts}").devices
    if n is None:  # not one chip: libtpu describes no slice under 2x2, and a chip's share of a step depends on N
        raise UserError(f"run.target_device={target} compiles for a slice of {target} chips with libtpu: give its "
                        f"chip count as run.dry_run_devices, {slice_hint(target)}")
    options = {"chip_config_name": "megacore"} if target in MEGACORE else {}
    return topologies.get_topology_desc(platform="tpu", topology_name=tpu_topology(target, n), **options).devices


def device_spec(target: str) -> str:
    """A GPU's stored XLA device spec (text proto): its name, memory bandwidth, cores."""
    with open(os.path.join(SPECS_DIR, f"{target}.txtpb")) as f:
        return f.read()


def target_config(target: str) -> str:
    """A GPU's text proto for jax's CUDA topology: the stored device spec, plus the cuDNN and CUDA runtime versions
    of the installed nvidia wheels (what the plugin would compile against)."""
    spec = device_spec(target)
    cudnn = importlib.metadata.version("nvidia-cudnn-cu12").split(".")
    cuda = importlib.metadata.version("nvidia-cuda-runtime-cu12").split(".")
    return (spec + f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}\n"
            f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} patch: 0 }}\n")


def slice_hint(target: str) -> str:
    cores = 64 * (2 if target in MEGACORE else 1)  # Cloud TPU names a v4 or v5p slice by its TensorCores
    return f"a power of 2 of at least {TPU_MIN_CHIPS} chips (e.g. 64 for {target}-{cores})"


def tpu_topology(target: str, chips: int) -> str:
    """The slice of `chips` chips as libtpu names it: powers of 2 spread over the torus's axes, the larger ones
    last (v5e:8x8, v5p:4x4x8; 4 chips: v5e:2x2, v5p:2x2x1)."""
    exponent = int(math.log2(chips)) if chips > 0 else -1
    if chips < TPU_MIN_CHIPS or 2**exponent != chips:
        raise UserError(f"run.dry_run_devices={chips} is not a {target} slice libtpu can describe; give "
                        f"{slice_hint(target)}")
    axes = TPU_AXES[target]
    dims = [2 ** (exponent // axes + (i >= axes - exponent % axes)) for i in range(axes)]
    if axes == 3 and chips == TPU_MIN_CHIPS:
        dims = [2, 2, 1]
    return f"{target}:{'x'.join(map(str, dims))}"
