"""Devices, the (data, fsdp) mesh, and where each array lives.

Params and optimizer state are sharded over `fsdp` (each leaf along its largest dimension that divides evenly,
replicated otherwise) and replicated over `data`; batches, and the model's activations (`batch_sharded`), are split
over both axes. Each host builds the global batch from only its own rows (jax.make_array_from_process_local_data),
so no host ever loads another's data.
"""

import difflib
import errno
import math
import os
import re
import socket
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import clusters as jax_clusters  # jax's cluster detection: no public API (0.10.2's signature)
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import target_devices
from jaxtrain.config import Config
from jaxtrain.errors import UserError

BATCH_AXES = ("data", "fsdp")
# What JAX reads, besides SLURM_NTASKS, to find the tasks of a SLURM step: srun sets them all; an salloc shell or a
# batch script has the job's id but not the step's variables.
SLURM_STEP_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
# A launch by hand: jaxtrain reads these two, and hands them to jax with JAX_COORDINATOR_ADDRESS.
BY_HAND_VARIABLES = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# host:port as gRPC splits it: a name or an IPv4 address, or an IPv6 one in brackets ([::1]:1234); then the port.
HOST_PORT = re.compile(r"(?:\[[^\[\]\s]+\]|[^\[\]\s:]+):([0-9]+)")
# No misspellings of JAX_COORDINATOR_ADDRESS: itself (set but empty), and the variables near it in name that jax
# reads for something else.
NOT_MISSPELLINGS = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS", "JAX_COORDINATOR_PORT")
# How long jax.distributed.initialize waits for every process to join (its own default), and how long a join goes
# on before it is said on stderr.
JOIN_TIMEOUT_S = 300
JOIN_QUIET_S = 10.0


