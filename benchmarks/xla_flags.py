"""Whether XLA flags change the compiled train step, and how, against XLA's defaults: no accelerator needed.

    python -m benchmarks.xla_flags --config configs/gpt-1b.yaml --target h100 --devices 8 --mesh.fsdp=8 \
        --flags="--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_while_loop_double_buffering=true" \
        [--each] [--all-but-each] [--json out.json] [--section.key=value ...]

Flag lists travel from recipe to recipe (MaxText's, NVIDIA's, blog posts) long after the XLA they were tuned for.
This compiles the config's train step (dryrun.compiled_step, the run's own) for `--devices` of `--target` (ahead of
time through jax's CUDA plugin or libtpu where this machine has no such device; `--target cpu`: fake CPU devices)
with XLA's defaults, with all of `--flags`, with `--each` with each flag alone, and with `--all-but-each` with all
of them but one, for each (flags that act only together). One row per compile:
- whether the optimized module differs from the defaults' at all (a flag that changes nothing is a default, does
  not apply to this step, or acts after the HLO: code generation, the runtime's streams, which a compile cannot
  show);
- the memory the step needs per device, the dry run's total (params, optimizer state, XLA's temporaries);
- on a GPU, the dot FLOPs the module runs per device and step (a flag that makes XLA recompute shows here);
- on a GPU, its collectives against the schedule: each asynchronous collective's transfer at the GPUs' NVLink
  bandwidth (a ring over its group, one host of up to 8 GPUs), set against the compute the schedule runs between
  its start and its done (benchmarks/roofline.py's per-kernel estimate); exposed is the part no compute covers.
  The step's compute estimate is the same rule's sum. ESTIMATES from the compiled schedule, not measurements;
- on a TPU, how many collectives XLA:TPU runs asynchronously (in its asynchronous collective fusions, overlapped
  with compute) and how many on their own.
The flags are compiler options of these compiles only (jax's `compiler_options`); a run takes them from XLA_FLAGS
(GPU) or LIBTPU_INIT_ARGS (TPU), which compile the same module (benchmarks/NOTES.md).
"""

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time

from benchmarks import roofline
from jaxtrain import target_devices
from jaxtrain.cmdline import CONFIG_FLAGS_HELP, output_file, output_folder, positive_int
from jaxtrain.errors import OneLineParser, UserError, exit_on_user_error

# NVLink bandwidth per GPU and direction, bytes/s (NVIDIA's datasheets give both directions: A100 600 GB/s,
# H100 and H200 SXM 900 GB/s).
NVLINK = {"a100-40gb": 300e9, "a100-80gb": 300e9, "h100": 450e9, "h200": 450e9}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DEFAULTS = "XLA's defaults"
TARGETS = ("cpu",) + target_devices.GPUS + tuple(target_devices.TPU_AXES)


def parse_flags(text: str) -> dict:
    """XLA flags as XLA_FLAGS writes them (`--name=value`, `--name` for true) -> compiler options."""
    options = {}
    for flag in text.split():
        name, _, value = flag.removeprefix("--").partition("=")
        if not flag.startswith("--") or not re.fullmatch(r"xla_\w+", name):
            raise UserError(f"{flag!r} is not an XLA flag; fix: spell it --xla_name=value")
        options[name] = {"": True, "true": True, "false": False}.get(value.lower(), value)
        if isinstance(options[name], str) and re.fullmatch(r"-?\d+", value):
            options[name] = int(value)
    return options


