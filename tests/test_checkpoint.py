"""Checkpoints that verify themselves: the fingerprint, fallback past a corrupt checkpoint, rotation, keep_best."""

import asyncio
import contextlib
import errno
import glob
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from jaxtrain import checkpoint, config, run
from jaxtrain import mesh as mesh_lib
from jaxtrain import orbax_quiet
from jaxtrain.errors import UserError
from jaxtrain import step as step_lib
from test_run import final_params, read_metrics, small_args, without_timing

# Saves at 2, 4, 6, 8, keeping 4, 6, 8: a corrupt 6 leaves 4 to fall back to.
EVERY_2 = ("--checkpoint.every=2", "--checkpoint.max_to_keep=3")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    out_dir = str(tmp_path_factory.mktemp("reference"))
    run.train(config.load(small_args(out_dir, cache_dir, *EVERY_2)))
    return out_dir


@pytest.fixture(scope="module")
def reference_params(reference, cache_dir):
    return final_params(reference, cache_dir)


def tree_bytes(path) -> dict:
    """Every file below `path` (relative name -> bytes), and every folder (-> None)."""
    found = {}
    for root, dirs, files in os.walk(path):
        found.update({os.path.relpath(os.path.join(root, d), path): None for d in dirs})
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                found[os.path.relpath(os.path.join(root, f), path)] = fh.read()
    return found


def largest_data_file(step_dir) -> str:
    """The biggest OCDBT data file of the state: array chunks (zstd frames), not orbax's metadata."""
    return max(glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*")), key=os.path.getsize)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def garbage(path):
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).bytes(64))


def flip_one_bit(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))


def empty(step_dir):
    shutil.rmtree(step_dir)
    os.mkdir(step_dir)


# What orbax 0.12 writes in a step folder: _CHECKPOINT_METADATA, commit_success.txt, meta/metadata (our JSON) and
# state/: _METADATA (the tree), _sharding, manifest.ocdbt, d/ (the OCDBT root b-tree), array_metadatas/process_0,
# ocdbt.process_0/{manifest.ocdbt, d/ (the array chunks)}. Garbage in _CHECKPOINT_METADATA, commit_success.txt,
# _sharding or ocdbt.process_0/manifest.ocdbt restores the same arrays (tried by hand): not corruption that matters.
CORRUPTIONS = {  # kind -> (corrupt the step folder, what the warning says)
    "truncated data file": (lambda s: truncate(largest_data_file(s)), "cannot be read"),
    "one bit flipped in a data file": (lambda s: flip_one_bit(largest_data_file(s)), "does not match its fingerprint"),
    "deleted data file": (lambda s: os.remove(largest_data_file(s)), "cannot be read"),
    "deleted state/_METADATA": (lambda s: os.remove(os.path.join(s, "state", "_METADATA")), "cannot be read"),
    "truncated state/_METADATA": (lambda s: truncate(os.path.join(s, "state", "_METADATA")), "cannot be read"),
    "garbage state/_METADATA": (lambda s: garbage(os.path.join(s, "state", "_METADATA")), "cannot be read"),
    "garbage state/manifest.ocdbt": (lambda s: garbage(os.path.join(s, "state", "manifest.ocdbt")), "cannot be read"),
    "garbage meta/metadata": (lambda s: garbage(os.path.join(s, "meta", "metadata")), "cannot be read"),
    "no state folder": (lambda s: shutil.rmtree(os.path.join(s, "state")), "cannot be read"),
    "empty step folder": (empty, "cannot be read"),
}


