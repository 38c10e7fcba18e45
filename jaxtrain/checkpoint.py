"""Orbax checkpoints in <out_dir>/checkpoints/<step>/, verified on resume, with fallback past a bad one.

Each step folder holds `state` (params and the whole optax state, MultiSteps counters included, saved sharded
by orbax) and `meta` (JSON: the step, the resolved config, the eval loss if one ran at that step, the tokens trained
on so far, and a fingerprint of every array). Saves are asynchronous: training continues while the arrays are
written, and orbax only renames a step folder into place once it is complete, so a crash during a save never leaves
a half-written checkpoint where resume would find it (its `<step>.orbax-checkpoint-tmp` folder is removed at the
next start; in a gs:// run folder, which has no rename, orbax writes in place and a step counts once its
commit_success.txt is written).
Restore places every array directly on its target sharding (MaxText-style), so a pod never gathers a full copy
on one host.

Resume takes the newest checkpoint that reads and matches its fingerprint. One that does not is moved, whole, to
<out_dir>/checkpoints.corrupt/<step>-<time> (out of orbax's sight, never deleted), with a warning, and the next
older one is tried. When none passes, the run stops and moves nothing. A changed config is not corruption: it is
refused (same_run.check) before any array is read.

Rotation keeps the newest checkpoint.max_to_keep, and with checkpoint.keep_best also the one with the lowest eval
loss so far (only steps where an eval ran have one), whatever its age. Orbax deletes the steps that fall out only
after the new step is committed (CheckpointManager._finalize, after the async write and its rename).
"""

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import yaml
from etils import epath
from jax.sharding import Mesh

from jaxtrain import checkpoint_kind
from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import orbax_quiet
from jaxtrain import runfolder
from jaxtrain import same_run
from jaxtrain import step as step_lib
from jaxtrain.config import Config
from jaxtrain.step import TrainState
from jaxtrain.errors import UserError, quiet_logger


class CorruptCheckpoint(UserError):
    """A step folder that cannot be read, or whose arrays do not match the fingerprint saved with them."""


class Resumed(NamedTuple):
    step: int
    state: TrainState
    data_seed: int  # orders the batches: run.seed, or the data seed of a full state the run started from
    tokens: int | None  # valid target tokens trained on up to the step; None in checkpoints of before the count


@dataclasses.dataclass
class KeepNewestAndBest:
    """Orbax preservation policy: the newest `n` steps, and `best_step` (set with checkpoint.keep_best).
    Orbax's own best_fn with max_to_keep keeps the n best instead of the n newest, and reads its metrics file of
    every step when it starts (a corrupt one stops the start); this policy takes the best from our meta."""
    n: int
    best_step: int | None = None

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        newest = sorted(info.step for info in checkpoints)[-self.n:]
        return [info.step in newest or info.step == self.best_step for info in checkpoints]


