"""`--run.dry_run=true`: whether a config fits its devices, known before a pod spends half an hour starting.

The train step is lowered and compiled ahead of time for the configured mesh from abstract shapes (nothing is
allocated, no checkpoint touched, no data read where model.vocab_size is given: else the data's meta.json, or the
embedded corpus prepared), on this machine's devices or on `run.dry_run_devices` of them. Per device it prints the
bytes of params, AdamW's moments, MultiSteps' gradient accumulator (from the shardings) and the step's temporaries
(XLA's `memory_analysis()` of the compiled step), and, with `run.target_device`, whether that total fits the device's
memory. What it proves: the mesh and batch split, and the sharded state's exact size. The temporaries are the buffer
assignment of the compiler that compiled the step: where jax's compiler for the target is installed (the CUDA plugin,
libtpu; no accelerator needed), the target's own, for compile-only devices (target_devices.py); otherwise XLA:CPU's on
fake CPU devices, an estimate (other fusions, no cuDNN attention, no memory-aware scheduling) that overstates a GPU's
or TPU's severalfold. It does not run a step.
"""

import contextlib
import dataclasses
import math
import os
import re
import sys
from typing import Callable

import jax
import numpy as np

from jaxtrain import autocast
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import data as data_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import optim
from jaxtrain import target_devices
from jaxtrain import step as step_lib
from jaxtrain.config import Config
from jaxtrain.errors import NotTheCheckpoint, UserError

GIB = 2**30
# Memory per device, bytes, of what run.target_device names: a TPU's datasheet HBM; a GPU's as its driver reports
# it, XLA's device spec (jaxtrain/gpu_specs: an H100's "80 GB" are 79.11 GiB there, an A100-40GB's 39.42)
DEVICE_MEMORY = {
    "v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB,
    **{gpu: int(re.search(r"device_memory_size: (\d+)", target_devices.device_spec(gpu))[1])
       for gpu in target_devices.GPUS},
}
# What the runtime keeps for itself (XLA's own allocator reserve, cuDNN/cuBLAS workspaces, fragmentation): a
# config is said to fit only below this fraction of the device's memory.
USABLE_FRACTION = 0.9
LEVERS = ("mesh.fsdp (shards params and optimizer state over more devices), optim.grad_accum_steps (smaller "
          "micro-batches: fewer activations), model.remat=dots or full (recompute activations in the backward pass), "
          "model.vocab_tiles (the head and the loss a tile of tokens at a time: never the whole logits)")
# XLA:CPU's memory-minimizing order (its list scheduler) instead of its default, which orders the step for
# concurrency and keeps more alive; under the default, model.remat saves nothing on a CPU. GPT-2 124M, 8 sequences a
# step, this 2-core CPU: 20.51 GiB, 15.42 with the flag; remat=full 20.50 and 8.87 (2026-12-01; benchmarks/NOTES.md,
# CPU step 8, has the first measurement).
CPU_MEMORY_ORDER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# What the verdict adds when the step was compiled by XLA:CPU for a GPU or TPU target.
# The README's measured ratios (its dry-run section and launch recipes), which these figures are taken from.
ESTIMATED = ("the step's temporaries are XLA:CPU's, an estimate: they overstate a GPU's 2.9-4.1x (GPT-2 124M, 32 "
             "sequences of 1024 a micro-batch on one H100: 55.8 GiB by XLA:CPU with run.dry_run_devices=1, 16.1 by "
             "XLA:GPU) and a TPU's 2.2-2.9x (configs/pod-fsdp.yaml on 64 v5e: 11.5 and 4.0 GiB); for the device's "
             "own figure, no device needed, install jax's compiler for it")


def cpu_memory_order_set() -> bool:
    """Whether XLA_FLAGS already asks XLA:CPU for its memory-minimizing order."""
    return CPU_MEMORY_ORDER in os.environ.get("XLA_FLAGS", "")