def run_cli(out_dir, cache_dir, *extra):
    return subprocess.run([sys.executable, "-m", "jaxtrain.run", *small_args(out_dir, cache_dir, *EVERY_2, *extra)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_checkpoint_is_moved_aside_and_the_run_falls_back(reference, reference_params, tmp_path, cache_dir,
                                                                 kind):
    """Killed while saving step 8 (its tmp folder left behind), with step 6 corrupt: the same command moves 6
    aside byte for byte, resumes from 4 and ends exactly where the uninterrupted run did."""
    out_dir = str(tmp_path / "run")
    shutil.copytree(reference, out_dir)
    checkpoints = os.path.join(out_dir, "checkpoints")
    os.rename(os.path.join(checkpoints, "8"), os.path.join(checkpoints, "8.orbax-checkpoint-tmp"))
    corrupt, reason = CORRUPTIONS[kind]
    corrupt(os.path.join(checkpoints, "6"))
    corrupted = tree_bytes(os.path.join(checkpoints, "6"))

    proc = run_cli(out_dir, cache_dir)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    [warning] = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(f"warning: checkpoint {checkpoints}/6 {reason}"), warning
    moved = warning.split("; moved it to ")[1]
    assert os.path.dirname(moved) == os.path.join(out_dir, "checkpoints.corrupt")
    assert os.path.isdir(moved) and tree_bytes(moved) == corrupted  # an empty one too (the run's exit removed it)
    assert "resuming from step 4" in proc.stderr
    assert sorted(os.listdir(checkpoints)) == ["4", "6", "8"]  # the tmp folder is gone
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(reference))
    for a, b in zip(final_params(out_dir, cache_dir), reference_params, strict=True):
        assert np.array_equal(a, b)


def test_a_step_folder_holding_another_step_is_set_aside_not_resumed_as_its_name(reference, tmp_path, cache_dir):
    """checkpoints/4 copied to checkpoints/10 (a backup put back under another name): the run said "resuming from
    step 10", trained on from step 4, and failed at its first save on a step that existed, at every start. Now
    the folder is set aside as a corrupt one is, and the run resumes from its newest true step."""
    out_dir = str(tmp_path / "run")
    shutil.copytree(reference, out_dir)
    checkpoints = os.path.join(out_dir, "checkpoints")
    os.rename(os.path.join(checkpoints, "8"), os.path.join(checkpoints, "8.orbax-checkpoint-tmp"))
    shutil.copytree(os.path.join(checkpoints, "4"), os.path.join(checkpoints, "10"))
    proc = run_cli(out_dir, cache_dir)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    [warning] = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(f"warning: checkpoint {checkpoints}/10 holds step 4, not the step its folder is "
                              f"named for (a copy or a backup put there?); moved it to "
                              f"{out_dir}/checkpoints.corrupt/10-")
    assert "resuming from step 6" in proc.stderr
    assert sorted(os.listdir(checkpoints)) == ["4", "6", "8"]
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(reference))


# XLA's own C++ log lines ("E1127 10:45:00.799488   22761 cpu_aot_loader.cc:210] ..."): jax before 0.10.2 writes two
# each time it loads a CPU executable from a persistent compilation cache (the suite's, conftest.py); not jaxtrain's.
XLA_LOG_LINE = re.compile(r"[IWEF]\d{4} [\d:.]+ +\d+ [\w.]+\.cc:\d+\] ")


def assert_refused_and_untouched(out_dir, cache_dir, extra: tuple, message: str):
    before = tree_bytes(os.path.join(out_dir, "checkpoints"))
    proc = run_cli(out_dir, cache_dir, *extra)
    assert proc.returncode == 2, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if not XLA_LOG_LINE.match(line)]
    assert len(ours) == 1 and message in ours[0] and "Traceback" not in proc.stderr, proc.stderr
    assert tree_bytes(os.path.join(out_dir, "checkpoints")) == before
    assert not os.path.exists(os.path.join(out_dir, "checkpoints.corrupt"))


def test_all_checkpoints_corrupt_stops_and_moves_nothing(reference, tmp_path, cache_dir):
    out_dir = str(tmp_path / "run")
    shutil.copytree(reference, out_dir)
    for step, kind in ((4, "deleted data file"), (6, "one bit flipped in a data file"), (8, "garbage meta/metadata")):
        CORRUPTIONS[kind][0](os.path.join(out_dir, "checkpoints", str(step)))
    assert_refused_and_untouched(out_dir, cache_dir, (), "none of the 3 checkpoints")


