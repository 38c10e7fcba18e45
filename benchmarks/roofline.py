"""Where the train step's time goes on a GPU, estimated from its compiled HLO: no GPU needed.

    python -m benchmarks.roofline --config configs/gpt2-124m.yaml [--target h100] [--top 25] [--json out.json]
                                  [--section.key=value ...]

Compiles the run's train step (jaxtrain.dryrun.compiled_step: the config's batch and micro-batches) for a GPU: the
local one where jax has one, else ahead of time for `--target` through jax's CUDA plugin and a target description
(jaxtrain/target_devices.py: XLA's device spec, plus the cuDNN and CUDA versions of the installed nvidia wheels). Every
kernel of the optimized module gets a roofline time, max(flops / peak, bytes / bandwidth), and the kernels are
summed by category (benchmarks/profile.py's hlo_categories). An estimate: a lower bound per kernel that ignores
launch gaps, caches and occupancy (benchmarks/NOTES.md compares it with a measured H100 profile).
"""

import argparse
import collections
import json
import math
import re
import sys

from benchmarks.hlo_ops import hlo_categories, hopper_gemm
from jaxtrain import target_devices
from jaxtrain.cmdline import CONFIG_FLAGS_HELP, output_file, positive_int
from jaxtrain.errors import OneLineParser, UserError, exit_on_user_error

MODEL = ('bytes = operand + result sizes (a fusion parameter read only through slice, dynamic-slice or gather, '
         'directly or through converts, counts those results; an in-place dynamic-update-slice counts its update and '
         "what else reads its buffer, not the whole buffer; cuBLAS/cuDNN workspaces excluded); flops = 2*M*N*K per "
         "dot, cuBLAS call or pair of jaxtrain's Mosaic GPU gemms (hopper_gemm), cuDNN attention 4*B*H*T*L*D/2 "
         "(causal) forward and 2.5x that backward, elementwise flops ignored; a while body's kernels count its "
         "known_trip_count times (once if XLA does not know it), a conditional its costliest branch")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
        "replica-id", "opt-barrier", "add-dependency"}
SLICING = {"slice", "dynamic-slice", "gather"}


Inst = collections.namedtuple("Inst", "name shape op operands attrs root calls")  # an instruction of the module


def shapes(text: str) -> list[tuple[str, list[int]]]:
    return [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in SHAPE.findall(text)]


def nbytes(text: str, skip_workspace: bool = False) -> int:
    found = shapes(text)
    if skip_workspace and len(found) > 1:  # a custom call's (result..., s8/u8 workspace) tuple
        found = [s for s in found if s[0] not in ("s8", "u8")]
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in found)


def parse(hlo: str) -> tuple[dict[str, dict[str, Inst]], str]:
    """Computations of an optimized module's text (name -> instructions by name) and the entry's name."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and not line.startswith("HloModule"):
            is_entry, current = re.match(r"(ENTRY )?%?([\w.\-]+)", line).groups()
            comps[current] = {}
            entry = current if is_entry else entry
            continue
        match = re.match(r"\s+(ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(([^)]*)\)(.*)$", line)
        if current and match:
            root, name, shape, op, args, attrs = match.groups()
            calls = re.search(r"calls=%?([\w.\-]+)", attrs)
            comps[current][name] = Inst(name, shape, op, re.findall(r"%([\w.\-]+)", args), attrs, bool(root),
                                        calls and calls[1])
    return comps, entry


def fused_ops(comps, name: str) -> collections.Counter:
    """Opcodes of a fused computation and of the computations it nests."""
    ops = collections.Counter(inst.op for inst in comps.get(name, {}).values())
    return sum((fused_ops(comps, i.calls) for i in comps.get(name, {}).values() if i.calls), ops)


def operand_shapes(comps, comp: str, inst: Inst) -> list[str]:
    """The shapes of an instruction's operands in computation `comp`."""
    return [comps[comp][o].shape for o in inst.operands if o in comps[comp]]


def fused_flops(comps, name: str) -> float:
    """FLOPs of the dots in computation `name` and in those it calls, and of its custom calls (jax 0.11's XLA fuses a
    Mosaic GPU kernel with the slices of its operands: the kernel reads them where they lie; the bytes are the
    fusion's)."""
    total = 0
    for inst in comps.get(name, {}).values():
        if inst.op == "dot":
            lhs = shapes(comps[name][inst.operands[0]].shape)[0][1]
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)[1]
            total += 2 * math.prod(shapes(inst.shape)[0][1]) * math.prod(lhs[int(d)] for d in contracting.split(","))
        elif inst.op == "custom-call":
            total += call_flops(inst, operand_shapes(comps, name, inst))
        total += fused_flops(comps, inst.calls) if inst.calls else 0
    return total


