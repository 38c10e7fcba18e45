"""Where jaxtrain's train step spends its time: a profiler trace of a few steps, summed by op.

    python -m benchmarks.profile --config configs/small.yaml [--steps 3] [--top 25] [--synthetic] [--section.key=v ...]

Traces `--steps` warm steps with jax.profiler and reads the trace back (jax.profiler.ProfileData): for each
timeline of the device (GPU: XLA's ops and the kernels on each stream; CPU: the runtime's threads), the ops with
the most time, and a breakdown into matmuls, attention, data movement, reductions and elementwise work. An op that
is an instruction of the step's optimized HLO is put in its category by what it computes (a fusion by the ops it
fuses: on a CPU, YNNPACK's `ynn_fusion`s hold dots and elementwise work alike); a GPU kernel, by its name. Times are
summed over the traced steps and divided by their number. On a CPU, also how long the runtime's threads were in ops
at once (none, one, both), and which ops ran alone: a dot split over the cores is named on one thread only. On a GPU
that benchmarks.roofline knows, also each HLO instruction's kernels beside the roofline's estimate of it in the same
compiled program: how far each gemm and pass runs from its roofline.
"""

if __name__ == "__main__":  # the step as benchmarks.run times it and jaxtrain.run trains it: malloc on huge pages
    from jaxtrain import hostmem
    hostmem.use_huge_pages()

import argparse
import collections
import glob
import re
import sys
import tempfile

from benchmarks import roofline
from benchmarks.hlo_ops import NORM_KERNEL, hlo_categories
from jaxtrain.cmdline import CONFIG_FLAGS_HELP, positive_int
from jaxtrain.errors import OneLineParser, exit_on_user_error

# Op and kernel names -> what they are; the first pattern that matches wins. jaxtrain's own kernels are named for it:
# fused_norm's residual-add-and-LayerNorm kernels (hlo_ops.NORM_KERNEL), hopper_gemm's gemms (kernel_name: "gemm_"
# and the option's key).
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


def summarize(path: str, hlo: str, steps: int, top: int, target: tuple | None = None) -> str:
    """The trace's timelines, each op's time summed; on a GPU whose `target` (roofline_target) is known, also each
    HLO instruction's kernels against the roofline's estimate for the same compiled program (against_roofline)."""
    from jax.profiler import ProfileData
    by_hlo = hlo_categories(hlo)
    out = []
    for plane in ProfileData.from_file(path).planes:
        if not (plane.name.startswith("/device:") or plane.name == "/host:CPU"):
            continue
        if plane.name.startswith("/device:GPU"):
            streams = [line for line in plane.lines if line.name.startswith("Stream")]
            out.append(against_roofline(*by_instruction(streams, steps), hlo, target, top) if target else
                       "\nno roofline beside the kernels: benchmarks.roofline has no device spec or bf16 peak for "
                       "this GPU")
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


def by_instruction(lines, steps: int) -> tuple[collections.Counter, collections.Counter]:
    """(ms a step, kernels a step) by the HLO instruction that launched them (each kernel event's `hlo_op` stat,
    which XLA sets), over the given timelines: an instruction may launch several kernels (cuDNN's attention, a split
    gemm)."""
    ms, kernels = collections.Counter(), collections.Counter()
    for line in lines:
        for event in line.events:
            op = dict(event.stats).get("hlo_op")
            if op:
                ms[op] += event.duration_ns / 1e6 / steps
                kernels[op] += 1 / steps
    return ms, kernels


def instruction_rows(ms: collections.Counter, kernels: collections.Counter, hlo: str, target: tuple,
                     top: int) -> list[dict]:
    """The `top` HLO instructions with the most measured time a step, each with benchmarks.roofline's estimate for it
    in the same program (target: the GPU's name, nominal bf16 FLOP/s and memory bandwidth, roofline_target) and
    the TFLOP/s and GB/s it reached; None for those where the roofline has no estimate."""
    _, peak, bandwidth = target
    estimate = collections.defaultdict(lambda: dict(ms=0.0, flops=0.0, bytes=0.0, category="other"))
    for row in roofline.roofline(hlo, peak, bandwidth):  # an instruction in a loop: one row, launches a step
        e = estimate[row["name"]]
        e["category"] = row["category"]
        for key in ("ms", "flops", "bytes"):
            e[key] += row[key] * row["launches"]
    rows = []
    for op, took in ms.most_common(top):
        e = estimate.get(op) or dict(ms=0.0, category="not in the roofline")
        known = e["ms"] > 0
        rows.append(dict(op=op, category=e["category"], kernels=kernels[op], ms=took,
                         roofline_ms=e["ms"] if known else None, ratio=took / e["ms"] if known else None,
                         tflops=e["flops"] / took / 1e9 if known else None,
                         gbps=e["bytes"] / took / 1e6 if known else None))
    return rows


def against_roofline(ms: collections.Counter, kernels: collections.Counter, hlo: str, target: tuple, top: int) -> str:
    """instruction_rows as a table: which gemms and passes run furthest from their roofline."""
    name, peak, bandwidth = target
    if not ms:
        return "\nno roofline beside the kernels: no kernel in the trace names its HLO instruction (hlo_op)"
    lines = [f"\nby HLO instruction, against the roofline ({name}: {peak / 1e12:.0f} TFLOP/s, "
             f"{bandwidth / 1e12:.2f} TB/s):",
             "| instruction | category | kernels a step | ms a step | roofline ms | measured / roofline | TFLOP/s | "
             "GB/s |", "|---|---|---|---|---|---|---|---|"]
    cell = lambda value, form: "" if value is None else format(value, form)
    for r in instruction_rows(ms, kernels, hlo, target, top):
        lines.append(f"| {r['op']} | {r['category']} | {r['kernels']:g} | {r['ms']:.2f} | "
                     f"{cell(r['roofline_ms'], '.2f')} | {cell(r['ratio'], '.2f')} | {cell(r['tflops'], '.0f')} | "
                     f"{cell(r['gbps'], '.0f')} |")
    return "\n".join(lines)


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
    ap = OneLineParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0],
                       epilog=CONFIG_FLAGS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--top", type=positive_int, default=25)
    ap.add_argument("--synthetic", action="store_true")
    return ap


def roofline_target(cfg) -> tuple | None:
    """On a GPU whose XLA device spec benchmarks.roofline has (roofline.gpu_target), (its name there, the nominal
    FLOP/s of cfg's MFU, its memory bandwidth); None elsewhere."""
    import jax
    from jaxtrain import metrics
    kind = jax.devices()[0].device_kind
    name = roofline.gpu_target(kind) if jax.default_backend() == "gpu" else None
    peak = metrics.peak_flops(cfg, kind)
    return None if name is None or peak is None else (name, peak, roofline.memory_bandwidth(name))


def main(argv: list[str]) -> None:
    args, rest = parser().parse_known_args(argv)
    from benchmarks.run import resolved_config
    cfg = resolved_config(rest, args.synthetic)
    with tempfile.TemporaryDirectory(prefix="jaxtrain-profile-") as folder:  # removed once the trace is read
        traced = trace_steps(cfg, args.synthetic, args.steps, folder)
        print(summarize(*traced, args.steps, args.top, roofline_target(cfg)))


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