def group_size(attrs: str, devices: int) -> int:
    """How many devices a collective spans, from its replica groups: over axes of a device mesh
    (mesh['axis_0'=1,'axis_1'=8] {'axis_1'}), iota ([groups,size]<=[..]) or explicit ({{0,1,..},..}); all the
    `devices` where it names none ({})."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", mesh[1])}
        return math.prod(sizes[name] for name in re.findall(r"'(\w+)'", mesh[2]))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    if iota:
        return int(iota[2])
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    return len(explicit[1].split(",")) if explicit and explicit[1] else devices


def link_bytes(kind: str, result_bytes: int, n: int) -> float:
    """Bytes a device sends in a ring implementation of the collective over n devices (its result's size given)."""
    if n <= 1:
        return 0.0
    share = result_bytes * (n - 1) / n  # what the other n - 1 devices hold of the result
    sent = {"all-gather": share, "all-to-all": share, "all-reduce": 2 * share, "reduce-scatter": result_bytes * (n - 1)}
    return sent.get(kind, result_bytes)  # collective-permute: the result


def _runs(inst) -> tuple[str, int] | None:
    """(the computation a while loop or a call runs, how many times a step's one run of `inst` runs it), else None."""
    if inst.op == "while":
        return roofline.called(inst, "body"), roofline.trips(inst)
    return (roofline.called(inst, "to_apply"), 1) if inst.op == "call" else None


def _start_kind(comps, inst) -> str | None:
    """The collective an asynchronous start begins (`all-gather-start`, or `async-start` calling one), else None."""
    if inst.op.removesuffix("-start") in COLLECTIVES and inst.op.endswith("-start"):
        return inst.op.removesuffix("-start")
    if inst.op == "async-start" and inst.calls:
        root = next((i for i in comps[inst.calls].values() if i.root), None)
        return root.op if root is not None and root.op in COLLECTIVES else None
    return None


def schedule_cost(comps, comp: str, peak: float, bandwidth: float) -> tuple[float, float]:
    """(roofline ms, dot flops) of everything `comp` runs, loops counted their trips (roofline.kernel_cost)."""
    costs = [_cost(comps, comp, inst, peak, bandwidth) for inst in comps[comp].values()]
    return sum(ms for ms, _ in costs), sum(flops for _, flops in costs)


def _cost(comps, comp: str, inst, peak: float, bandwidth: float) -> tuple[float, float]:
    """(roofline ms, dot flops) of one instruction: a kernel's, or what a loop, call or conditional runs."""
    sub = _runs(inst)
    if sub:
        ms, flops = schedule_cost(comps, sub[0], peak, bandwidth)
        return sub[1] * ms, sub[1] * flops
    if inst.op == "conditional":  # its costliest branch, as roofline.kernels
        return max(schedule_cost(comps, branch, peak, bandwidth) for branch in roofline.branches(inst))
    if inst.op in roofline.FREE or inst.op.endswith(("-start", "-done")):
        return 0.0, 0.0
    moved, flops = roofline.kernel_cost(comps, comp, inst)
    return max(flops / peak, moved / bandwidth) * 1e3, flops


def overlapped(comps, comp: str, peak: float, bandwidth: float, link: float, devices: int,
               runs: int = 1) -> list[dict]:
    """Each asynchronous collective that `comp` (and the loops and calls it runs) starts: its transfer estimate and
    the compute estimate the schedule places between its start and its done, `runs` times per step."""
    found, pending = [], {}
    for inst in comps[comp].values():
        kind = _start_kind(comps, inst)
        if kind:
            pending[inst.name] = dict(kind=kind, n=group_size(inst.attrs, devices), covered_ms=0.0, runs=runs)
        elif inst.op.endswith("-done") and inst.operands and inst.operands[0] in pending:
            c = pending.pop(inst.operands[0])
            result = roofline.nbytes(inst.shape, skip_workspace=True)
            c["transfer_ms"] = link_bytes(c["kind"], result, c["n"]) / link * 1e3
            found.append(c)
        else:
            sub = _runs(inst)
            if sub:
                found += overlapped(comps, sub[0], peak, bandwidth, link, devices, runs * sub[1])
            ms = _cost(comps, comp, inst, peak, bandwidth)[0]
            for c in pending.values():
                c["covered_ms"] += ms
    return found


def gpu_collectives(hlo: str, peak: float, bandwidth: float, link: float, devices: int) -> dict:
    comps, entry = roofline.parse(hlo)
    found = overlapped(comps, entry, peak, bandwidth, link, devices)
    compute_ms, flops = schedule_cost(comps, entry, peak, bandwidth)
    return dict(compute_ms=compute_ms, tflop=flops / 1e12,
                collectives=sum(c["runs"] for c in found),
                transfer_ms=sum(c["runs"] * c["transfer_ms"] for c in found),
                exposed_ms=sum(c["runs"] * max(0.0, c["transfer_ms"] - c["covered_ms"]) for c in found))


def tpu_collectives(hlo: str) -> dict:
    """Collective instructions XLA:TPU runs asynchronously, overlapped with compute (a start-done pair such as
    collective-permute-start, or a collective its asynchronous collective fusions hold: computations called by an
    `async-collective-start`/`-done` fusion or named `async_collective_fusion`, XLA:TPU's names), and those it runs
    on their own."""
    comps, _ = roofline.parse(hlo)
    overlapping = {name for name in comps if name.startswith("async_collective_fusion")}
    overlapping |= {i.calls for c in comps.values() for i in c.values() if i.name.startswith("async-collective-")
                    and i.calls}
    frontier = list(overlapping)
    while frontier:
        for inst in comps.get(frontier.pop(), {}).values():
            if inst.calls and inst.calls not in overlapping:
                overlapping.add(inst.calls)
                frontier.append(inst.calls)
    counts = dict(asynchronous=0, synchronous=0)
    for name, comp in comps.items():
        for inst in comp.values():
            if inst.op in COLLECTIVES:
                counts["asynchronous" if name in overlapping else "synchronous"] += 1
            elif _start_kind(comps, inst):
                counts["asynchronous"] += 1  # a start and its done: asynchronous wherever it is
    return counts


def compile_variants(cfg, target: str, n: int, variants: list[tuple[str, dict]], hlo_dir: str | None = None
                     ) -> list[dict]:
    """One row per (label, compiler options): the step compiled for n devices of `target` with those options; each
    optimized module's text also written to hlo_dir/<row>.hlo.txt when given (an earlier run's go first: its rows
    past this run's would read as this run's)."""
    from jaxtrain import dryrun
    if hlo_dir:
        _remove_earlier_modules(hlo_dir)
    if target == "cpu":
        dryrun.use_fake_devices(n)
    else:
        roofline.require_compiler(target)
    import jax
    from jaxtrain import autocast, checkpoint, mesh as mesh_lib, metrics
    devices = jax.devices() if target == "cpu" else target_devices.devices(target, n)
    mesh = mesh_lib.make_mesh(cfg, devices)
    abstract_state = checkpoint.abstract_state(cfg, cfg.model.vocab_size, mesh)
    gpu = target in target_devices.GPUS
    peak, bandwidth = (metrics.peak_flops(cfg, devices[0].device_kind), roofline.memory_bandwidth(target)) if gpu \
        else (None, None)
    rows, default_module = [], None
    for label, options in variants:
        t0 = time.perf_counter()
        try:
            with autocast.compiling_for(devices[0].platform):
                compiled = dryrun.compiled_step(cfg, abstract_state, mesh, options)
        except jax.errors.JaxRuntimeError as e:
            if "INVALID_ARGUMENT" not in str(e):
                raise
            raise UserError(f"XLA refused {label}: {str(e).splitlines()[0]}; fix: flags this XLA knows, spelled "
                            f"--xla_name=value") from None
        text = compiled.as_text()
        if hlo_dir:
            with open(os.path.join(hlo_dir, f"{len(rows)}.hlo.txt"), "w") as f:
                f.write(text)
        module = canonical(text)
        default_module = module if default_module is None else default_module
        row = dict(flags=label, options=options, same_as_default=module == default_module, mesh=dict(mesh.shape),
                   gib=dryrun.memory_table(abstract_state, compiled)[1] / 2**30,
                   compile_s=time.perf_counter() - t0, module_sha256=hashlib.sha256(module.encode()).hexdigest())
        row |= gpu_collectives(text, peak, bandwidth, NVLINK[target], len(devices)) if gpu else tpu_collectives(text)
        rows.append(row)
    return rows


def _remove_earlier_modules(hlo_dir: str) -> None:
    os.makedirs(hlo_dir, exist_ok=True)
    earlier = sorted(name for name in os.listdir(hlo_dir) if re.fullmatch(r"\d+\.hlo\.txt", name))
    for name in earlier:
        os.remove(os.path.join(hlo_dir, name))
    if earlier:
        print(f"--hlo: removed an earlier run's {len(earlier)} modules from {hlo_dir}", file=sys.stderr)


def canonical(hlo: str) -> str:
    """An optimized module's computations with their names numbered in order of appearance, without metadata and
    the debug tables before them: two compiles of the same step in one process can number the same instructions
    differently (param_0.1006 in one, param_0.1031 in the other) and list the source files of its stack frames
    in another order; the header names the module with a counter jax adds per compile."""
    first = re.search(r"^(?:ENTRY )?%", hlo, re.M)
    hlo = re.sub(r",? metadata=\{[^}]*\}", "", hlo[first.start():] if first else hlo)
    defined = set(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = ", hlo, re.M))
    defined |= set(re.findall(r"^(?:ENTRY )?%([\w.\-]+) \(", hlo, re.M))
    for params in re.findall(r"^(?:ENTRY )?%[\w.\-]+ \((.*)\) -> ", hlo, re.M):
        defined |= set(re.findall(r"([\w.\-]+): ", params))
    ids = {}

    def number(match):
        name = match[0].removeprefix("%")
        return match[0] if name not in defined else match[0][:-len(name)] + ids.setdefault(name, f"v{len(ids)}")
    return re.sub(r"%?[A-Za-z_][\w.\-]*", number, hlo)


def table(rows: list[dict], gpu: bool) -> str:
    if gpu:
        head = ("| flags | module | GiB per device | dot TFLOP | compute ms | collectives | transfer ms | exposed ms "
                "| compile s |")
        cells = lambda r: (f"{r['tflop']:,.1f} | {r['compute_ms']:,.1f} | {r['collectives']:,} | "
                           f"{r['transfer_ms']:,.2f} | {r['exposed_ms']:,.2f}")
    else:
        head = "| flags | module | GiB per device | asynchronous collectives | synchronous | compile s |"
        cells = lambda r: f"{r['asynchronous']:,} | {r['synchronous']:,}"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        module = ("default" if r["flags"] == DEFAULTS else "same as default" if r["same_as_default"] else
                  "differs")
        lines.append(f"| {r['flags']} | {module} | {r['gib']:.2f} | {cells(r)} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    ap = OneLineParser(prog="python -m benchmarks.xla_flags", description=__doc__.split("\n\n")[0],
                       epilog=CONFIG_FLAGS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, choices=TARGETS, help="the device kind to compile for")
    ap.add_argument("--devices", type=positive_int, default=1, help="how many of them (the mesh the config asks for)")
    ap.add_argument("--flags", default="",
                    help='XLA flags as XLA_FLAGS writes them, after an = sign: --flags="--xla_a=1 --xla_b=true"')
    ap.add_argument("--each", action="store_true", help="also compile with each flag alone")
    ap.add_argument("--all-but-each", action="store_true",
                    help="also compile with all the flags but one, for each: which matter only together")
    ap.add_argument("--json", type=output_file, help="also write the rows here")
    ap.add_argument("--hlo", type=output_folder,
                    help="also write each compile's optimized module to this folder, as <row>.hlo.txt")
    args, rest = ap.parse_known_args(argv)
    options = parse_flags(args.flags)
    from benchmarks.run import resolved_config
    from jaxtrain import config as config_lib
    cfg = config_lib.load(rest + ["--run.dry_run=true"])  # a dry run's: no data is read when the vocab is known
    cfg = resolved_config(rest, synthetic=False) if cfg.model.vocab_size is None else cfg
    variants = [(DEFAULTS, {})]
    flags = args.flags.split() if len(options) > 1 else []
    variants += [(flag, parse_flags(flag)) for flag in flags] if args.each else []
    variants += [(f"all but {flag}", parse_flags(" ".join(f for f in flags if f != flag)))
                 for flag in flags] if args.all_but_each else []
    variants += [(args.flags if len(options) == 1 else f"all {len(options)} flags", options)] if options else []
    rows = compile_variants(cfg, args.target, args.devices, variants, args.hlo)
    gpu = args.target in target_devices.GPUS
    mesh = rows[0]["mesh"]
    print(f"{args.devices} x {args.target}, batch {cfg.data.batch_size} x seq {cfg.model.seq_len} in "
          f"{cfg.optim.grad_accum_steps} micro-batches, mesh (data {mesh['data']}, fsdp {mesh['fsdp']})"
          + ("; ESTIMATES from the compiled schedule (roofline per kernel, collectives at NVLink bandwidth), not "
             "measured" if gpu else "") + "\n")
    print(table(rows, gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