def fusion_bytes(comps, inst: Inst) -> int:
    """Bytes a fusion reads and writes, slice- and in-place-aware (MODEL)."""
    body = comps[inst.calls]
    users = collections.defaultdict(list)
    for i in body.values():
        for operand in i.operands:
            users[operand].append(i)
    root = next(i for i in body.values() if i.root)
    written, in_place = 0, set()
    for out in ([body[o] for o in root.operands] if root.op == "tuple" else [root]):
        while out.op == "bitcast" and out.operands[0] in body:
            out = body[out.operands[0]]
        if out.op == "dynamic-update-slice":
            in_place.add(out.operands[0])
            written += nbytes(body[out.operands[1]].shape)
        else:
            written += nbytes(out.shape)
    for name in in_place:  # updated where it lies: what the fusion reads of it is what its other users read
        users[name] = [user for user in users[name] if not (user.op == "dynamic-update-slice"
                                                             and user.operands[0] == name)]
    read = 0
    for param in (i for i in body.values() if i.op == "parameter" and (i.name not in in_place or users[i.name])):
        full, dtype = nbytes(param.shape), shapes(param.shape)[0][0]
        elements = sliced_elements(users, param.name)
        read += full if elements is None else min(full, elements * DTYPE_BYTES[dtype])
    return read + written


def sliced_elements(users, name: str) -> int | None:
    """How many elements of `name` a fusion reads when only slices, dynamic-slices and gathers read it, directly or
    through converts and bitcasts (one element in, one out: a gather of converted logits reads only the gathered
    ones); None when some other op reads it whole."""
    if not users[name]:
        return None
    total = 0
    for user in users[name]:
        if user.op in SLICING and user.operands[0] == name:
            total += sum(math.prod(dims) for _, dims in shapes(user.shape))
        elif user.op in ("convert", "bitcast"):
            through = sliced_elements(users, user.name)
            if through is None:
                return None
            total += through
        else:
            return None
    return total


def kernel_cost(comps, comp: str, inst: Inst) -> tuple[int, float]:
    """(bytes, flops) of one kernel (MODEL)."""
    if inst.op == "fusion":
        return fusion_bytes(comps, inst), fused_flops(comps, inst.calls)
    operands = operand_shapes(comps, comp, inst)
    moved = sum(nbytes(s) for s in operands) + nbytes(inst.shape, skip_workspace=inst.op == "custom-call")
    return moved, call_flops(inst, operands)


def call_flops(inst: Inst, operands: list[str]) -> float:
    """FLOPs of a custom call (MODEL), given its operands' shapes; 0 for any other instruction."""
    target = (re.search(r'custom_call_target="([^"]*)"', inst.attrs) or ["", ""])[1]
    if "__cublas" in target:
        lhs = shapes(operands[0])[0][1]
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)[1]
        k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting))
        return 2 * math.prod(shapes(inst.shape)[0][1]) * k
    gemm = hopper_gemm(inst.attrs)
    if gemm:  # operands (m, k) and (k, n) first (a wider a: its first k columns), of p pairs p of each
        pairs = int(gemm[1] or 1)
        m, (k, n) = shapes(operands[0])[0][1][0], shapes(operands[pairs])[0][1]
        return 2 * m * k * n * pairs
    if "fmha" in target:  # operands (B, T, H, D) queries and (B, L, H, D) keys; causal: half the T x L scores
        (b, t, h, d), length = shapes(operands[0])[0][1], shapes(operands[1])[0][1][1]
        return 4 * b * h * t * length * d / 2 * (2.5 if "Backward" in target else 1)
    return 0


def trips(inst: Inst) -> int:
    """How many times a while loop runs its body: XLA's known_trip_count, once where XLA does not know it."""
    return int((re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs) or [0, 1])[1])


def called(inst: Inst, key: str) -> str:
    """The computation an instruction names under `key` (a while's body or condition, a call's to_apply)."""
    return re.search(key + r"=%?([\w.\-]+)", inst.attrs)[1]


def branches(inst: Inst) -> list[str]:
    """A conditional's branch computations."""
    return re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)[1])