def test_changed_config_is_refused_not_taken_for_corruption(reference, tmp_path, cache_dir):
    """Even behind a corrupt newest checkpoint: the next one's config check refuses, and nothing moves."""
    out_dir = str(tmp_path / "run")
    shutil.copytree(reference, out_dir)
    garbage(os.path.join(out_dir, "checkpoints", "8", "meta", "metadata"))
    assert_refused_and_untouched(out_dir, cache_dir, ("--optim.lr=1e-2",), "optim.lr: 0.001 -> 0.01")


@pytest.mark.parametrize("max_to_keep", [1, 2])
def test_keep_best_keeps_the_best_and_the_newest_and_resumes_from_the_newest(tmp_path, cache_dir, capsys,
                                                                             max_to_keep):
    """lr 0.05 overshoots, so the lowest eval loss comes at an early step (asserted) that rotation alone deletes."""
    out_dir = str(tmp_path / "run")
    args = ("--optim.lr=0.05", "--optim.decay_steps=8", "--checkpoint.every=2", "--train.eval_every=2",
            "--checkpoint.keep_best=true", f"--checkpoint.max_to_keep={max_to_keep}")
    run.train(config.load(small_args(out_dir, cache_dir, *args)))
    best, newest = best_eval_step(out_dir), [2, 4, 6, 8][-max_to_keep:]
    assert best not in newest  # else this test shows nothing
    assert saved_steps(out_dir) == sorted([best, *newest])
    released = str(tmp_path / "released")
    shutil.copytree(out_dir, released)

    run.train(config.load(small_args(out_dir, cache_dir, *args, "--train.steps=10")))
    err = capsys.readouterr().err
    assert "resuming from step 8" in err and "keep_best is false" not in err
    assert best_eval_step(out_dir) == best
    assert saved_steps(out_dir) == sorted([best, *[4, 6, 8, 10][-max_to_keep:]])

    # A resume without the flag deletes the best at its next save, as asked; it says so first, once.
    run.train(config.load(small_args(released, cache_dir, *args, "--checkpoint.keep_best=false", "--train.steps=10")))
    eval_loss = {line["step"]: line["eval_loss"] for line in read_metrics(released) if "eval_loss" in line}[best]
    warning = (f"warning: checkpoint.keep_best is false, so the next save deletes step {best}, the lowest eval loss "
               f"kept so far ({eval_loss:.4f}), older than the newest checkpoint.max_to_keep={max_to_keep}; resume "
               f"with --checkpoint.keep_best=true to keep it")
    assert capsys.readouterr().err.count(warning) == 1
    assert saved_steps(released) == [4, 6, 8, 10][-max_to_keep:]


def best_eval_step(out_dir) -> int:
    evals = {line["step"]: line["eval_loss"] for line in read_metrics(out_dir) if "eval_loss" in line}
    return min(evals, key=evals.get)


def saved_steps(out_dir) -> list[int]:
    return sorted(int(name) for name in os.listdir(os.path.join(out_dir, "checkpoints")))


def numpy_checksum(x: np.ndarray) -> int:
    """The formula of checkpoint._checksum, written again on the host: sum(word[i] * (2i + 1)) mod 2^32."""
    words = x.view(np.uint32) if x.dtype.itemsize == 4 else x.view(f"uint{8 * x.dtype.itemsize}")
    words = words.reshape(-1).astype(np.uint64)  # uint64 products wrap mod 2^64, a multiple of 2^32
    weights = 2 * np.arange(words.size, dtype=np.uint64) + 1
    return int(np.sum(words * weights) % 2**32)


