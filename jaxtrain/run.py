"""`python -m jaxtrain.run --config configs/X.yaml [--section.key=value ...]`: the main job.

Wires config, data, mesh, model, optimizer, checkpoints and metrics together; the math lives in optim.py and
step.py. Resumes from the newest checkpoint in run.out_dir unless run.fresh. SIGTERM or Ctrl-C saves the step in flight
and exits 0, on every process the same step; a second one stops at once (see preemption.py).
"""

if __name__ == "__main__":  # before the imports below (jax takes seconds): a signal during them stops cleanly
    from jaxtrain import hostmem, preemption
    hostmem.use_huge_pages(keep_blocked=True)  # starts this process over once, with glibc's malloc on huge pages
    preemption.install()
    hostmem.release_signals()  # a signal sent during the re-execution reaches preemption's handler

import dataclasses
import functools
import hashlib
import sys
import time

import jax
import numpy as np

from jaxtrain import agreed_stop
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import checkpoint_kind
from jaxtrain import checkpoint_model
from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import data_stats
from jaxtrain import dryrun
from jaxtrain.divergence import Divergence
from jaxtrain import mesh as mesh_lib
from jaxtrain import metrics as metrics_lib
from jaxtrain import preemption
from jaxtrain import runfolder
from jaxtrain import runlock
from jaxtrain import same_run
from jaxtrain import sample as sample_lib
from jaxtrain import model_source
from jaxtrain import step as step_lib
from jaxtrain import torch_format
from jaxtrain.config import Config
from jaxtrain.errors import UserError, exit_on_user_error


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error():
        cfg = config_lib.load(sys.argv[1:] if argv is None else argv)
        train(cfg)


