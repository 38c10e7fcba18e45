"""Which kernel each of the model's ops runs as: the config's model.attention, model.norm, model.qkv_grad and
model.cpu_dots against the backend the step is traced for (autocast.backend). Where a choice cannot run there, one
error that says why and what to pick instead. The model builds its blocks from these; the train step's compile
options ask the same questions (step.compiler_options), so that both agree on the program. A checkpoint whose config
names a kernel computes elsewhere with the choice that runs anywhere (runs_anywhere)."""

import dataclasses
import functools

import jax
import jaxlib

from jaxtrain.autocast import BIAS_ROW_PAD, backend
from jaxtrain.config import ModelConfig
from jaxtrain.config_checks import HOPPER_GEMM_TILE
from jaxtrain.errors import UserError
from jaxtrain.fused_norm import triton_available


# The settings that name one kernel of the forward pass, which may not run outside the run that chose it (cuDNN's
# attention off a GPU or in fp32, the norm and Hopper MLP kernels off a GPU, oneDNN's dots off a CPU or in fp16), and
# the choice that runs anywhere, the same function: auto, which picks the kernel where it runs, or XLA's ops. The
# backward's kernels (gelu_grad, qkv_grad, head_lse) are no matter to a forward pass alone.
NAMED_KERNELS = {"attention": ("cudnn", "auto"), "norm": ("pallas", "auto"), "gelu_fwd": ("pallas", "xla"),
                 "cpu_dots": ("onednn", "auto")}


def runs_anywhere(cfg: ModelConfig, precision: str) -> tuple[ModelConfig, list[str]]:
    """(`cfg` with each forward kernel it names (NAMED_KERNELS) put back to the choice that runs anywhere, the
    settings whose kernel that changes here in `precision`): how a checkpoint's model computes outside its run
    (sample, evaluate), on another backend, in another precision or at other shapes than the run's."""
    changes = {key: anywhere for key, (kernel, anywhere) in NAMED_KERNELS.items() if getattr(cfg, key) == kernel}
    anywhere = dataclasses.replace(cfg, **changes)
    picked_again = {"attention": lambda: fused_attention(anywhere, precision), "norm": lambda: norm_kernels(anywhere),
                    "cpu_dots": lambda: onednn_dots(anywhere, precision), "gelu_fwd": lambda: False}
    return anywhere, [f"model.{key}={getattr(cfg, key)}" for key in changes if not picked_again[key]()]


def fused_attention(cfg: ModelConfig, precision: str) -> bool:
    """Whether attention runs as cuDNN's fused flash-attention kernel (model.attention). It never holds the
    (B, nh, T, T) scores, so memory grows with T, not T^2; it takes bf16 only, has no dropout on the
    probabilities, takes head sizes that are a multiple of 8 up to cudnn_max_head_size() only (jax raises
    NotImplementedError on others), and exists on NVIDIA GPUs only. auto picks it where it can run."""
    head_size, largest = cfg.d_model // cfg.n_head, cudnn_max_head_size()
    possible = (precision == "bf16" and cfg.dropout == 0.0 and head_size % 8 == 0 and head_size <= largest
                and backend() == "gpu")
    if cfg.attention == "cudnn" and not possible:
        gpu = ("a GPU" if largest else "an NVIDIA GPU of compute capability 8.0 or later (cuDNN's attention needs "
               "one: not this one)")
        sizes = f" and at most {largest} here" if largest else ""
        raise UserError(f"model.attention=cudnn needs train.precision=bf16, model.dropout=0, a head size "
                        f"(model.d_model / model.n_head) that is a multiple of 8{sizes}, and {gpu} (got {precision}, "
                        f"dropout {cfg.dropout}, head size {head_size}, {backend()}); use model.attention=auto")
    return cfg.attention == "cudnn" or (cfg.attention == "auto" and possible)


def cudnn_max_head_size() -> int:
    """The largest head size cuDNN's flash attention takes: 256 on a Hopper or later GPU, 128 on an Ampere or Ada
    one, as jax's check_is_flash_attention asks the local GPU (128 where none is local, an ahead-of-time compile, as
    jax takes it there too); 0 on a GPU it does not run on: one before Ampere (cuDNN's SDPA needs SM80) or not
    NVIDIA's (jax's check asks for "cuda" in the platform's version)."""
    if jax.default_backend() != "gpu":
        return 128
    device = jax.devices()[0]
    if "cuda" not in device.client.platform_version:
        return 0
    capability = tuple(map(int, device.compute_capability.split(".")))
    return 256 if capability >= (9, 0) else 128 if capability >= (8, 0) else 0


def qkv_gemm_blocks(fused_attention: bool, weight_shards: int, qkv_kernel: bool = False) -> bool:
    """Whether c_attn writes q, k and v as three gemms (Linear.column_blocks): where attention is cuDNN's, which
    takes them as three arrays (one gemm's output sliced into them is a copy), or model.qkv_grad=pallas's kernel is
    their backward (`qkv_kernel`), and each weight is whole on every device (split across devices, the column slices
    would be resharded). The model asks it of the mesh it is traced under, the step's compile options
    (step.compiler_options) of the config's."""
    return (fused_attention or qkv_kernel) and weight_shards == 1