def test_fingerprint_is_the_written_formula():
    rng = np.random.default_rng(0)
    tree = {"kernel": rng.standard_normal((32, 48), dtype=np.float32), "count": np.int32(-7),
            "deep": [rng.standard_normal((3, 4, 5), dtype=np.float32)],
            "half": rng.standard_normal(10).astype(jnp.bfloat16)}
    assert checkpoint.fingerprint(tree) == {"count": numpy_checksum(np.asarray(tree["count"])),
                                            "deep/0": numpy_checksum(tree["deep"][0]),
                                            "half": numpy_checksum(np.asarray(tree["half"])),
                                            "kernel": numpy_checksum(tree["kernel"])}


def tiny_cfg(out_dir, *extra):
    return config.load(["--config", "configs/tiny.yaml", "--model.n_layer=1", "--model.d_model=32",
                        "--model.n_head=2", "--model.vocab_size=256", f"--run.out_dir={out_dir}", *extra])


def test_one_flipped_bit_in_any_array_changes_its_checksum_only(tmp_path):
    state = jax.device_get(step_lib.fresh_state(tiny_cfg(tmp_path), 256))
    before = checkpoint.fingerprint(state)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(0)
    for i, leaf in enumerate(leaves):
        words = np.array(leaf).reshape(-1).view(np.uint32)  # a copy: every leaf is fp32 or int32
        words[rng.integers(words.size)] ^= np.uint32(1 << int(rng.integers(32)))
        flipped = [*leaves[:i], words.view(leaf.dtype).reshape(leaf.shape), *leaves[i + 1:]]
        after = checkpoint.fingerprint(jax.tree.unflatten(treedef, flipped))
        assert {k for k in before if before[k] != after[k]} == {list(before)[i]}


SHARDED_SCRIPT = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import checkpoint
rng = np.random.default_rng(0)
tree = {"a": rng.standard_normal((16, 24), dtype=np.float32), "b": rng.integers(-9, 9, (8, 4), dtype=np.int32)}
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
for spec in (P(), P("fsdp"), P(None, "fsdp"), P("data", "fsdp"), P("fsdp", "data")):
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)
    print(checkpoint.fingerprint(sharded) == checkpoint.fingerprint(tree), flush=True)
"""


def test_fingerprint_is_the_same_however_the_arrays_are_sharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["True"] * 5, proc.stderr


def test_a_state_holding_inf_or_nan_is_refused_before_anything_is_written(tmp_path):
    cfg = tiny_cfg(tmp_path)
    fresh = step_lib.fresh_state(cfg, 256)
    for bad in (fresh._replace(params=jax.tree.map(lambda x: x.at[0].set(jnp.inf), fresh.params)),
                fresh._replace(opt_state=fresh.opt_state._replace(  # the optimizer state is checked too
                    acc_grads=jax.tree.map(lambda x: x.at[0].set(jnp.nan), fresh.opt_state.acc_grads)))):
        saver = checkpoint.Checkpointer(cfg)
        with pytest.raises(UserError, match="holds inf or NaN"):
            saver.save(bad, data_seed=0)
        saver.close()
        assert os.listdir(saver.directory) == []


def test_a_checkpointer_closed_before_any_save_leaves_no_thread_behind(tmp_path):
    """A run refused right after the Checkpointer is made (a changed config, a wrong init.from) closes it and exits:
    orbax's removal of earlier temporary folders, slowed here to outlast the process, must be over by then, or its
    thread logs a traceback after the one-line error."""
    script = f"""if True:
        import asyncio
        from orbax.checkpoint._src.path import temporary_paths
        from jaxtrain import checkpoint, config
        cleanup = temporary_paths.cleanup_temporary_paths

        async def slow_cleanup(*args, **kwargs):
            await asyncio.sleep(1.0)
            return await cleanup(*args, **kwargs)

        temporary_paths.cleanup_temporary_paths = slow_cleanup
        checkpoint.Checkpointer(config.load(["--config", "configs/tiny.yaml", "--model.vocab_size=256",
                                             "--run.out_dir={tmp_path}"])).close()
        print("closed")"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "closed\n" and "Traceback" not in proc.stderr, proc.stderr