class Trainer:
    """The pieces of one run, built once from the config."""

    def __init__(self, cfg: Config):
        # Before this launch's processes join: a live run's would be ended. A gs:// lease it saw die is taken at once.
        dead_lease = runlock.check_free(cfg.run.out_dir, cfg.run.lock_timeout_s)
        mesh_lib.init_distributed()
        preemption.reclaim()
        self.is_main = jax.process_index() == 0
        self.lock = self._take_lock(cfg, dead_lease)
        self.checkpointer = None
        try:
            self._build(cfg)
        except BaseException:
            self.close()
            raise

    def _take_lock(self, cfg: Config, dead_lease: int | None):
        """The run folder's lock, taken by process 0 before anything touches the folder, so that a refused start
        leaves it as it was. Every process learns whether it was taken and a refused start ends in one line on each
        (the others went on into a collective process 0 never joined: a Gloo traceback 30 s later)."""
        lock = refusal = None
        if self.is_main:
            try:
                lock = runlock.take(cfg.run.out_dir, cfg.run.lock_timeout_s, dead_lease)
            except UserError as e:
                refusal = e
        if not mesh_lib.from_process_0(refusal is None):
            raise refusal or UserError(f"process 0 refused to start on run.out_dir={cfg.run.out_dir} (its output "
                                       f"says why and what to do); this process stops with it")
        return lock

    def _build(self, cfg: Config) -> None:
        runfolder.refuse_unfinished_set_aside(cfg.run.out_dir, cfg.run.fresh)
        self.data = load_data_everywhere(cfg)
        vocab_size, too_small = data_lib.vocab_size_before_resume(cfg.model.vocab_size, self.data, cfg.run.fresh)
        # Written down, so that config.yaml and every checkpoint say what the model was built with.
        self.cfg = cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
        # Before the resume (which may set steps aside): the log.* keys and the data are the same after it.
        self.sample_tokenizer = self._sample_tokenizer(cfg) if cfg.log.sample_tokens and not too_small else None
        self.mesh = mesh_lib.make_mesh(cfg)
        self.abstract_state = checkpoint_lib.abstract_state(cfg, vocab_size, self.mesh)
        self.state_sharding = jax.tree.map(lambda x: x.sharding, self.abstract_state)
        # The newest checkpoint that verifies, or None. run.fresh opens the checkpoints later (open_run_folder).
        self.resumed = None if cfg.run.fresh else self._open_checkpoints().resume(self.abstract_state)
        if self.resumed is not None:  # with the run's own init.from, which config.yaml records (same_run.check)
            self.cfg = cfg = self.checkpointer.cfg
        if self.resumed is None and cfg.init.from_ is not None:  # what the run starts from, before it is read
            checkpoint_kind.check_torch_source(cfg.init.from_, "init.from")
            checkpoint_model.check_written(cfg.init.from_, cfg.model)
            checkpoint_model.check_vocab_rows(cfg.init.from_, self.data)
        # After init.from's checks, as torchref: one with too few rows for the data says why better than the size
        data_lib.refuse_vocab_size_after_resume(too_small, self.resumed is not None, self.data, cfg.run.out_dir)
        self.data_seed = self._data_seed()
        self.jit_train_step = step_lib.jit_train_step(
            cfg, self.data_seed, out_shardings=(self.state_sharding, mesh_lib.replicated(self.mesh)))
        self.eval_step = step_lib.jit_eval_step(cfg)

    def _sample_tokenizer(self, cfg: Config) -> model_source.Tokenizer:
        """The end-of-run sample's tokenizer, loaded before the first step: a data folder whose tokenizer jaxtrain
        does not have (or a gpt2 one without its files here), or whose meta.json names a tokenizer its vocab_size
        cannot hold (the prompt's ids past the model's rows), is refused now, not after the training."""
        refused = f"the end-of-run sample (log.sample_tokens={cfg.log.sample_tokens}) could not be drawn"
        try:
            tokenizer = model_source.tokenizer(self.data.tokenizer)
        except UserError as e:
            raise UserError(f"{refused}: {e}. To train without it, set --log.sample_tokens=0") from None
        if (top := max(tokenizer.encode(cfg.log.sample_prompt), default=0)) >= cfg.model.vocab_size:
            raise UserError(f"{refused}: log.sample_prompt encodes to token id {top} with the data's tokenizer "
                            f"({self.data.tokenizer}), past the model's {cfg.model.vocab_size} rows: {self.data.path}"
                            f"/meta.json names a tokenizer its vocab_size does not hold; set --log.sample_tokens=0, "
                            f"or fix it before a run's first start (its fingerprint, which a resume checks, covers "
                            f"meta.json)")
        return tokenizer

    def _open_checkpoints(self) -> checkpoint_lib.Checkpointer:
        self.checkpointer = checkpoint_lib.Checkpointer(self.cfg, self.data.fingerprint)
        return self.checkpointer

    def open_run_folder(self) -> None:
        """run.fresh: move the previous run aside and open the checkpoints, once nothing can refuse the start any
        more (the data and config checked, init.from read whole, the step compiled and fitting), so that a refused
        fresh start leaves the previous run in place, to resume. Without run.fresh they are open already."""
        if self.checkpointer is not None:
            return
        if self.is_main:
            runfolder.set_aside_previous_run(self.cfg.run.out_dir)
        mesh_lib.barrier("run.fresh")  # no host opens the checkpoints before the set-aside is done
        self._open_checkpoints()

    def close(self) -> None:
        """Finish the saves in flight and give the run folder back."""
        try:
            if self.checkpointer:
                try:
                    self.checkpointer.wait()
                finally:
                    self.checkpointer.close()
        finally:  # a save that failed still gives the folder back
            if self.lock:
                self.lock.release()

    def _data_seed(self) -> int:
        """Seed of the batch order and dropout: the resumed checkpoint's; a full training state's in init.from
        (data.continued_seed: the rule torchref follows too); else run.seed."""
        cfg = self.cfg
        if self.resumed is not None:
            return self.resumed.data_seed
        if cfg.init.from_ is not None and checkpoint_kind.holds_training_state(cfg.init.from_):
            return data_lib.continued_seed(checkpoint_kind.read_trainer_state(cfg.init.from_)["data"]["seed"], cfg)
        return cfg.run.seed

    def tokens_before_start(self) -> int | None:
        """The tokens trained on before the first step this run takes, which it goes on counting: the resumed
        checkpoint's count, or that of init.from's full training state (its data.batch_size may have been another);
        None where neither says (a checkpoint of before the count: metrics.jsonl's lines do) or nothing ran."""
        if self.resumed is not None:
            return self.resumed.tokens
        source = self.cfg.init.from_
        if source is None or not checkpoint_kind.holds_training_state(source):
            return None
        return checkpoint_kind.read_trainer_state(source)["data"].get("tokens")

    def compile(self) -> None:
        """Compile the train step ahead of the loop, so that step 1's throughput is not the compile time, from the
        state's shapes: a step that does not fit is refused (check_fits) before a fresh state is made, which on a
        host too small for it hung or ended in XLA's RESOURCE_EXHAUSTED traceback."""
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh):  # mesh.batch_sharded pins the activations to this mesh
            lowered = self.jit_train_step.lower(self.abstract_state, *self.window(0))
            self.train_step = dryrun.compile_fitting(lowered, jax.local_devices()[0])
        dryrun.check_fits(self.train_step, self.abstract_state, jax.local_devices()[0])  # before an OOM in step 1
        self.compile_s = time.perf_counter() - t0  # said as training starts (run.train_steps)

    def initial_state(self) -> step_lib.TrainState:
        """The newest verified checkpoint's state; else a fresh one (created directly in its sharding), with a
        torch-format checkpoint's weights or whole training state in it when init.from names one."""
        cfg, resumed = self.cfg, self.resumed
        if resumed is not None:
            print(f"resuming from step {resumed.step} ({self.checkpointer.directory}/{resumed.step})", file=sys.stderr)
            return resumed.state
        fresh = jax.jit(functools.partial(step_lib.fresh_state, cfg, cfg.model.vocab_size),
                        out_shardings=self.state_sharding)()
        if cfg.init.from_ is None:
            return fresh
        state, kind = torch_format.load(cfg.init.from_, fresh, cfg)
        same_run.check_init_step(cfg, int(state.step))
        what = f"the full training state at step {int(state.step)}" if kind == "full" else "weights only, step 0"
        print(f"initialised from {cfg.init.from_}: {what}", file=sys.stderr)
        return state

    def window(self, step: int):
        """The micro-batches of optimizer step `step` (0-based), as global arrays sharded over the devices."""
        return self._global(data_lib.window(self.data, step=step, **self._batch_args()))

    def eval_batches(self) -> list:
        """The fixed validation set: train.eval_batches batches of data.batch_size sequences, each cut into
        micro-batches like a training window (so that evaluation fits where training does)."""
        return [self._global(data_lib.eval_batch(self.data, index=i, **self._batch_args()))
                for i in range(self.cfg.train.eval_batches)]

    def _batch_args(self) -> dict:
        cfg = self.cfg
        return dict(seed=self.data_seed, batch_size=cfg.data.batch_size, accum_steps=cfg.optim.grad_accum_steps,
                    seq_len=cfg.model.seq_len, process_index=jax.process_index(), process_count=jax.process_count())

    def _global(self, local_batch) -> tuple:
        """This process's rows -> global (k, B, T) arrays split over all devices."""
        sharding = mesh_lib.window_sharding(self.mesh)
        return tuple(mesh_lib.global_array(x, sharding) for x in local_batch)

    def evaluate(self, params, batches) -> tuple[float, float]:
        """Token-weighted mean CE and top-1 accuracy over all eval batches."""
        with jax.set_mesh(self.mesh):
            return step_lib.eval_means([self.eval_step(params, inputs, targets) for inputs, targets in batches])


