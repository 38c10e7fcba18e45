"""What each instruction of an optimized HLO module's text is (a matmul, attention, one of jaxtrain's kernels, a
collective, a reduction, data movement or elementwise work), for benchmarks.profile's and benchmarks.roofline's
categories."""

import collections
import re

# fused_norm's residual-add-and-LayerNorm kernels, by their kernels' names
NORM_KERNEL = re.compile(r"_norm_(forward|backward)_kernel")

DATA_MOVEMENT = {"parameter", "copy", "transpose", "bitcast", "reshape", "slice", "concatenate", "convert",
                 "broadcast", "constant", "tuple", "get-tuple-element", "dynamic-slice", "dynamic-update-slice"}
CONTROL = {"while", "conditional", "call", "custom-call"}
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "all-reduce-start",
               "all-gather-start", "collective-permute-start"}


def hlo_categories(hlo: str) -> dict[str, str]:
    """Instruction name -> category for each instruction of an optimized HLO module's text; a fusion by the ops of
    the computation it calls: any dot (or a cuBLAS call, or one of jaxtrain's gemms: kernel_op) -> matmul, a cuDNN
    attention call -> attention, one of jaxtrain's norm kernels -> norm kernels, a cross-device op -> collective,
    any reduce -> reduction, only data movement (copies, transposes, converts, slices) -> copy/transpose, else
    elementwise."""
    ops_in, current = collections.defaultdict(set), None
    instructions = []
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            current = (re.match(r"(?:ENTRY )?%?([\w.\-]+)", line) or [None, None])[1]
            continue
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?[\]\)}] ([a-z\-]+)\(", line)
        if match and current:
            opcode = kernel_op(line) if match[2] == "custom-call" else match[2]
            ops_in[current].add(opcode)
            instructions.append((match[1], opcode, re.search(r"calls=%?([\w.\-]+)", line), line))
    by_name = {}
    for name, opcode, calls, line in instructions:
        ops = ops_in[calls[1]] if calls else {opcode}
        by_name[name] = ("attention" if "fmha" in line else
                         "matmul" if ops & {"dot", "convolution", "hopper-gemm"} or "__cublas" in line else
                         "norm kernels" if "norm-kernel" in ops else
                         "collective" if ops & COLLECTIVES else
                         "other" if ops & CONTROL else
                         "reduction" if ops & {"reduce", "reduce-window"} else
                         "copy/transpose" if ops <= DATA_MOVEMENT else "elementwise")
    return by_name


def kernel_op(line: str) -> str:
    """A custom call's line -> "hopper-gemm" for one of jaxtrain's gemms (hopper_gemm), "norm-kernel" for one of
    its norm kernels (fused_norm), else "custom-call"."""
    return ("hopper-gemm" if hopper_gemm(line) else
            "norm-kernel" if NORM_KERNEL.search(line) else "custom-call")


def hopper_gemm_scope() -> str:
    from jaxtrain.hopper_gemm import SCOPE  # here, not at the top: this module starts without jax
    return SCOPE


def hopper_gemm(line: str) -> re.Match | None:
    """An HLO instruction's line -> the match of hopper_gemm's scope in its op_name (group 1: the pairs of a kernel
    of several, None for one) where it is a Mosaic GPU custom call in that scope (one of jaxtrain's gemms)."""
    if 'custom_call_target="mosaic_gpu' not in line:
        return None
    return re.search(rf'op_name="[^"]*/{hopper_gemm_scope()}(?:_pairs(\d+))?/', line)
