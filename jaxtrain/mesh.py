"""Devices, the (data, fsdp) mesh, and where each array lives.

Params and optimizer state are sharded over `fsdp` (each leaf along its largest dimension that divides evenly,
replicated otherwise) and replicated over `data`; batches are split over both axes. Each host builds the global
batch from only its own rows (jax.make_array_from_process_local_data), so no host ever loads another's data.
"""

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.config import Config, validate_devices

BATCH_AXES = ("data", "fsdp")


def init_distributed() -> None:
    """Join the other hosts when launched as one of several processes (TPU pod, SLURM, or JAX_COORDINATOR_ADDRESS
    set by hand, as the localhost tests do). A single process needs nothing."""
    multi_host_env = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")
    if any(os.environ.get(name) for name in multi_host_env):
        jax.distributed.initialize()


def make_mesh(cfg: Config) -> Mesh:
    data, fsdp = validate_devices(cfg, jax.device_count())
    # Auto axes: XLA propagates shardings from the inputs (jax.make_mesh defaults to Explicit axes, which would
    # make every gather in the model name its output sharding).
    return jax.make_mesh((data, fsdp), ("data", "fsdp"), axis_types=(AxisType.Auto, AxisType.Auto))


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """(B, T) eval batches."""
    return NamedSharding(mesh, P(BATCH_AXES))


def global_array(local_rows: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows of a batch -> the global, sharded batch."""
    return jax.make_array_from_process_local_data(sharding, local_rows)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