def train(cfg: Config) -> dict:
    """Train to cfg.train.steps; returns the summary of this run. run.dry_run: only say whether it fits."""
    stop = preemption.install()  # `python -m jaxtrain.run` installed it before importing jax
    try:
        if cfg.run.dry_run:  # no step to finish and save: a signal stops the compile at once, not after it
            stop.nothing_left_to_save("a dry run trains and saves nothing")
            return dryrun.report(cfg)
        summary, state, trainer = train_steps(cfg, stop)
        if state is None or summary.get("stopped"):
            return summary
        several = jax.process_count() > 1
        stop.nothing_left_to_save(f"the run is trained and saved at step {summary['step']}", several)
        mesh_lib.barrier("trained")  # the summary line then says every process is past its last save
        if trainer.is_main:
            print(metrics_lib.summary_line(summary), file=sys.stderr)
        if cfg.log.sample_tokens:  # every process computes it (a collective, which a signal no longer cuts short)
            sample_lib.print_end_of_run_sample(trainer.cfg, state.params, trainer.sample_tokenizer, trainer.is_main)
        if several:  # here, not at exit: a signal now lets this process reach the barrier the others wait at
            jax.distributed.shutdown()
        return summary
    finally:
        preemption.uninstall()


def train_steps(cfg: Config, stop: preemption.StopRequest) -> tuple[dict, object, "Trainer | None"]:
    """(summary, final state, trainer) once every save is done and the run folder is given back; the state is None
    when no step ran. A signal until then is the loop's to agree on (see preemption.py)."""
    t0 = time.perf_counter()
    trainer = logger = None
    try:
        trainer = Trainer(cfg)
        cfg, agreed = trainer.cfg, agreed_stop.AgreedStop(stop, trainer.mesh)  # cfg: model.vocab_size resolved
        agreed.check_start_up()  # a signal during start-up stops it between phases
        # A fresh state is made after its step is compiled and checked against the memory; a resumed or init.from
        # one is read first, so that init.from's step and shapes are refused at once, not after a compile
        fresh = trainer.resumed is None and cfg.init.from_ is None
        if fresh:
            trainer.compile()
            agreed.check_start_up()
        state = trainer.initial_state()
        start = int(state.step)
        if start >= cfg.train.steps:
            print(f"already trained to step {start} (train.steps={cfg.train.steps}); nothing to do", file=sys.stderr)
            return {"steps": start}, None, trainer
        agreed.check_start_up()
        if not fresh:
            trainer.compile()
            agreed.check_start_up()
        stop.training_started()
        trainer.open_run_folder()
        if trainer.is_main:  # after every check: a refused start leaves the run folder as it was, and says no more
            config_lib.save(cfg, cfg.run.out_dir)
            data_stats.warn_small_val(trainer.data, cfg)
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        logger = metrics_lib.MetricsLogger(
            cfg, start_step=start, resumed=trainer.resumed is not None, start_tokens=trainer.tokens_before_start(),
            flops_per_token=metrics_lib.flops_per_token(cfg, n_params),
            n_devices=jax.device_count(), device_kind=jax.devices()[0].device_kind, is_main=trainer.is_main)
        if trainer.is_main:  # the last line before step 1, whether the state or the compile came first
            print(f"compiled the train step in {trainer.compile_s:.1f}s", file=sys.stderr)
        state, summary = loop(trainer, state, start, logger, agreed)
        summary["wall_s"] = time.perf_counter() - t0  # start-up and compilation included
        return summary, state, trainer
    except agreed_stop.StoppedInStartUp:
        hint = config_lib.start_up_stop_hint(cfg, "jaxtrain.run")
        print(f"stopped before the first step, nothing new to save; {hint}", file=sys.stderr)
        return {"stopped": True}, None, trainer
    finally:  # still under the StopRequest: a signal while the last saves finish waits for them
        try:
            if trainer:
                trainer.close()
        finally:
            if logger:
                logger.close()


