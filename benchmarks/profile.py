"""Where jaxtrain's train step spends its time: a profiler trace of a few steps, summed by op.

    python -m benchmarks.profile --config configs/small.yaml [--steps 3] [--top 25] [--synthetic] [--section.key=v ...]

Traces `--steps` warm steps with jax.profiler and reads the trace back (jax.profiler.ProfileData): for each
timeline of the device (GPU: XLA's ops and the kernels on each stream; CPU: the runtime's threads), the ops with
the most time, and a breakdown into matmuls, attention, data movement, reductions and elementwise work. An op that
is an instruction of the step's optimized HLO is put in its category by what it computes (a fusion by the ops it
fuses: on a CPU, YNNPACK's `ynn_fusion`s hold dots and elementwise work alike); a GPU kernel, by its name. Times are
summed over the traced steps and divided by their number. On a CPU, also how long the runtime's threads were in ops
at once (none, one, both), and which ops ran alone: a dot split over the cores is named on one thread only.
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


# XLA:CPU's spans around the ops (the executor's) and its thread pool's own bookkeeping: not ops.
NOT_OPS = ("ThunkExecutor::Execute", "ThreadpoolListener", "SlinkyThreadPool")


def summarize(path: str, hlo: str, steps: int, top: int) -> str:
    from jax.profiler import ProfileData
    by_hlo = hlo_categories(hlo)
    out = []
    for plane in ProfileData.from_file(path).planes:
        if not (plane.name.startswith("/device:") or plane.name == "/host:CPU"):
            continue
        timelines = []
        for line in plane.lines:
            ops = [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events
                   if not e.name.startswith(NOT_OPS)]
            totals = collections.Counter()
            for start, end, name in ops:
                totals[name] += (end - start) / 1e6 / steps
            if sum(totals.values()) < 1.0 or line.name == "python":
                continue
            timelines.append(ops)
            by_category = by_category_of(totals, by_hlo)
            out.append(f"\n{plane.name} / {line.name}: {sum(totals.values()):,.1f} ms per step\n  " + ", ".join(
                f"{label} {ms:,.1f}" for label, ms in by_category.most_common()))
            out += [f"    {ms:9.2f} ms  {name[:110]}" for name, ms in totals.most_common(top)]
        if plane.name == "/host:CPU" and len(timelines) > 1:
            out.append(concurrency_line(timelines, by_hlo, steps))
    return "\n".join(out)


def by_category_of(by_op: collections.Counter, by_hlo: dict[str, str]) -> collections.Counter:
    """Times by op name summed by category: an instruction of the step's HLO by what it computes, else by its name."""
    by_category = collections.Counter()
    for name, time in by_op.items():
        by_category[by_hlo.get(name) or category(name)] += time
    return by_category


def concurrency(timelines: list[list[tuple[int, int, str]]]) -> tuple[collections.Counter, collections.Counter]:
    """(ns during which k of the timelines are in an op, for each k; ns during which one alone is, by the name of
    its innermost op): a sweep over each timeline's (start, end, name) ops, which may nest within a timeline."""
    points = sorted((t, is_end, i, name) for i, ops in enumerate(timelines) for start, end, name in ops
                    for t, is_end in ((start, False), (end, True)))
    stacks = [[] for _ in timelines]  # each timeline's open ops, innermost last
    by_count, alone = collections.Counter(), collections.Counter()
    last = points[0][0] if points else 0
    for t, is_end, i, name in points:
        running = [stack for stack in stacks if stack]
        by_count[len(running)] += t - last
        if len(running) == 1:
            alone[running[0][-1]] += t - last
        last = t
        if is_end:
            del stacks[i][len(stacks[i]) - 1 - stacks[i][::-1].index(name)]
        else:
            stacks[i].append(name)
    return by_count, alone


def concurrency_line(timelines, by_hlo: dict[str, str], steps: int) -> str:
    """How much of the traced time the CPU's threads spent in ops at once. XLA:CPU names an op on the thread that
    started it only: a dot that YNNPACK splits over the pool runs on the other threads too, unnamed there (a lone
    bf16 dot on this project's 2-core CPU runs twice as fast as under `taskset -c 0`), so an op alone is not a core
    idle; the categories say which ops run alone."""
    by_count, alone = concurrency(timelines)
    by_category = by_category_of(alone, by_hlo)
    ms = lambda ns: f"{ns / 1e6 / steps:,.1f}"
    return ("\nthreads in an op at once, ms per step: " + ", ".join(
        f"{k}: {ms(ns)}" for k, ns in sorted(by_count.items())) + "\n  one alone: " + ", ".join(
        f"{label} {ms(ns)}" for label, ns in by_category.most_common()))


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
