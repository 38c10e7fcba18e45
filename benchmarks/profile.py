"""Where jaxtrain's train step spends its time: a profiler trace of a few steps, summed by op.

    python -m benchmarks.profile --config configs/small.yaml [--steps 3] [--top 25] [--synthetic] [--section.key=v ...]

Traces `--steps` warm steps with jax.profiler and reads the trace back (jax.profiler.ProfileData): for each
timeline of the device (GPU: XLA's ops and the kernels on each stream; CPU: the runtime's threads), the ops with
the most time, and a breakdown into matmuls, attention, data movement, reductions and elementwise work. An op that
is an instruction of the step's optimized HLO is put in its category by what it computes (a fusion by the ops it
fuses: on a CPU, YNNPACK's `ynn_fusion`s hold dots and elementwise work alike); a GPU kernel, by its name. Times are
summed over the traced steps and divided by their number.
"""

import argparse
import collections
import glob
import re
import sys
import tempfile

from jaxtrain.cmdline import CONFIG_FLAGS_HELP, positive_int
from jaxtrain.errors import exit_on_user_error

# Op and kernel names -> what they are; the first pattern that matches wins. jaxtrain's own kernels are named for it:
# fused_norm's residual-add-and-LayerNorm kernels, hopper_gemm's gemms (kernel_name: "gemm_" and the option's key).
NORM_KERNEL = re.compile(r"_norm_(forward|backward)_kernel")
CATEGORIES = [
    ("norm kernels", NORM_KERNEL),
    ("attention", re.compile(r"cudnn.*(fmha|flash|attn)|fmha|flash|dot_product_attention|custom-call.*cudnn", re.I)),
    ("matmul", re.compile(r"gemm|cublas|matmul|dot|sm90_xmma|nvjet|cutlass", re.I)),
    ("copy/transpose", re.compile(r"copy|transpose|bitcast", re.I)),
    ("reduction", re.compile(r"reduce|reduction", re.I)),
    ("loop/elementwise fusion", re.compile(r"fusion|loop", re.I)),
]


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


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


def trace_steps(cfg, synthetic: bool, steps: int, folder: str) -> tuple[str, str]:
    """Runs two warm-up steps, then `steps` traced ones into `folder`: the path of the trace's .xplane.pb, and the
    step's optimized HLO."""
    import jax
    from benchmarks import steps as steps_lib, workers
    timed = steps_lib.jaxtrain(cfg, workers.tokens(cfg, synthetic))
    timed.step(), timed.step()
    with jax.profiler.trace(folder):
        for _ in range(steps):
            timed.step()
    return glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0], timed.program()


def summarize(path: str, hlo: str, steps: int, top: int) -> str:
    from jax.profiler import ProfileData
    by_hlo = hlo_categories(hlo)
    out = []
    for plane in ProfileData.from_file(path).planes:
        if not (plane.name.startswith("/device:") or plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            totals = collections.Counter()
            for event in line.events:
                if not event.name.startswith("ThunkExecutor::Execute"):  # XLA:CPU's span around the ops below it
                    totals[event.name] += event.duration_ns / 1e6 / steps
            if sum(totals.values()) < 1.0 or line.name == "python":
                continue
            by_category = collections.Counter()
            for name, ms in totals.items():
                by_category[by_hlo.get(name) or category(name)] += ms
            out.append(f"\n{plane.name} / {line.name}: {sum(totals.values()):,.1f} ms per step\n  " + ", ".join(
                f"{label} {ms:,.1f}" for label, ms in by_category.most_common()))
            out += [f"    {ms:9.2f} ms  {name[:110]}" for name, ms in totals.most_common(top)]
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """This tool's own flags; the rest (--config, --section.key=value) go to config.load."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.splitlines()[0],
                                 epilog=CONFIG_FLAGS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--top", type=positive_int, default=25)
    ap.add_argument("--synthetic", action="store_true")
    return ap


def main(argv: list[str]) -> None:
    args, rest = parser().parse_known_args(argv)
    from benchmarks.run import resolved_config
    cfg = resolved_config(rest, args.synthetic)
    with tempfile.TemporaryDirectory(prefix="jaxtrain-profile-") as folder:  # removed once the trace is read
        print(summarize(*trace_steps(cfg, args.synthetic, args.steps, folder), args.steps, args.top))


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