def load_data_everywhere(cfg: Config) -> data_lib.TokenData:
    """The data, loaded by every process and the same on all (each host reads its own copy of the data folder): a
    process that cannot load it, or loads other data than process 0's, stops every process in one line each. One
    that failed alone left the others in a collective until the launch's timeout, and other data trained."""
    try:
        data, refusal = data_lib.load(cfg.data, cfg.model.seq_len), None
    except Exception as e:  # a UserError, or any other (an unreadable file: PermissionError), raised after the vote
        data, refusal = None, e
    digest = hashlib.sha256(data.fingerprint.encode()).digest()[:16] if data is not None else bytes(16)
    votes = mesh_lib.each_process(np.frombuffer(bytes([data is not None]) + digest, np.uint8))
    failed = [i for i, vote in enumerate(votes) if not vote[0]]
    if refusal or failed:
        raise refusal or UserError(f"process(es) {', '.join(map(str, failed))} could not load the data (their "
                                   f"output says why); this process stops with them")
    other = [i for i, vote in enumerate(votes) if bytes(vote[1:]) != bytes(votes[0][1:])]
    if other:
        where = f"data.path={cfg.data.path}" if cfg.data.path is not None else "the embedded corpus"
        raise UserError(f"process(es) {', '.join(map(str, other))} read other data than process 0 (the tokens or "
                        f"meta.json differ: data fingerprints differ; this process read {where}); each host must "
                        f"hold the same data: copy process 0's folder to every host")
    return data


