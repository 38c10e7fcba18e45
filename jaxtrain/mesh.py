"""Devices, the (data, fsdp) mesh, and where each array lives.

Params and optimizer state are sharded over `fsdp` (each leaf along its largest dimension that divides evenly,
replicated otherwise) and replicated over `data`; batches, and the model's activations (`batch_sharded`), are split
over both axes. Each host builds the global batch from only its own rows (jax.make_array_from_process_local_data),
so no host ever loads another's data.
"""

import math
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.config import Config
from jaxtrain.errors import UserError

BATCH_AXES = ("data", "fsdp")
# What JAX reads to join the tasks of a SLURM step (srun sets them; an salloc shell or a batch script alone does not).
SLURM_STEP_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
# How long jax.distributed.initialize waits for every process to join (its own default), and how long a join goes
# on before it is said on stderr.
JOIN_TIMEOUT_S = 300
JOIN_QUIET_S = 10.0


def init_distributed() -> None:
    """Join the other processes of a multi-host run. On TPU pods and in SLURM steps of several tasks, JAX finds the
    coordinator itself; by hand (or two processes on localhost, as the tests do) set JAX_COORDINATOR_ADDRESS=host:port,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID in each process. A single process needs nothing.

    Under SLURM, JAX gives each task the one GPU of its SLURM_LOCALID (one task per GPU); so a job of one task, such
    as `python -m jaxtrain.run` in an salloc shell on an 8-GPU node, is not initialised and keeps all its GPUs."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        try:
            n, i = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        except (KeyError, ValueError):
            raise UserError("JAX_COORDINATOR_ADDRESS is set, so this is one process of several: also set "
                            "JAX_NUM_PROCESSES (how many) and JAX_PROCESS_ID (this one's, 0-based)") from None
        if not 0 <= i < n:
            raise UserError(f"JAX_PROCESS_ID={i} with JAX_NUM_PROCESSES={n}: JAX_NUM_PROCESSES counts the processes "
                            f"(at least 1) and JAX_PROCESS_ID numbers this one from 0, below that count")
        _join(f"process {i} of {n}, through the coordinator at {env['JAX_COORDINATOR_ADDRESS']}",
              num_processes=n, process_id=i)
    elif int(env.get("SLURM_NTASKS") or 1) > 1:
        missing = [name for name in SLURM_STEP_VARIABLES if name not in env]
        if missing:
            raise UserError(f"SLURM_NTASKS={env['SLURM_NTASKS']}, but this process is not a task of an srun step "
                            f"({missing[0]} is not set), so it has no other processes to join: start it with srun "
                            f"(one task per GPU, as launch/gpt-1b.sbatch does), or in an allocation of one task "
                            f"(salloc --ntasks=1) to drive all the node's GPUs from this one process")
        _join(f"task {env['SLURM_PROCID']} of {env['SLURM_NTASKS']} of the SLURM step on "
              f"{env['SLURM_STEP_NODELIST']}")
    elif env.get("TPU_WORKER_HOSTNAMES") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        _join("a host of the TPU slice")


def _join(who: str, **kwargs) -> None:
    """jax.distributed.initialize, saying so on stderr when it is still waiting after JOIN_QUIET_S (a quick join says
    nothing): a process that one of the others never joins waits JOIN_TIMEOUT_S and is then aborted from C++
    (DEADLINE_EXCEEDED and a stack trace, no Python exception to turn into one line), so that line is what names
    the wait."""
    waiting = threading.Timer(JOIN_QUIET_S, lambda: print(
        f"waiting for the run's other processes to join, as {who}; jax waits up to {JOIN_TIMEOUT_S} s for all of "
        f"them, then aborts this process", file=sys.stderr, flush=True))
    waiting.daemon = True
    waiting.start()
    try:
        jax.distributed.initialize(initialization_timeout=JOIN_TIMEOUT_S, **kwargs)
    finally:
        waiting.cancel()


def from_process_0(flag: bool) -> bool:
    """Process 0's flag on every process: one small collective that all of them join (nothing on one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (nothing to do on one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# The mesh's axes are Auto: XLA propagates shardings from the inputs (jax.make_mesh, and since jax 0.11.1 an
# AbstractMesh, default to Explicit axes, which would make every gather in the model name its output sharding and
# every with_sharding_constraint an assert)
AUTO_AXES = (AxisType.Auto, AxisType.Auto)


def one_device_mesh() -> Mesh:
    """The (data, fsdp) mesh of this process's first device alone: a conversion's, a kernel test's."""
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"), axis_types=AUTO_AXES)


def make_mesh(cfg: Config, devices=None) -> Mesh:
    """The (data, fsdp) mesh over `devices`: jax.devices() unless given (a dry run's compile-only devices).

    The devices are ordered along the TPU torus as jax.make_mesh orders them, but a mesh axis may split a physical
    one: jax.make_mesh allows that on v5e only, and refuses (data 8, fsdp 8) on a v5p's 4x4x4 chips, where 8 is no
    product of whole axes (caught by the dry run compiled for a v5p slice through libtpu: tests/test_dryrun.py)."""
    devices = jax.devices() if devices is None else devices
    data, fsdp = validate_devices(cfg, len(devices))
    grid = mesh_utils.create_device_mesh((data, fsdp), devices, allow_split_physical_axes=True)
    return Mesh(grid, ("data", "fsdp"), axis_types=AUTO_AXES)


def validate_devices(cfg: Config, n_devices: int) -> tuple[int, int]:
    """The (data, fsdp) mesh shape for n_devices; checks that each micro-batch splits evenly over it."""
    fsdp = cfg.mesh.fsdp
    data = cfg.mesh.data if cfg.mesh.data != -1 else n_devices // max(fsdp, 1)
    if fsdp <= 0 or data <= 0 or data * fsdp != n_devices:
        data_fix = "" if cfg.mesh.data == -1 else "mesh.data=-1 and "
        raise UserError(f"mesh.data={cfg.mesh.data} x mesh.fsdp={cfg.mesh.fsdp} does not cover the {n_devices} "
                        f"devices; set {data_fix}an fsdp that divides {n_devices}{_or_dry_run_devices(cfg)}")
    d_model = cfg.model.d_model
    if d_model % fsdp:  # fsdp_sharding splits a leaf only along a dimension fsdp divides
        raise UserError(f"mesh.fsdp={fsdp} does not divide model.d_model={d_model}: every parameter of that size "
                        f"(embeddings, LayerNorms, the blocks' weights) and its AdamW moments would stay whole on "
                        f"every device; set an fsdp that divides both d_model and the {n_devices} devices (e.g. "
                        f"{math.gcd(d_model, n_devices)}), or change d_model")
    if cfg.micro_batch_size % n_devices:
        batch, k = cfg.data.batch_size, cfg.optim.grad_accum_steps
        fewer = next((j for j in range(k - 1, 0, -1) if batch % (j * n_devices) == 0), None)
        or_fewer = (f", or set optim.grad_accum_steps={fewer} (the same batch in fewer, bigger micro-batches; a "
                    f"run without dropout may resume with it)" if fewer else "")
        raise UserError(f"the micro-batch of {cfg.micro_batch_size} sequences (data.batch_size / optim.grad_accum_steps)"
                        f" does not split over {n_devices} devices; make data.batch_size a multiple of "
                        f"{n_devices * k}{or_fewer}")
    tiles, device_tokens = cfg.model.vocab_tiles, cfg.micro_batch_size // n_devices * cfg.model.seq_len
    if device_tokens % tiles:  # each device's rows of a tile are its own (loss._by_shard)
        raise UserError(f"model.vocab_tiles={tiles} does not divide the {device_tokens} tokens each of the {n_devices} "
                        f"devices holds of a micro-batch; choose a divisor, e.g. {math.gcd(device_tokens, tiles)}")
    return data, fsdp


def _or_dry_run_devices(cfg: Config) -> str:
    """For a dry run on this machine's devices of a mesh meant for more (a pod config): the count to compile for."""
    if not cfg.run.dry_run or cfg.run.dry_run_devices:
        return ""
    count = f"={cfg.mesh.data * cfg.mesh.fsdp}" if cfg.mesh.data != -1 else f"=N, N a multiple of {cfg.mesh.fsdp}"
    return f"; or dry-run it for the devices it is meant for: --run.dry_run_devices{count}"


def fsdp_sharding(mesh: Mesh, tree):
    """A NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs)."""
    n = mesh.shape["fsdp"]

    def leaf_sharding(x):
        shape = getattr(x, "shape", ())
        dims = [d for d in np.argsort(shape)[::-1] if shape[d] % n == 0 and shape[d] >= n] if n > 1 else []
        spec = [None] * len(shape)
        if dims:
            spec[dims[0]] = "fsdp"
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(leaf_sharding, tree)


def window_sharding(mesh: Mesh) -> NamedSharding:
    """(k, B, T) micro-batches: B split over all devices."""
    return NamedSharding(mesh, P(None, BATCH_AXES))


def global_array(local_rows: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows of a batch -> the global, sharded batch."""
    return jax.make_array_from_process_local_data(sharding, local_rows)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


@jax.jit
def _any(flags: jax.Array) -> jax.Array:
    return jnp.any(flags, axis=0)


def any_process(flags: bool | tuple[bool, ...], mesh: Mesh) -> jax.Array:
    """For each flag, a replicated bool: True on every process when any process passed True. One small collective
    for them all (each device holds its process's flags); a bool gives a scalar, a tuple an array of its length.
    Dispatched asynchronously; reading it waits for every process to have voted."""
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    local = np.broadcast_to(np.asarray(flags, bool), (len(mesh.local_devices), *np.shape(flags)))
    return _any(global_array(np.ascontiguousarray(local), sharding))  # replicated on every device


def batch_sharded(x_BxTxD):
    """x pinned to the batch split over every mesh axis, (data, fsdp), when traced under a mesh (jax.set_mesh, as
    the trainer and the dry run compile); as it is otherwise. XLA's propagation finds this layout by itself for
    GPT-2 124M and the 1B config (the same compiled step with or without the pin), but not where fsdp splits the
    embedding along d_model (a vocabulary narrower than d_model, as bytes): there it split the activations over
    d_model and gathered them back, 1.6x slower on small.yaml with fsdp 4 (benchmarks/NOTES.md)."""
    mesh = jax.sharding.get_abstract_mesh()
    return x_BxTxD if mesh.empty else jax.lax.with_sharding_constraint(x_BxTxD, P(mesh.axis_names))


def batch_axes() -> tuple[str, ...]:
    """The mesh axes batch_sharded splits the batch over (all of them) when traced under a mesh; () outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(mesh.axis_names)


def batch_shards() -> int:
    """How many devices batch_sharded splits the batch over: every device of the mesh traced under, 1 outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.size


def weight_shards() -> int:
    """How many devices the mesh traced under splits each weight over (its fsdp axis, fsdp_sharding); 1 outside a
    mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get("fsdp", 1)


def on_each_devices_rows(call, row_inputs: int, whole_inputs: int, outputs: int):
    """`call` (a hand-written kernel: its row inputs first, then whole ones) run by each device on its own rows of
    the batch split (batch_axes), every whole input whole on each; the row outputs of all devices concatenated.
    Outside a mesh, `call` itself. check_vma=False: a pallas_call's outputs carry no varying-axes type to check."""
    axes = batch_axes()
    if not axes:
        return call
    return jax.shard_map(call, in_specs=(P(axes),) * row_inputs + (P(),) * whole_inputs,
                         out_specs=(P(axes),) * outputs, check_vma=False)