class Checkpointer:
    def __init__(self, cfg: Config, data_fingerprint: str | None = None):
        """`data_fingerprint`: the data the run trains on (data.TokenData.fingerprint), written into every save's
        meta and checked on resume; None where unknown (a conversion writes a checkpoint without its data)."""
        if cfg.model.vocab_size is None:  # the saved config must say what the model was built with
            raise ValueError("Checkpointer needs a config with model.vocab_size resolved (see run.Trainer)")
        self.directory = os.fspath(runfolder.path(cfg.run.out_dir, "checkpoints"))
        # A torch-format checkpoint among the step folders is a mistake to name, not a corrupt checkpoint to move
        # aside (and named before orbax lists the steps and warns about a folder it did not write).
        checkpoint_kind.check_own_steps(self.directory, "jaxtrain")
        self.keep = KeepNewestAndBest(cfg.checkpoint.max_to_keep)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=self.keep,
            enable_async_checkpointing=cfg.checkpoint.async_save,
            cleanup_tmp_directories=True,  # a killed save's <step>.orbax-checkpoint-tmp; on the primary process
            create=True,
            # The step's folders made in save(), not in a background thread: where that fails (checkpoints/ made
            # read-only during the run), the write threads orbax starts beside it wait for its signal until
            # their 300 s timeout, and the process cannot end before them.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        # Arrays uncompressed: zstd spent most of a save's CPU (taken from training by an async save) to shrink
        # weights and moments by ~4% (benchmarks/NOTES.md). Restore reads the codec a checkpoint's metadata names,
        # so the compressed checkpoints of earlier versions still restore.
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_compression=False), "meta": ocp.JsonCheckpointHandler()}
        # Orbax warns about each step folder it did not write; resume names such a folder itself.
        with quiet_logger("absl", logging.ERROR):
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        orbax_quiet.filter_logs()  # a failed save: one line, jaxtrain's own (_writing)
        orbax_quiet.DRAINING.enter()
        self.cfg, self.data_fingerprint = cfg, data_fingerprint
        self.saved_config = yaml.safe_load(config_lib.dump(cfg))  # meta's copy: the same at every save
        self.best = None  # {"step", "eval_loss"}: the lowest eval loss among this run's saves

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def newest_complete_step(self) -> int | None:
        """The newest checkpoint's step once the saves in flight are complete (None: there is none)."""
        self.wait()
        return self.latest_step()

    def save(self, state, data_seed: int, eval_loss: float | None = None, tokens: int | None = None) -> None:
        """Start saving `state` at its optimizer step (returns once its fingerprint is computed and the arrays are
        copied off the device, before the write completes). `data_seed` orders the batches (run.seed, or the data
        seed of a full state the run started from: data.continued_seed); `eval_loss`: the eval at this step;
        `tokens`: the valid target tokens trained on up to it (metrics.jsonl's count), which a resumed run goes on
        from (None where unknown).
        A state holding inf or NaN is refused (a UserError) before anything is written: finite metrics can still
        follow an update that overflowed the params (a huge LR times a finite gradient)."""
        step = int(state.step)
        sums = finite_fingerprint(state)
        if sums is None:
            go_on = same_run.new_run_from(self.cfg, self.newest_complete_step(), "jaxtrain", "lower optim.lr")
            raise UserError(f"the state after step {step} holds inf or NaN although its loss and gradient norm are "
                            f"finite (an update overflowed); it was not saved: {go_on}")
        if eval_loss is not None and (self.best is None or eval_loss < self.best["eval_loss"]):
            self._set_best({"step": step, "eval_loss": eval_loss})
        meta = {"step": step, "data_seed": data_seed, "data_fingerprint": self.data_fingerprint,
                "eval_loss": eval_loss, "best": self.best, "fingerprint": sums, "config": self.saved_config,
                "tokens": tokens}
        with self._writing():
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                            meta=ocp.args.JsonSave(meta)), force=True)

    def resume(self, abstract_state) -> Resumed | None:
        """The newest checkpoint that reads and matches its fingerprint; the newer ones that do not are moved
        aside. None when there is no checkpoint; a UserError when none passes (then nothing is moved)."""
        failed = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta, state, resumed_cfg = self._load(step, abstract_state)
            except CorruptCheckpoint as e:
                failed.append((step, str(e)))
                continue
            self._set_aside(failed)
            self._go_on_with(resumed_cfg)
            self._set_best(meta.get("best"))
            if jax.process_index() == 0:
                runfolder.warn_best_released(self.best, self.manager.all_steps(), self.cfg.checkpoint.keep_best,
                                             self.cfg.checkpoint.max_to_keep)
            return Resumed(step, state, meta.get("data_seed", meta["config"]["run"]["seed"]), meta.get("tokens"))
        if failed:
            raise UserError(f"none of the {len(failed)} checkpoints in {self.directory} can be resumed (newest: "
                            f"{failed[0][1]}); start over with --run.fresh=true, which moves them aside")
        return None

    def _go_on_with(self, cfg: Config) -> None:
        """The resumed run's config (its own init.from) in the checkpoints saved from now on."""
        self.cfg, self.saved_config = cfg, yaml.safe_load(config_lib.dump(cfg))

    def restore(self, step: int, abstract_state) -> TrainState:
        """The state saved at `step`, laid out as `abstract_state` (ShapeDtypeStructs with shardings), checked
        against its fingerprint."""
        return self._load(step, abstract_state)[1]

    def _load(self, step: int, abstract_state) -> tuple[dict, TrainState, Config]:
        """Meta, then the data and config checks (from meta alone: a refused resume, a changed model shape
        included, names the changed keys before any array is read), then the arrays and their fingerprint; and the
        config the run goes on with (same_run.check)."""
        where = self._step_dir(step)
        with _reading(where):
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            saved_config = meta["config"]
        check_named_step(meta, step, where)
        mesh = jax.tree.leaves(abstract_state)[0].sharding.mesh  # where one process refuses, all of them do
        resumed_cfg = _on_every_process(lambda: self._same_run(saved_config, meta, step), mesh, UserError(
            f"another process refused to resume from {where} (its output says why); this process stops with it"))
        state = _on_every_process(lambda: self._read_state(step, abstract_state), mesh, CorruptCheckpoint(
            f"checkpoint {where} cannot be read on another process (its output names the array)"))
        if "fingerprint" in meta:  # checkpoints of jaxtrain before fingerprints have none to check against
            check_fingerprint(state, meta["fingerprint"], where)
        return meta, state, resumed_cfg

    def _same_run(self, saved_config: dict, meta: dict, step: int) -> Config:
        """The config the run goes on with from `step`, whose `meta` was read: a UserError where the config or this
        process's data differs from the ones that wrote it: the data first, whose change can change the config
        (a model.vocab_size of null: the data's), so that the refusal names the cause."""
        where = self._step_dir(step)
        if self.data_fingerprint is not None:
            data_lib.check_same_data(meta, self.data_fingerprint, self.cfg, where)
        return same_run.check(saved_config, self.cfg, where, step, "jaxtrain")

    def _read_state(self, step: int, abstract_state) -> TrainState:
        """The arrays of `step`, this process's shards of them. Read by orbax's handler, not the manager: the
        manager's restore ends in a barrier that a process whose read failed never reaches (the others waited in it
        for good)."""
        where = self._step_dir(step)
        args = ocp.args.PyTreeRestore(abstract_state,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
        try:
            with _reading(where):
                return ocp.PyTreeCheckpointHandler().restore(epath.Path(where) / "state", args=args)
        except CorruptCheckpoint as e:
            if jax.process_index() != 0:  # process 0 names it as it moves the step aside
                print(f"warning: {e}", file=sys.stderr)
            raise

    def _set_aside(self, failed: list[tuple[int, str]]) -> None:
        """Move each failed step folder out of orbax's namespace, whole (the primary process moves; all wait)."""
        if not failed:
            return
        if jax.process_index() == 0:
            aside = epath.Path(self.directory).with_name(runfolder.CORRUPT_CHECKPOINTS)
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            for step, reason in failed:
                target = aside / f"{step}-{stamp}"
                runfolder.move(epath.Path(self._step_dir(step)), target)
                print(f"warning: {reason}; moved it to {target}", file=sys.stderr)
        mesh_lib.barrier("jaxtrain: corrupt checkpoints set aside")
        self.manager.reload()

    def _set_best(self, best: dict | None) -> None:
        self.best = best
        if self.cfg.checkpoint.keep_best and best is not None:
            self.keep.best_step = best["step"]

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def wait(self) -> None:
        with self._writing():
            self.manager.wait_until_finished()

    def background_failure(self) -> UserError | None:
        """The UserError of a save that failed in orbax's background thread since the last look, else None. Looked
        at after every step: a run ends at the step after a write failed, instead of training on to its next save
        for a checkpoint that cannot be written."""
        try:
            with self._writing():
                if not self.manager.is_saving_in_progress():  # the last save is over: its failure raises at once
                    self.manager.wait_until_finished()
        except UserError as e:
            return e
        return None

    @contextlib.contextmanager
    def _writing(self):
        """A save that failed in orbax's background thread (a full disk, a bucket refusing the write) surfaces at
        the next look, save or wait as the storage's own exception: one line then, naming it and the newest
        checkpoint that is complete, from which the same command resumes."""
        try:
            yield
        except Exception as e:
            with contextlib.suppress(Exception):  # the saves still in flight, which may complete (or fail again)
                self.manager.wait_until_finished()
            raise self.cannot_write(e) from None

    def cannot_write(self, error: BaseException | str) -> UserError:
        """The failed save's one line, naming `error` (runfolder.unwritten_checkpoint, torchref's too)."""
        complete = saved_steps(self.cfg.run.out_dir)
        return runfolder.unwritten_checkpoint(self.directory, error, complete[-1] if complete else None)

    def close(self) -> None:
        # Orbax's close waits for the saves, not for the thread its constructor started to remove a killed save's
        # temporary folders: a run refused right after start-up would end the interpreter under that thread, which
        # then logs a traceback ("cannot schedule new futures after interpreter shutdown").
        self.manager._maybe_await_cleanup_tmp_directory()
        try:
            with self._writing():
                self.manager.close()
        finally:
            orbax_quiet.DRAINING.leave()


def saved_steps(out_dir: str) -> list[int]:
    """The steps of a run folder's complete checkpoints, oldest first, as orbax lists them (a save cut short, still
    in its temporary folder, is not one); reads only, creates nothing."""
    directory = runfolder.path(out_dir, "checkpoints")
    if not directory.is_dir():
        return []
    with quiet_logger("absl", logging.ERROR):  # orbax's read_only warns of each saving option it turns off
        options = ocp.CheckpointManagerOptions(read_only=True, create=False)
        with ocp.CheckpointManager(os.fspath(directory), options=options) as manager:
            return sorted(manager.all_steps())


def _on_every_process(read, mesh: Mesh, elsewhere: UserError):
    """read() on every process; where it raises a UserError on any of them, each raises (its own, or `elsewhere`),
    instead of some going on into a collective that the others never join."""
    try:
        result, refusal = read(), None
    except UserError as e:
        result, refusal = None, e
    if jax.process_count() > 1 and bool(mesh_lib.any_process(refusal is not None, mesh)):
        refusal = refusal or elsewhere
    if refusal is not None:
        raise refusal
    return result


@contextlib.contextmanager
def _reading(where: str):
    """Orbax's failures (ValueError, KeyError, FileNotFoundError, tensorstore errors, ...) as one line.

    While orbax reads, its event loops finish their pending tasks before they close: when one array fails to
    read, orbax closes its loop with the other reads still in flight (_src/asyncio_utils.py,
    _run_sync_via_new_loop), and their tensorstore callbacks then print "Event loop is closed" tracebacks."""
    try:
        with orbax_quiet.DRAINING.meanwhile():
            yield
    except Exception as e:
        while e.__cause__ is not None:  # orbax wraps tensorstore's error, which names the file
            e = e.__cause__
        message = " ".join(str(e).split())[:300]  # one line: orbax's messages span many
        raise CorruptCheckpoint(f"checkpoint {where} cannot be read ({type(e).__name__}: {message})") from None


def check_named_step(meta: dict, step: int, where: str) -> None:
    """Raise CorruptCheckpoint where the step folder `where`, named `step`, holds another step (its `meta`):
    checkpoint_kind.other_step_held, the rule torchref's resume refuses by."""
    problem = checkpoint_kind.other_step_held(meta.get("step"), step, where)
    if problem:
        raise CorruptCheckpoint(problem)


def fingerprint(state) -> dict[str, int]:
    """A checksum of every array of `state`, keyed by its tree path ("params/wte/weight/value"): see _checksum.
    One jitted reduction over the (sharded) arrays; only the small replicated sums come to the host."""
    return _by_path(jax.device_get(_checksums(state)))


def finite_fingerprint(state) -> dict[str, int] | None:
    """The fingerprint of `state`, or None when a float in it is inf or NaN: both from one jitted call and one
    transfer to the host."""
    sums, finite = jax.device_get(_checksums_and_finite(state))
    return _by_path(sums) if finite else None


def _by_path(sums) -> dict[str, int]:
    return {jax.tree_util.keystr(path, simple=True, separator="/"): int(s)
            for path, s in jax.tree_util.tree_leaves_with_path(sums)}


def check_fingerprint(state, saved: dict[str, int], where: str, only: tuple[str, ...] = ("",)) -> None:
    """Raise CorruptCheckpoint naming the first array whose checksum differs from `saved`, or that one of them lacks.
    only: the paths (prefixes: "params/") `state` holds, a partial restore's; the saved arrays of other paths are not
    compared."""
    read = fingerprint(state)
    for path in [*read, *(p for p in saved.keys() - read.keys() if p.startswith(only))]:
        if saved.get(path) != read.get(path):
            raise CorruptCheckpoint(f"checkpoint {where} does not match its fingerprint: {path} was saved with "
                                    f"checksum {saved.get(path)} and reads {read.get(path)}")


@jax.jit
def _checksums(state):
    return jax.tree.map(_checksum, state)


@jax.jit
def _checksums_and_finite(state):
    return _checksums(state), step_lib.all_finite(state)


def _checksum(x: jax.Array) -> jax.Array:
    """sum(word[i] * (2i + 1)) mod 2^32 over x's bits as uint32 words, i the row-major position of the word.
    Integer addition is exact and order-free, so any mesh or sharding gives the same value; an odd weight makes
    any single flipped bit change the sum (2^k * odd is never 0 mod 2^32), the positions make swapped values
    change it. Positions come from iotas in x's own shape: flattening a sharded array would move data."""
    if x.dtype.itemsize < 4:  # bf16, int8, ...: zero-extended to one word each
        x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8-byte dtypes gain a last axis of 2 words
    position = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
        position = position * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    return jnp.sum(words * (2 * position + 1), dtype=jnp.uint32)


def abstract_state(cfg: Config, vocab_size: int, mesh: Mesh) -> TrainState:
    """ShapeDtypeStructs of a run's state with their fsdp shardings on `mesh`: the layout a run creates its state
    in, and the target a restore places the arrays on. Nothing is allocated."""
    abstract = jax.eval_shape(functools.partial(step_lib.fresh_state, cfg, vocab_size))
    shardings = mesh_lib.fsdp_sharding(mesh, abstract)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