def test_event_loops_made_while_a_checkpointer_is_open_finish_their_tasks_before_they_close(tmp_path):
    """Orbax's save threads make their own loops and close one when a write fails, the others in flight: on a full
    200 KiB tmpfs each of those then printed an "Event loop is closed" traceback from tensorstore's callbacks (160
    of them). A loop made while a Checkpointer is open runs its pending tasks at close; after the close, as before."""
    def pending_task_ran_at_close() -> bool:
        loop, ran = asyncio.new_event_loop(), []

        async def write():
            await asyncio.sleep(0.01)
            ran.append(True)

        loop.create_task(write())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # asyncio's "Task was destroyed but it is pending" where it did not run
            loop.close()
        return bool(ran)

    saver = checkpoint.Checkpointer(tiny_cfg(tmp_path))
    try:
        assert pending_task_ran_at_close()
    finally:
        saver.close()
    assert not pending_task_ran_at_close()


def test_rotation_deletes_only_after_the_next_checkpoint_is_committed(tmp_path):
    """max_to_keep=1 with async saves: when orbax deletes step 1, step 2 is renamed into place with its meta and
    fingerprint written (orbax's CheckpointManager._finalize deletes after the async commit)."""
    cfg = tiny_cfg(tmp_path, "--checkpoint.max_to_keep=1")
    fresh = step_lib.fresh_state(cfg, 256)
    states = [fresh._replace(opt_state=fresh.opt_state._replace(gradient_step=jnp.int32(s))) for s in (1, 2)]
    saver = checkpoint.Checkpointer(cfg)
    seen = []
    delete_steps = saver.manager._checkpoint_deleter.delete_steps

    def checking_delete_steps(steps):
        if steps:
            with open(os.path.join(saver.directory, "2", "meta", "metadata")) as f:
                seen.append((steps, sorted(os.listdir(saver.directory)), json.load(f)["fingerprint"]))
        delete_steps(steps)

    saver.manager._checkpoint_deleter.delete_steps = checking_delete_steps
    for state in states:
        saver.save(state, data_seed=0)
    saver.close()
    assert [(steps, listed) for steps, listed, _ in seen] == [([1], ["1", "2"])]
    assert seen[0][2] == checkpoint.fingerprint(states[1])
    assert sorted(os.listdir(saver.directory)) == ["2"]