def init_distributed() -> None:
    """Join the other processes of a multi-host run. In SLURM steps of several tasks and on TPU slices (GKE's
    variables, or a TPU VM's device files: its metadata server lists the slice's workers), JAX finds the coordinator
    itself; by hand (or two processes on localhost, as the tests do) set JAX_COORDINATOR_ADDRESS=host:port,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID in each process. A single process needs nothing.

    Under SLURM, JAX gives each task the one GPU of its SLURM_LOCALID (one task per GPU); so a job of one task, such
    as `python -m jaxtrain.run` in an salloc shell on an 8-GPU node, is not initialised and keeps all its GPUs."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        _join_by_hand(env)
    elif given := [name for name in BY_HAND_VARIABLES if env.get(name)]:
        raise UserError(f"{given[0]}={env[given[0]]} is set, so this is one process of several, but "
                        f"JAX_COORDINATOR_ADDRESS is not{_misspelled_address(env)}: set JAX_COORDINATOR_ADDRESS="
                        f"host:port (process 0's host and a free port, the same in every process), or unset "
                        f"{' and '.join(given)} to train as one process")
    elif int(env.get("SLURM_NTASKS") or 1) > 1:
        _join_slurm_step(env)
    elif (env.get("TPU_WORKER_HOSTNAMES") or env.get("MEGASCALE_COORDINATOR_ADDRESS")
          or target_devices.has_tpu_device_files()):
        _join_tpu_slice()


def _join_by_hand(env) -> None:
    address = env["JAX_COORDINATOR_ADDRESS"]
    if not _is_host_port(address):
        raise UserError(f"JAX_COORDINATOR_ADDRESS={address!r} is not host:port: give process 0's host and a port "
                        f"(1-65535), the same in every process, e.g. 10.0.0.1:12355 or [::1]:12355")
    try:
        n, i = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
    except (KeyError, ValueError):
        raise UserError("JAX_COORDINATOR_ADDRESS is set, so this is one process of several: also set "
                        "JAX_NUM_PROCESSES (how many) and JAX_PROCESS_ID (this one's, 0-based)") from None
    if not 0 <= i < n:
        raise UserError(f"JAX_PROCESS_ID={i} with JAX_NUM_PROCESSES={n}: JAX_NUM_PROCESSES counts the processes "
                        f"(at least 1) and JAX_PROCESS_ID numbers this one from 0, below that count")
    _join(f"process {i} of {n}, through the coordinator at {address}", address, n, i)


def _join_slurm_step(env) -> None:
    missing = [name for name in SLURM_STEP_VARIABLES if name not in env]
    if missing:
        raise UserError(f"SLURM_NTASKS={env['SLURM_NTASKS']}, but this process is not a task of an srun step "
                        f"({missing[0]} is not set), so it has no other processes to join: start it with srun "
                        f"(one task per GPU, as launch/gpt-1b.sbatch does), or in an allocation of one task "
                        f"(salloc --ntasks=1) to drive all the node's GPUs from this one process")
    address, count, index = _cluster_found_by_jax()
    _join(f"task {index} of {count} of the SLURM step on {env['SLURM_STEP_NODELIST']}", address, count, index)


def _join_tpu_slice() -> None:
    """A host of a TPU slice joins the others, where jax finds several: on a TPU VM (`gcloud compute tpus tpu-vm ssh
    --worker=all`) the slice is in the metadata server, not the environment. A single-host slice (a v5e-8) has
    nothing to join; jax.distributed.initialize() would start its coordinator service on port 8482 there for a
    count of 1. Device files where jax finds no TPU VM (no libtpu, or /dev/vfio of another device) join nothing."""
    address, count, index = _cluster_found_by_jax()
    if address is not None and count > 1:
        _join(f"host {index} of {count} of the TPU slice", address, count, index)


def _cluster_found_by_jax() -> tuple[str | None, int | None, int | None]:
    """The coordinator's address, the process count and this process's id, as jax.distributed.initialize() finds
    them with no arguments (SLURM's variables, a TPU VM's metadata server; JAX_COORDINATOR_PORT replaces the port);
    Nones where it finds no cluster. Found here, so that jaxtrain can name them and skip a join of one process."""
    port = os.environ.get("JAX_COORDINATOR_PORT")
    if port and not _is_port(port):
        raise UserError(f"JAX_COORDINATOR_PORT={port!r} is not a port: set a free one (1-65535), the same in every "
                        f"process, or unset it for jax's own choice")
    address, count, index, _ = jax_clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, JOIN_TIMEOUT_S)
    return address, count, index


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


def _is_host_port(address: str) -> bool:
    match = HOST_PORT.fullmatch(address)
    return bool(match) and _is_port(match.group(1))


def _misspelled_address(env) -> str:
    """' (X is set: a misspelling?)' for a variable whose name is close to JAX_COORDINATOR_ADDRESS; '' otherwise."""
    names = [name for name in env if name not in NOT_MISSPELLINGS]
    close = difflib.get_close_matches("JAX_COORDINATOR_ADDRESS", names, n=1, cutoff=0.8)
    return f" ({close[0]} is set: a misspelling?)" if close else ""


def _join(who: str, address: str, count: int, index: int) -> None:
    """jax.distributed.initialize, saying so on stderr when it is still waiting after JOIN_QUIET_S (a quick join says
    nothing): a process that one of the others never joins waits JOIN_TIMEOUT_S and is then aborted from C++
    (DEADLINE_EXCEEDED and a stack trace, no Python exception to turn into one line), so that line is what names
    the wait."""
    if index == 0:
        _check_coordinator_port(address)
    waiting = threading.Timer(JOIN_QUIET_S, lambda: print(
        f"waiting for the run's other processes to join, as {who}; jax waits up to {JOIN_TIMEOUT_S} s for all of "
        f"them, then aborts this process", file=sys.stderr, flush=True))
    waiting.daemon = True
    waiting.start()
    try:
        jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index,
                                   initialization_timeout=JOIN_TIMEOUT_S)
    finally:
        waiting.cancel()


def _check_coordinator_port(address: str) -> None:
    """Refuse a port that process 0's coordinator service cannot listen on, found by binding it (as gRPC does, with
    SO_REUSEADDR) and letting it go: jax's own failure there ("Failed to start RPC server") is a JaxRuntimeError
    traceback or, in most tries here, a segfault inside jaxlib 0.10.2. Other errors (no IPv6 here for jax's
    default [::], a host that is not this one's) are left to jax."""
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{address.rsplit(':', 1)[1]}"  # jax's default
    host, port = bind.rsplit(":", 1)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        probe = socket.socket(family, kind, proto)
    except (OSError, ValueError):
        return
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _coordinator_port_taken(bind, port) from None


def _coordinator_port_taken(bind: str, port: str) -> UserError:
    """Another job on this host holds the port (under SLURM jax takes 61440 + SLURM_JOB_ID % 4096, which jobs 4096
    apart share), or a leftover process of an earlier run; the fix names where this launch's port comes from."""
    env = os.environ
    how = ("in JAX_COORDINATOR_ADDRESS, the same in every process" if env.get("JAX_COORDINATOR_ADDRESS") else
           "with JAX_COORDINATOR_PORT=<port> in every process's environment (under SLURM: export it before srun)")
    if env.get("JAX_COORDINATOR_BIND_ADDRESS"):
        how += ", and in JAX_COORDINATOR_BIND_ADDRESS"
    return UserError(f"the coordinator could not listen on {bind}: port {port} is taken, by another job or a "
                     f"leftover process on this host (`ss -ltnp 'sport = :{port}'` names it); end that process, "
                     f"or choose a free port {how}")


def from_process_0(flag: bool) -> bool:
    """Process 0's flag on every process: one small collective that all of them join (nothing on one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def each_process(values: np.ndarray) -> np.ndarray:
    """Every process's `values` (one shape and dtype on all), stacked in process order: one small collective that
    all of them join, needing no mesh (this process's alone on one process)."""
    if jax.process_count() == 1:
        return values[None]
    return np.asarray(multihost_utils.process_allgather(values, tiled=False))


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


def model_mesh(fsdp: int, devices: list) -> Mesh:
    """The (data, fsdp) mesh a trained model computes on outside its run (evaluate's): each weight split over
    gcd(fsdp, len(devices)) of `devices` (a run's mesh.fsdp where it divides their count: then the run's own mesh on
    as many devices, so its sums in the same order), the batch over all. gcd: a divisor of the run's fsdp divides
    d_model as the run's does. Devices that are no whole block of a TPU's torus (3 of a host's 4 chips), which
    create_device_mesh asserts against, are laid out in the order given."""
    shape = (len(devices) // math.gcd(fsdp, len(devices)), math.gcd(fsdp, len(devices)))
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, ValueError, NotImplementedError):
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, ("data", "fsdp"), axis_types=AUTO_AXES)


def most_splitting(fsdp: int, counts) -> list[int]:
    """Of the device `counts`, those over which model_mesh splits each weight of a run of mesh.fsdp `fsdp` into the
    most pieces (gcd(fsdp, count) the largest: fsdp 4 on up to 3 devices, 2)."""
    counts = list(counts)
    most = max(math.gcd(fsdp, count) for count in counts)
    return [count for count in counts if math.gcd(fsdp, count) == most]


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