def compile_cpu_for_memory() -> None:
    """XLA:CPU's memory-minimizing order for the dry run's compile; must run before jax starts its backends (a GPU's
    or TPU's compiler reads no XLA:CPU flag). XLA:CPU's default scheduler orders the step for concurrency, keeping
    more alive than a TPU's or GPU's memory-aware scheduler would (GPT-2 124M on 64 devices: 18.2 GiB of
    temporaries, 16.0 with the list scheduler): a dry run that estimates for a target, or for fake devices,
    compiles for memory. One for this machine's own devices compiles as a run here would."""
    if not cpu_memory_order_set():
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_MEMORY_ORDER}".strip()


def use_fake_devices(n: int) -> None:
    """n CPU devices in place of this machine's: must run before jax first looks at its devices."""
    compile_cpu_for_memory()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard, for uneven splits)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def compiled_step(cfg: Config, abstract_state, mesh, compiler_options: dict | None = None):
    """The train step as run.Trainer jits it, compiled from abstract arguments (with XLA `compiler_options`, as
    XLA_FLAGS or LIBTPU_INIT_ARGS would set them: benchmarks/xla_flags.py)."""
    state_sharding = jax.tree.map(lambda x: x.sharding, abstract_state)
    train_step = step_lib.jit_train_step(cfg, cfg.run.seed, out_shardings=(state_sharding, mesh_lib.replicated(mesh)))
    k = cfg.optim.grad_accum_steps
    window = jax.ShapeDtypeStruct((k, cfg.data.batch_size // k, cfg.model.seq_len), np.int32,
                                  sharding=mesh_lib.window_sharding(mesh))
    with jax.set_mesh(mesh):  # mesh.batch_sharded pins the activations to this mesh
        lowered = train_step.lower(abstract_state, window, window)
        return compile_fitting(lowered, mesh.devices.flat[0], compiler_options)


def compile_fitting(lowered, device, compiler_options: dict | None = None):
    """lowered.compile(); where the compiler refuses a step bigger than the device's memory (XLA:TPU does, at
    compile time), a UserError naming the levers instead of its traceback."""
    try:
        return lowered.compile(compiler_options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise UserError(f"does not fit: XLA for {device.device_kind} says {str(e).splitlines()[0].rstrip('.')}; "
                        f"levers: {LEVERS}") from None


TEMPORARIES = "step temporaries (activations, gradients, XLA buffers)"
# The most XLA:CPU's step temporaries were measured to overstate a target's own compiler's (ESTIMATED): by TPU
# (False) or GPU (True) target
CPU_OVERSTATES = {False: 2.9, True: 4.1}


def memory_table(abstract_state, compiled) -> tuple[list[tuple[str, int]], int]:
    """(what, bytes per device) rows and their total, the peak the step needs on one device."""
    opt_state = abstract_state.opt_state
    adam = optim.adam_state(opt_state)
    params = per_device_bytes(abstract_state.params)
    moments = per_device_bytes((adam.mu, adam.nu))
    accumulator = per_device_bytes(opt_state.acc_grads)
    state = per_device_bytes(abstract_state)
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    rows = [("params (fp32)", params), ("AdamW moments (fp32)", moments),
            ("gradient accumulator (fp32)", accumulator), ("other optimizer state", state - params - moments - accumulator),
            (TEMPORARIES, temporaries),
            ("batch, metrics, and any state output not donated in place", peak_bytes(compiled) - temporaries - state)]
    return rows, sum(b for _, b in rows)


def peak_bytes(compiled) -> int:
    """The bytes a compiled computation needs on one device, as XLA's memory analysis counts them: its arguments,
    temporaries and outputs, less the outputs donated in place of an argument (memory_table's total)."""
    stats = compiled.memory_analysis()
    return (stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes)


def check_fits(compiled, abstract_state, device) -> str | None:
    """Before a real run's first step: a UserError naming the levers when the compiled step needs more than the
    device's memory (GPUs and TPUs report it) or, on CPUs, which report none, than the host's. Returns the memory
    it judged by, in words; None where the device reports none."""
    if device.platform == "cpu":
        return check_fits_host(compiled, abstract_state, len(jax.local_devices(backend="cpu")))
    limit = device_memory(device)
    if not limit:
        return None
    _, total = memory_table(abstract_state, compiled)
    if total > limit:
        raise UserError(f"the train step needs {total / GIB:.2f} GiB per device and {device.device_kind} has "
                        f"{limit / GIB:.2f} GiB for it; levers: {LEVERS}")
    return f"{limit / GIB:.2f} GiB of {device.device_kind}'s memory"


def device_memory(device) -> int | None:
    """The bytes a computation may use on `device`: a GPU's or TPU's, as it reports them (bytes_limit); a CPU's, the
    host's (host_memory_bytes); None where the device reports none."""
    if device.platform == "cpu":
        return host_memory_bytes()
    stats = device.memory_stats()
    return stats.get("bytes_limit") if stats else None


def shortfall(compiled, mesh) -> str | None:
    """Where `compiled`, run on each device of `mesh` (evaluate's, sample's), needs more memory than a device has,
    what it needs against what there is, in words ("needs 1.20 GiB a device and this NVIDIA H100 has 0.50 GiB"; a
    CPU's devices all take the host's memory, so it counts for all of them); None where it fits, or where the device
    reports no limit."""
    device = mesh.devices.flat[0]
    need, limit = peak_bytes(compiled), device_memory(device)
    sharing = mesh.size if device.platform == "cpu" else 1
    if not limit or need * sharing <= limit:
        return None
    together = f", {need * sharing / GIB:.2f} GiB for {sharing} CPU devices," if sharing > 1 else ""
    has = "this host has" if device.platform == "cpu" else f"this {device.device_kind} has"
    return f"needs {need / GIB:.2f} GiB a device{together} and {has} {limit / GIB:.2f} GiB"


def room_left(device) -> int | None:
    """The bytes `device` has free beside what it holds now, as a GPU or TPU reports them: bytes_limit less
    bytes_in_use, or its largest free block where smaller (an allocation is one block); None where it reports none
    (a CPU)."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    return min(stats["bytes_limit"] - stats.get("bytes_in_use", 0), stats.get("largest_free_block_bytes", math.inf))


def shortfall_beside(compiled, mesh) -> str | None:
    """Where `compiled`, whose arguments the devices of `mesh` hold already (a run's params, beside its optimizer
    state), needs more memory than one of this process's has left (room_left), in words: its temporaries and
    outputs against the least room. None where it fits, or where no device reports its room."""
    stats = compiled.memory_analysis()
    need = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    rooms = [room for device in mesh.local_devices if (room := room_left(device)) is not None]
    if not rooms or need <= min(rooms):
        return None
    return f"needs {need / GIB:.2f} GiB a device beside what it holds and one has {min(rooms) / GIB:.2f} GiB left"


class TooBig(NotTheCheckpoint):
    """Weights that need more memory than the devices they are read or placed onto have."""


def more_memory(device, copies: int = 1) -> str:
    """Where what is too big for `device`'s memory fits: an accelerator's is smaller than its host's; a CPU's
    devices share the host's, so on one device where each held its copy of the weights (`copies` of them), or on a
    machine with more."""
    if device.platform != "cpu":
        return "devices with more memory, or the host's (JAX_PLATFORMS=cpu)"
    if copies > 1:
        return f"{one_device()}, or a machine with more memory"
    return "a machine with more memory"


def one_device(holds: str = "the weights") -> str:
    """The lever of CPU devices that each hold their copy of `holds`: they share the host's memory."""
    return f"one device (--devices 1: the host then holds {holds} once)"


@contextlib.contextmanager
def out_of_memory(refusal: Callable[[str], UserError]):
    """XLA's RESOURCE_EXHAUSTED, at a compile (XLA:TPU refuses there what does not fit) or a call (an allocator may
    refuse what the compile judged to fit), as the one line `refusal` makes of "needs more memory than a device
    has"."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise refusal("needs more memory than a device has") from None


def check_fits_host(compiled, abstract_state, n_devices: int) -> str:
    """check_fits for `n_devices` CPU devices, which all take their memory from this host's: each needs the table's
    total (the state and the step's temporaries: XLA:CPU allocates what its memory_analysis counts), and together
    more than host_memory_bytes() cannot run (XLA:CPU would fail in step 1 with RESOURCE_EXHAUSTED)."""
    _, total = memory_table(abstract_state, compiled)
    host = host_memory_bytes()
    if n_devices * total <= host:
        return f"{host / GIB:.2f} GiB of host memory for {n_devices} CPU device(s)"
    several = f" per device, {n_devices * total / GIB:.2f} GiB for {n_devices} CPU devices," if n_devices > 1 else ""
    raise UserError(f"the train step needs {total / GIB:.2f} GiB{several} and this host has {host / GIB:.2f} GiB of "
                    f"memory; levers: {host_levers()}")


def host_levers() -> str:
    """LEVERS for a step bigger than a CPU host: XLA:CPU's memory-minimizing order first, unless XLA_FLAGS has it."""
    if cpu_memory_order_set():
        return LEVERS
    return (f"XLA_FLAGS={CPU_MEMORY_ORDER} (XLA:CPU's memory-minimizing order: about 30% less for the step's "
            f"temporaries; model.remat saves nothing on a CPU without it), {LEVERS}")


# A container's memory limit, where it sees its own (cgroup v2, v1): lower than the host's, it is the process's.
CGROUP_ROOT = "/sys/fs/cgroup"
OWN_CGROUPS = "/proc/self/cgroup"
ROOT_CGROUPS = "0::/\n1:memory:/\n"  # where OWN_CGROUPS cannot be read: the mount's root, v2 and v1


def cgroup_limit_files(own_cgroups: str, root: str) -> list[str]:
    """The memory-limit files of this process's cgroups and of each above them (the lowest limit binds), from
    /proc/self/cgroup's text: cgroup v2's `0::/path` (memory.max), v1's `N:...memory...:/path`
    (memory.limit_in_bytes under root/memory). A SLURM job's --mem is its own cgroup's limit, below the mount's
    root, which alone was read."""
    files = []
    for line in own_cgroups.splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers:
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part]
        files += [os.path.join(base, *parts[:depth], name) for depth in range(len(parts), -1, -1)]
    return files


def host_memory_bytes() -> int:
    """The most memory this process can have: the host's physical memory, or its container's limit where lower.
    Not the memory free now: that moves with the other processes of a shared host and the page cache the kernel
    gives back on demand, and would refuse a step for what runs beside it at the moment of the check; this refuses
    only a step that cannot run however idle the host (swap not counted: a step in swap would crawl)."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    try:
        with open(OWN_CGROUPS) as f:
            own = f.read()
    except OSError:
        own = ROOT_CGROUPS
    for path in cgroup_limit_files(own, CGROUP_ROOT):
        try:
            with open(path) as f:
                text = f.read().strip()  # v2 says "max" where there is no limit, v1 a number near 2**63
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits)


def report(cfg: Config) -> dict:
    """Compile, print the memory table and the verdict; a target it does not fit is a UserError naming levers."""
    devices, compiled_for = _devices(cfg)
    cfg = _with_vocab_size(cfg)
    mesh = mesh_lib.make_mesh(cfg, devices)
    abstract_state = checkpoint_lib.abstract_state(cfg, cfg.model.vocab_size, mesh)
    with autocast.compiling_for(devices[0].platform):  # compile-only GPUs or TPUs on a CPU: trace the model for them
        compiled = compiled_step(cfg, abstract_state, mesh)
    rows, total = memory_table(abstract_state, compiled)
    n_params = sum(x.size for x in jax.tree.leaves(abstract_state.params))
    print(f"dry run: {n_params:,} params on {len(devices)} x {devices[0].device_kind} as mesh (data "
          f"{mesh.shape['data']}, fsdp {mesh.shape['fsdp']}); per device {cfg.micro_batch_size // len(devices)} "
          f"sequences of {cfg.model.seq_len} per micro-batch, {cfg.optim.grad_accum_steps} micro-batches per step; "
          f"compiled by {compiled_for}\n")
    print("| per device | GiB |\n|---|---|")
    for what, size in rows:
        print(f"| {what} | {size / GIB:.3f} |")
    print(f"| **total** | **{total / GIB:.3f}** |\n")
    summary = {"total_bytes": total, "rows": dict(rows), "fits": None, "compiled_for": compiled_for}
    if cfg.run.target_device:
        summary["fits"] = _verdict(cfg.run.target_device, rows, total, estimated=devices[0].platform == "cpu")
    elif not cfg.run.dry_run_devices:  # this machine's own devices: the real run's check, where it would refuse
        summary["fits"] = _fits_here(compiled, abstract_state, devices[0])
    else:
        print(f"not judged: {cfg.run.dry_run_devices} fake devices have no memory of their own; give "
              f"run.target_device (one of {', '.join(DEVICE_MEMORY)}) to judge the step against a device's",
              file=sys.stderr)
    return summary


def _fits_here(compiled, abstract_state, device) -> bool | None:
    """check_fits, as a run on this machine makes it, said on stderr: True, or None where the device reports no
    memory limit to judge against; a UserError where it does not fit."""
    memory = check_fits(compiled, abstract_state, device)
    if memory is None:
        print(f"not judged: {device.device_kind} reports no memory limit", file=sys.stderr)
        return None
    print(f"fits this machine: {memory}, as a run here checks it", file=sys.stderr)
    return True


def _verdict(target: str, rows: list[tuple[str, int]], total: int, estimated: bool) -> bool | None:
    """Whether the step fits the target (None: it may not), said on stderr; a UserError where it does not. By
    XLA:CPU's estimate (`estimated`), a step over the target's memory is refused only where it would be over it
    still with its temporaries as much smaller as the most XLA:CPU was measured to overstate them: above that it
    may not fit, and only the target's own compiler can tell (exit 0, saying so)."""
    limit, usable = DEVICE_MEMORY[target], USABLE_FRACTION * DEVICE_MEMORY[target]
    temporaries = dict(rows)[TEMPORARIES]
    at_least = total - temporaries + temporaries / CPU_OVERSTATES[target in target_devices.GPUS] if estimated \
        else total
    verdict = (f"{total / GIB:.2f} GiB of {target}'s {limit / GIB:.0f} GiB per device ({total / limit:.0%}; "
               f"{USABLE_FRACTION:.0%} usable)")
    hint = f"; {ESTIMATED}: {target_devices.install_fix(target)}" if estimated else ""
    if at_least > usable:
        smaller = f" by XLA:CPU, {at_least / GIB:.2f} GiB with its temporaries overstated as much as measured at " \
            f"most" if estimated else ""
        raise UserError(f"does not fit: {verdict}{smaller}; levers: {LEVERS}{hint}")
    if total > usable:
        print(f"may not fit: {verdict} by XLA:CPU, {at_least / GIB:.2f} GiB with its temporaries overstated as "
              f"much as measured at most{hint}", file=sys.stderr)
        return None
    print(f"fits: {verdict}{hint}", file=sys.stderr)
    return True


def _devices(cfg: Config) -> tuple[list, str]:
    """(the devices to compile for, which compiler on what): compile-only devices of run.target_device where jax's
    compiler for it is installed and no local device is meant (this machine has none, or run.dry_run_devices asks
    for a count); else run.dry_run_devices fake CPUs, or this machine's devices. Before jax starts its backends."""
    target, count = cfg.run.target_device, cfg.run.dry_run_devices
    if count:  # before the devices exist: 100,000 of them took all of a 24 GiB host's memory to create
        mesh_lib.validate_devices(cfg, count)
    if target and target_devices.compiler_installed(target) and (count or not target_devices.machine_has(target)):
        target_devices.allow_compile_only(target)
        devices = target_devices.devices(target, count)
        return devices, f"XLA:{devices[0].platform.upper()} for {target}, ahead of time"
    if count:
        use_fake_devices(count)
        return jax.devices(), f"XLA:CPU for {count} fake device{'s' * (count > 1)}"
    if target:  # XLA:CPU stands in for the target's compiler here, as on fake devices (this machine's own run, not)
        compile_cpu_for_memory()
    return jax.devices(), f"XLA:{jax.default_backend().upper()}"


def _with_vocab_size(cfg: Config) -> Config:
    """cfg with model.vocab_size set: the data's, from its meta.json (the embedded corpus is prepared if need be)."""
    if cfg.model.vocab_size is not None:
        return cfg
    vocab_size = data_lib.load(cfg.data, cfg.model.seq_len).vocab_size
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