@contextlib.contextmanager
def unwritable(folder: str):
    """`folder` made unwritable meanwhile: read-only to its user, or immutable where the tests run as root (whom
    permissions do not stop; chattr +i, which this machine's file systems take)."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
    elif subprocess.run(["chattr", "+i", folder], capture_output=True).returncode != 0:
        pytest.skip("no way to make a folder unwritable for root here: chattr +i is refused or missing")
    try:
        yield
    finally:
        if os.geteuid() != 0:
            os.chmod(folder, 0o755)
        else:
            subprocess.run(["chattr", "-i", folder], check=True)


def test_a_checkpoints_folder_made_unwritable_during_a_run_fails_its_next_save_with_no_thread_left_waiting(tmp_path):
    """checkpoints/ made unwritable between two saves: the second one's folder could not be made, in the orbax
    thread that makes it, and the write threads orbax starts beside that one waited for it until their 300 s
    timeout, which the process's end waited out (measured: the run's error line, then exit after 309 s). Now the
    step's folder is made in save(): one line naming the cause and the newest complete step, and no thread of the
    save is left once the checkpointer is closed (within 60 s here, even under load)."""
    cfg = tiny_cfg(tmp_path)
    fresh = step_lib.fresh_state(cfg, 256)
    saver = checkpoint.Checkpointer(cfg)
    saver.save(fresh._replace(opt_state=fresh.opt_state._replace(gradient_step=jnp.int32(1))), data_seed=0)
    saver.wait()
    before = set(threading.enumerate())
    with unwritable(saver.directory):
        with pytest.raises(UserError) as failed:
            saver.save(fresh._replace(opt_state=fresh.opt_state._replace(gradient_step=jnp.int32(2))), data_seed=0)
            saver.wait()
        with contextlib.suppress(UserError):  # the failed save, said again
            saver.close()
    deadline = time.monotonic() + 60
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(threading.enumerate()) - before, [t.name for t in set(threading.enumerate()) - before]
    refused = "[Errno 1] Operation not permitted" if os.geteuid() == 0 else "[Errno 13] Permission denied"  # +i, 555
    assert str(failed.value) == (f"a checkpoint could not be written into {saver.directory} ({refused}: "
                                 f"'{saver.directory}/2.orbax-checkpoint-tmp'); the newest complete one is step 1: "
                                 f"mend what it names (free space, write access, the storage) and run the same "
                                 f"command to resume")
    assert sorted(os.listdir(saver.directory)) == ["1"]


def array_compressors(state_dir) -> set:
    """The compressor in the zarr metadata of every array of a saved state (None: uncompressed)."""
    kvstore = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}/"}).result()
    return {json.loads(kvstore.read(key).result().value)["compressor"] and "zstd"
            for key in kvstore.list().result() if key.endswith(b"/.zarray")}


def test_a_checkpoint_with_compressed_arrays_still_resumes(tmp_path):
    """Until the arrays were saved uncompressed, orbax's StandardSave wrote them zstd-compressed (its default):
    such a checkpoint resumes, bit for bit, and passes its fingerprint."""
    cfg = tiny_cfg(tmp_path)
    fresh = step_lib.fresh_state(cfg, 256)
    state = fresh._replace(params=jax.tree.map(lambda x: x + 0.5, fresh.params))
    saver = checkpoint.Checkpointer(cfg)
    saver.save(state, data_seed=0)
    saver.close()
    state_dir = os.path.join(saver.directory, "0", "state")
    assert array_compressors(state_dir) == {None}
    shutil.rmtree(state_dir)
    with ocp.StandardCheckpointer() as earlier:  # the state as jaxtrain wrote it before
        earlier.save(state_dir, state)
    assert array_compressors(state_dir) == {"zstd"}

    resumed = checkpoint.Checkpointer(cfg).resume(checkpoint.abstract_state(cfg, 256, mesh_lib.make_mesh(cfg)))
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state)), jax.tree.leaves(jax.device_get(state)),
                    strict=True):
        assert np.array_equal(a, b)


def test_a_save_that_fails_in_the_background_stops_the_run_before_its_next_save(tmp_path, cache_dir, monkeypatch):
    """The failure of an async save (here its arrays' write, as a full disk fails it) reaches the loop at the step
    after the write ended, not at the next save: the run stops there, without orbax's tracebacks (three of ~60 lines
    each), naming the cause and the newest complete checkpoint."""
    from orbax.checkpoint._src.serialization import serialization
    out_dir, write_arrays, failed = str(tmp_path / "run"), serialization.async_serialize_from_host, threading.Event()

    async def full_at_step_16(host_arrays, spec, **kwargs):
        if "/16.orbax-checkpoint-tmp/" in str(spec):
            failed.set()
            raise OSError(errno.ENOSPC, "No space left on device")
        return await write_arrays(host_arrays, spec, **kwargs)

    real_window = run.Trainer.window

    def slowed_once_failed(self, step):  # 7 steps of 50 ms: ample time for orbax's threads to end, even under load
        time.sleep(0.05 if failed.is_set() else 0)
        return real_window(self, step)

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_at_step_16)
    monkeypatch.setattr(run.Trainer, "window", slowed_once_failed)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("absl").addHandler(handler)
    try:
        with pytest.raises(UserError) as stopped:
            run.train(config.load(small_args(out_dir, cache_dir, "--checkpoint.every=8", "--train.steps=40")))
    finally:
        logging.getLogger("absl").removeHandler(handler)
    assert str(stopped.value) == (f"a checkpoint could not be written into {out_dir}/checkpoints ([Errno 28] No "
                                  f"space left on device); the newest complete one is step 8: mend what it names "
                                  f"(free space, write access, the storage) and run the same command to resume")
    trained = [line["step"] for line in read_metrics(out_dir) if "loss" in line]
    assert 16 <= trained[-1] < 24, trained  # the save at step 24 would raise it too, step 24 logged before
    assert "No space left on device" in log.getvalue() and "Traceback" not in log.getvalue(), log.getvalue()


def test_asyncios_reports_of_orbaxs_failed_writes_go_and_its_others_stay():
    """The writes still in flight when a save fails end after the run's error line, each in asyncio's "Task
    exception was never retrieved" with a traceback (~80 on the tiny model, on a full tmpfs): those about orbax's
    tasks are dropped; asyncio's other records, and orbax's own records (on one line), are kept."""
    keep = orbax_quiet.one_line_records  # a Checkpointer installs it on asyncio's logger and absl's

    def record(name, message, pathname="/x/asyncio/base_events.py"):
        failure = (ValueError, ValueError("RESOURCE_EXHAUSTED"), None)
        return logging.LogRecord(name, logging.ERROR, pathname, 1, message, None, failure)

    orbax_task = "Task exception was never retrieved\nfuture: <Task coro=<f() defined at /v/orbax/checkpoint/a.py:1>>"
    other_task = "Task exception was never retrieved\nfuture: <Task coro=<f() defined at /v/mine/a.py:1>>"
    assert not keep(record("asyncio", orbax_task)) and keep(record("asyncio", other_task))
    orbax_own = record("absl", "Failed to run 4 Handler Commit operations", "/v/orbax/checkpoint/a.py")
    assert keep(orbax_own) and orbax_own.exc_info is None


def test_a_save_that_fails_is_one_line_and_the_same_command_resumes(tmp_path, cache_dir, monkeypatch, capsys):
    """A full disk fails orbax's background write (tensorstore's "RESOURCE_EXHAUSTED: ... No space left on device"
    ValueError, seen on a 30 MB tmpfs), which surfaces at the next save or wait: that was ~3,300 lines of
    tracebacks, exit 1, and the close skipped (on gs://, a lease the next start waited out). Now one line naming the
    cause and the newest complete checkpoint, the folder given back: the same command resumes from that step."""
    out_dir = str(tmp_path / "run")
    args = small_args(out_dir, cache_dir, "--checkpoint.every=2")
    real_save, real_wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished
    disk_full = ValueError('RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database: No space left on device')

    def full_after_step_4(self, step, *args, **kwargs):
        self.full = getattr(self, "full", False) or step > 4
        if self.full:  # as orbax raises a failed background write: at the next save, which waits for it
            raise disk_full
        return real_save(self, step, *args, **kwargs)

    def waits_on_the_failed_write(self):  # and again at each wait after (the close's too), as the review saw
        real_wait(self)
        if getattr(self, "full", False):
            raise disk_full

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_after_step_4)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", waits_on_the_failed_write)
    with pytest.raises(UserError) as failed:
        run.train(config.load(args))
    assert re.fullmatch(rf"a checkpoint could not be written into {re.escape(out_dir)}/checkpoints "
                        rf"\(RESOURCE_EXHAUSTED: .*No space left on device\); the newest complete one is step 4: "
                        rf"mend what it names \(free space, write access, the storage\) and run the same command "
                        rf"to resume",
                        str(failed.value)), failed.value
    monkeypatch.undo()
    capsys.readouterr()
    run.train(config.load(args))  # the lock was given back: this start takes it
    assert "resuming from step 4" in capsys.readouterr().err
    assert [line["step"] for line in read_metrics(out_dir) if "loss" in line] == list(range(1, 9))