def norm_kernels(cfg: ModelConfig) -> bool:
    """Whether each block's residual adds and LayerNorms run as fused_norm's kernels (model.norm): auto on a GPU,
    where XLA writes them as several passes over the residual stream; pallas anywhere (off a GPU through
    Pallas's interpreter: slow, for checking the kernels). Both need Pallas's Triton backend, which jax 0.11
    deprecated: without it auto runs XLA's ops and pallas is refused."""
    if cfg.norm == "pallas" and not triton_available():
        raise UserError(f"model.norm=pallas needs Pallas's Triton backend, which jax {jax.__version__} does not "
                        f"have; use model.norm=auto (XLA's ops here) or a jax that has it")
    return cfg.norm == "pallas" or (cfg.norm == "auto" and backend() == "gpu" and triton_available())


def ones_width(tma_kernel: bool) -> int:
    """The bias row's ones columns in a Linear's input (fused_norm writes them): a whole tile of 64 where a kernel
    moves that input or its gradient by TMA, which takes rows in whole tiles only; else autocast.BIAS_ROW_PAD."""
    return HOPPER_GEMM_TILE if tma_kernel else BIAS_ROW_PAD


# The first jaxlib whose XLA:CPU hands oneDNN a bf16 dot's bf16 operands and result as they are: 0.10.2 converts them
# to fp32 around it (c_fc's dot 48 ms, against 4.3 on 0.11.0 and 4.4 on 0.12.0.1: benchmarks/NOTES.md, CPU step 15),
# and its oneDNN fp32 dots crashed a run (CPU step 6; 0.12.0.1's ran it).
ONEDNN_BF16_JAXLIB = (0, 11)


# The CPU features oneDNN runs bf16 matmuls on, as /proc/cpuinfo's flags name them (benchmarks.run names the machine
# by them too): AMX's bf16 tiles (Intel Xeon from Sapphire Rapids on) and AVX-512's bf16 dot products (AMD from Zen 4,
# Intel from Cooper Lake), brg_matmul:avx512_core_bf16 in ONEDNN_VERBOSE's words.
BF16_MATMUL_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX-512 bf16"}


def jaxlib_takes_onednn_dots() -> bool:
    """Whether this jaxlib is one jaxtrain asks for oneDNN's dots on (ONEDNN_BF16_JAXLIB or later)."""
    return tuple(int(part) for part in jaxlib.__version__.split(".")[:2]) >= ONEDNN_BF16_JAXLIB


def onednn_dots(cfg: ModelConfig, precision: str) -> bool:
    """Whether XLA:CPU runs the step's dots as oneDNN's (model.cpu_dots), under bf16 each writing its bf16 result
    (autocast.onednn_dots): auto on a CPU with bf16 matmul units (BF16_MATMUL_FLAGS) under a jaxlib from
    ONEDNN_BF16_JAXLIB, for bf16 and fp32. Measured on configs/small.yaml (benchmarks/NOTES.md, CPU steps 15 and 19):
    on an AMX Xeon, where XLA's default dots (YNNPACK) reach a quarter of oneDNN's rate on the Linears' shapes, the
    bf16 step 33% faster and the fp32 one 24%; on an AMD EPYC (Zen 4, AVX-512 bf16) 4% and 24%. Not fp16 (no fp16
    units to measure on), nor a CPU without bf16 units, whose oneDNN bf16 dots would be emulated: unmeasured."""
    possible = precision in ("bf16", "fp32") and backend() == "cpu" and jaxlib_takes_onednn_dots()
    if cfg.cpu_dots == "onednn" and not possible:
        raise UserError(f"model.cpu_dots=onednn needs train.precision=bf16 or fp32 on a CPU and jaxlib >= 0.11 "
                        f"(Python >= 3.12), whose XLA hands oneDNN bf16 dots as they are (got {precision} on "
                        f"{backend()}, jaxlib {jaxlib.__version__}); use model.cpu_dots=auto")
    return cfg.cpu_dots == "onednn" or (cfg.cpu_dots == "auto" and possible and _cpu_has_bf16_matmul_units())


@functools.cache
def _cpu_has_bf16_matmul_units() -> bool:
    """Whether this machine's CPU has one of BF16_MATMUL_FLAGS (Linux's /proc/cpuinfo; elsewhere taken as not)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return bool(bf16_matmul_units(cpuinfo.read()))
    except OSError:
        return False


def bf16_matmul_units(cpuinfo: str) -> list[str]:
    """The names of the BF16_MATMUL_FLAGS that /proc/cpuinfo's text lists for its first processor."""
    flags = cpuinfo_fields(cpuinfo).get("flags", "").split()
    return [name for flag, name in BF16_MATMUL_FLAGS.items() if flag in flags]


def cpuinfo_fields(cpuinfo: str) -> dict[str, str]:
    """The first processor's `key: value` fields of /proc/cpuinfo's text ("model name", "flags", ...)."""
    return {key.strip(): value.strip() for key, value in
            (line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines() if ":" in line)}