def loop(trainer: Trainer, state, start: int, logger, agreed: agreed_stop.AgreedStop):
    """Steps start+1 .. train.steps. Each step's metrics are pulled to the host one step late, so the device
    never waits for logging; checkpoints, evals and the end sync on the step they follow."""
    cfg, eval_batches = trainer.cfg, trainer.eval_batches()
    logger.exclude_time()  # building the eval set is no training step's time (torchref builds it in its evals)
    divergence = Divergence(cfg, trainer.checkpointer.newest_complete_step, "jaxtrain", int(state.skipped))
    pending, summary = None, {"start_step": start}
    for step in range(start + 1, cfg.train.steps + 1):
        state, metrics = trainer.train_step(state, *trainer.window(step - 1))
        if pending is not None:
            report(pending, logger, divergence)
        pending, stopping = (step, metrics), agreed.after_step(trainer.checkpointer)
        save, evaluate = cfg.saves_at(step) or stopping, cfg.evaluates_at(step)
        if save or evaluate:
            summary.update(report(pending, logger, divergence))
            pending = None
        if evaluate:
            summary["eval_loss"], summary["eval_accuracy"] = trainer.evaluate(state.params, eval_batches)
            logger.eval(step, summary["eval_loss"], summary["eval_accuracy"])
            stopping = stopping or agreed.requested_now()  # a signal during it saves this step, as torchref does
            save = save or stopping
        if save:  # refuses a state holding inf or NaN
            logger.sync()  # metrics.jsonl reaches this step before its checkpoint can exist
            trainer.checkpointer.save(state, trainer.data_seed, summary["eval_loss"] if evaluate else None,
                                      logger.tokens)
        if save or evaluate:
            logger.exclude_time()
        if stopping and step < cfg.train.steps:  # said once the step is committed: an operator or a preemption
            # script acts on this line. At the last step the run is complete: train() says so (nothing_left_to_save)
            trainer.checkpointer.wait()
            print(f"saved step {step}; {config_lib.resume_hint(cfg, 'jaxtrain.run')}", file=sys.stderr)
            summary["stopped"] = True
            break
    summary["tokens_per_s"], summary["mfu"] = logger.mean_tokens_per_s(), logger.mean_mfu()
    return state, summary


def report(pending, logger, divergence: Divergence) -> dict:
    step, metrics = pending
    host = jax.device_get(metrics)
    counters = {"skipped": int(host["skipped"])} if divergence.policy == "skip" or "loss_scale" in host else {}
    if "loss_scale" in host:  # train.precision=fp16
        counters["loss_scale"] = float(host["loss_scale"])
    line = logger.train(step, float(host["loss"]), float(host["lr"]), float(host["grad_norm"]), int(host["tokens"]),
                        counters)
    divergence.check(line)
    return line


if __name__ == "__main__":
    main()