def kernels(comps, comp: str, categories: dict, peak: float, bandwidth: float, launches: int = 1) -> list[dict]:
    """One row per kernel instruction run by `comp`, with `launches` per step; loops and branches followed."""
    rows = []
    for inst in comps[comp].values():
        if inst.op == "while":
            for key, n in (("body", trips(inst)), ("condition", trips(inst) + 1)):
                rows += kernels(comps, called(inst, key), categories, peak, bandwidth, launches * n)
        elif inst.op == "conditional":
            rows += max((kernels(comps, b, categories, peak, bandwidth, launches) for b in branches(inst)),
                        key=lambda ks: sum(k["ms"] * k["launches"] for k in ks))
        elif inst.op == "call":
            rows += kernels(comps, called(inst, "to_apply"), categories, peak, bandwidth, launches)
        elif inst.op not in FREE and not inst.op.endswith("-done"):
            moved, flops = kernel_cost(comps, comp, inst)
            ops = fused_ops(comps, inst.calls) if inst.calls else collections.Counter([inst.op])
            category = categories.get(inst.name, "other")
            if category == "copy/transpose" and "convert" in ops:
                category = "convert"
            fuses = [op for op, _ in ops.most_common() if op not in FREE | {"broadcast"}]
            rows.append(dict(name=inst.name, category=category, launches=launches, bytes=moved, flops=flops,
                             ms=max(flops / peak, moved / bandwidth) * 1e3, fuses=",".join(fuses[:8]),
                             memory_bound=moved / bandwidth > flops / peak,
                             op_name=(re.search(r'op_name="([^"]*)"', inst.attrs) or ["", ""])[1]))
    return rows


def roofline(hlo: str, peak: float, bandwidth: float) -> list[dict]:
    comps, entry = parse(hlo)
    return kernels(comps, entry, hlo_categories(hlo), peak, bandwidth)


def category_table(rows: list[dict]) -> tuple[str, dict]:
    sums = collections.defaultdict(lambda: dict(launches=0, gb=0.0, tflop=0.0, ms=0.0))
    for r in rows:
        for key in (r["category"], "total"):
            s = sums[key]
            s["launches"] += r["launches"]
            s["gb"] += r["launches"] * r["bytes"] / 1e9
            s["tflop"] += r["launches"] * r["flops"] / 1e12
            s["ms"] += r["launches"] * r["ms"]
    lines = ["| category | kernel launches per step | GB moved | TFLOP | roofline ms | share |",
             "|---|---|---|---|---|---|"]
    for name, s in sorted(sums.items(), key=lambda kv: (kv[0] == "total", -kv[1]["ms"])):
        bold = "**" if name == "total" else ""
        lines.append(f"| {bold}{name}{bold} | {s['launches']:,} | {s['gb']:,.2f} | {s['tflop']:,.2f} | "
                     f"{bold}{s['ms']:,.2f}{bold} | {s['ms'] / sums['total']['ms']:.0%} |")
    return "\n".join(lines), dict(sums)


def top_table(rows: list[dict], top: int) -> tuple[str, list[dict]]:
    """The memory-bound kernels with the most roofline time per step; the same fusion in each layer is one row."""
    groups = {}
    for r in (r for r in rows if r["memory_bound"]):
        key = (r["category"], r["fuses"], r["op_name"], r["bytes"])
        g = groups.setdefault(key, dict(r, launches=0, ms_per_step=0.0))
        g["launches"] += r["launches"]
        g["ms_per_step"] += r["launches"] * r["ms"]
    best = sorted(groups.values(), key=lambda g: -g["ms_per_step"])[:top]
    lines = ["| ms per step | launches | MB per launch | category | fuses | JAX op_name |", "|---|---|---|---|---|---|"]
    lines += [f"| {g['ms_per_step']:.2f} | {g['launches']} | {g['bytes'] / 1e6:,.0f} | {g['category']} | "
              f"{g['fuses']} | {g['op_name'][-90:]} |" for g in best]
    return "\n".join(lines), best


def require_compiler(target: str) -> None:
    """Let jax compile for `target` (target_devices.allow_compile_only); where jax's compiler for it is missing, one
    line naming the package to install, exit code 2."""
    if not target_devices.compiler_installed(target):
        compiler = "jax's CUDA plugin" if target in target_devices.GPUS else "libtpu"
        raise UserError(f"compiling for {target} needs {compiler}, which is not installed; fix: "
                        f"{target_devices.install_fix(target)}")
    target_devices.allow_compile_only(target)


