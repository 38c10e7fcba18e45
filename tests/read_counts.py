"""Lines for a test's script (`python -c`) that count where `jaxtrain.sample` and `jaxtrain.evaluate` put a model's
weights: `reads`, the device count of each checkpoint orbax reads (the target's shardings), and `placements`, of
each layout mesh.model_mesh makes (a checkpoint's read, or a folder's weights placed). A script clears both before a
command and prints them after it."""

COUNTING = '''
import jax, orbax.checkpoint as ocp
from jaxtrain import mesh
placements, model_mesh = [], mesh.model_mesh
mesh.model_mesh = lambda fsdp, devices: placements.append(len(devices)) or model_mesh(fsdp, devices)
reads, restore = [], ocp.PyTreeCheckpointHandler.restore


def counted(handler, directory, args=None):
    shardings = [a.sharding for a in jax.tree.leaves(args.restore_args) if getattr(a, "sharding", None) is not None]
    reads.append(max(len(s.device_set) for s in shardings))
    return restore(handler, directory, args=args)


ocp.PyTreeCheckpointHandler.restore = counted
'''