# Device names CUDA reports for a card whose XLA spec names it otherwise: an H200 SXM is "NVIDIA H200 141GB HBM3e"
# in XLA's spec and in cudaGetDeviceProperties on some drivers, "NVIDIA H200" on others (the device tool's H200).
SHORT_KINDS = {"NVIDIA H200": "NVIDIA H200 141GB HBM3e"}


def gpu_target(device_kind: str) -> str | None:
    """The GPU target whose XLA device spec names this device kind (jax's device_kind), None for none."""
    spec_name = SHORT_KINDS.get(device_kind, device_kind)
    return next((t for t in target_devices.GPUS
                 if f'device_description_str: "{spec_name}"' in target_devices.device_spec(t)), None)


def memory_bandwidth(target: str) -> float:
    """A GPU target's memory bandwidth, bytes/s, from its XLA device spec."""
    return float(re.search(r"memory_bandwidth: (\d+)", target_devices.device_spec(target))[1])


def local_target(device_kind: str) -> str:
    """The GPU target of this machine's GPU, whose memory bandwidth its estimate takes (--target's was taken: an
    H200's memory-bound kernels estimated at an H100's 3.35 TB/s)."""
    target = gpu_target(device_kind)
    if target is None:
        known = ", ".join(target_devices.GPUS)
        raise UserError(f"this machine's GPU, {device_kind}, has none of the XLA device specs ({known}), so its "
                        f"memory bandwidth is unknown; estimate on a machine without a GPU, with --target")
    return target


def compile_step(cfg, target: str):
    """(the compiled train step, the device in words, its GPU target): for the local GPU (its own target), else
    ahead of time for `target`."""
    require_compiler(target)
    import jax
    from jaxtrain import autocast, checkpoint, dryrun, mesh as mesh_lib
    if jax.default_backend() == "gpu":
        devices = jax.devices()
        kind = devices[0].device_kind
        target = local_target(kind)
    else:
        devices = target_devices.devices(target, 1)
        kind = f"{devices[0].device_kind} (compiled ahead of time on a {jax.default_backend()}, no GPU)"
    mesh = mesh_lib.make_mesh(cfg, devices)
    with autocast.compiling_for("gpu"):
        state = checkpoint.abstract_state(cfg, cfg.model.vocab_size, mesh)
        return dryrun.compiled_step(cfg, state, mesh), kind, target


def main(argv: list[str]) -> None:
    ap = OneLineParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n\n")[0],
                       epilog=CONFIG_FLAGS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h100", choices=target_devices.GPUS,
                    help="the GPU to compile for when this machine has none")
    ap.add_argument("--top", type=positive_int, default=25, help="rows of the memory-bound kernels' table")
    ap.add_argument("--json", type=output_file, help="also write the results here")
    ap.add_argument("--hlo", type=output_file, help="also write the compiled step's optimized HLO text here")
    args, rest = ap.parse_known_args(argv)
    from benchmarks.run import resolved_config
    from jaxtrain import config as config_lib, metrics
    cfg = config_lib.load(rest + ["--run.dry_run=true"])  # a dry run's: no data is read when the vocab is known
    cfg = resolved_config(rest, synthetic=False) if cfg.model.vocab_size is None else cfg
    compiled, kind, target = compile_step(cfg, args.target)
    peak = metrics.peak_flops(cfg, kind)
    if peak is None:
        raise UserError(f"no nominal bf16 peak known for {kind}; set --log.peak_tflops")
    bandwidth = memory_bandwidth(target)
    rows = roofline(compiled.as_text(), peak, bandwidth)
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
    categories, sums = category_table(rows)
    top, best = top_table(rows, args.top)
    peak_gib = compiled.memory_analysis().peak_memory_in_bytes / 2**30
    print(f"{kind}; batch {cfg.data.batch_size} x seq {cfg.model.seq_len} in {cfg.optim.grad_accum_steps} "
          f"micro-batches; XLA memory_analysis peak {peak_gib:.2f} GiB\nESTIMATE: per kernel max(flops / "
          f"{peak / 1e12:.0f} TFLOP/s dense bf16, bytes / {bandwidth / 1e12:.2f} TB/s ({target})); {MODEL}\n")
    print(f"{categories}\n\ntop {args.top} memory-bound kernels:\n\n{top}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": kind, "config": rest, "peak_flops": peak, "bandwidth": bandwidth,
                       "peak_memory_bytes": peak_gib * 2**30, "categories": sums, "top": best}, f, indent=1)


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
