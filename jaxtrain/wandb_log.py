"""Weights & Biases (log.wandb=true): the fields of metrics.jsonl in one W&B run per run folder, across resumes.

Pure Python, no jax: torchref logs through it too. `wandb` is an optional package (`pip install 'jaxtrain[wandb]'`),
imported only when log.wandb is set; config_checks checks for it before anything starts (a missing one: one
line naming the fix, exit 2).

- The run: wandb draws its id at the first start, kept in <out_dir>/wandb.json from then on; every later start of the
  run folder that resumes one of its checkpoints passes it to wandb.init with resume="allow", so a resumed run
  continues the same W&B run. run.fresh sets wandb.json aside with the checkpoints and so starts a new W&B run; so
  does, in its own words, a start that resumes none (the attempts before it saved no checkpoint, or it starts from
  init.from): its metrics.jsonl starts over, and the earlier W&B run keeps the earlier attempt's steps, which this
  one's would otherwise have joined (another config's, with nothing to check it against) or skipped. Its name is
  log.wandb_name, else the run folder's name; its config, the resolved config.
- Local files: W&B's own folder (offline-run-*/ or run-*/, each holding a .wandb transaction log) goes into
  <out_dir>/wandb/ when the run folder is local; beside a gs:// run folder, where W&B cannot write, WANDB_DIR says
  where (default ./wandb). `wandb sync .../offline-run-*` uploads offline runs, the processes of a resumed run in
  order, as one run.
- Mode: log.wandb_mode, else WANDB_MODE, else online. Online without an API key or without the server, wandb.init
  raises (at once, or after WANDB_INIT_TIMEOUT, 90 s by default); the run then logs offline, with one line saying
  so. WANDB_MODE=disabled: wandb's stand-in run, whose id wandb.json does not keep. A run never stops for W&B:
  a failure later (wandb-core gone, its connection lost) is one warning, and the run goes on without W&B.

Each step at most once. A W&B run's history takes each step once and only in increasing order: wandb-core drops or
(`wandb sync`) renumbers a row whose step is not above the run's last one, and W&B has no way to take rows back
(rewinding, `resume_from="<id>?_step=N"`, is a server feature in private preview, absent from self-hosted servers,
that an offline run only records for the sync to request). A resumed run therefore logs only the steps above every
step W&B may hold: above the step it resumed at, above the last step of metrics.jsonl as the earlier process left it
(it may have gone on past its last checkpoint before it stopped: those steps are trained again and rewritten in
metrics.jsonl, but W&B keeps the first process's values, the same losses in a bit-exact resume), above the mark
an earlier start kept in wandb.json (`may_hold`: a start truncates metrics.jsonl to its checkpoint, so a process
stopped before it passed that last step would leave the file shorter than what W&B holds), and, online, above the
last step the server reports (run.starting_step - 1). A step's row is sent whole: the lines of one step (a train
line and an eval line) are gathered and sent when a later step begins, before each checkpoint save (sync: a run
resumed there would not send it again) and at the end. A kill -9 can lose the last row (and what wandb-core had not
yet written), never send one twice.
"""

import contextlib
import json
import os
import sys

import yaml

from jaxtrain import config as config_lib
from jaxtrain import config_checks
from jaxtrain import runfolder
from jaxtrain.errors import UserError

RUN_FILE = "wandb.json"  # in the run folder: {"id": ...}, and "may_hold": <step> from a resume that raised it


class WandbLog:
    """The W&B run of cfg.run.out_dir, for the lines of steps above `logged_step` (see the module's docstring):
    `start_step`, the step this process starts at; `resumed`, whether that is a checkpoint of the run folder;
    `last_jsonl_step`, the last step metrics.jsonl held before this start (None where there was none)."""

    def __init__(self, cfg, *, start_step: int, resumed: bool, last_jsonl_step: int | None):
        self.logged_step, self.row, self.row_step, self.failed = start_step, {}, None, False
        if config_checks.wandb_mode(cfg) == "disabled":  # WANDB_MODE=disabled: wandb's stand-in, a run of no record
            self.run = _start(cfg, None)
            return
        run_file = runfolder.path(cfg.run.out_dir, RUN_FILE)
        run_id, may_hold = _saved_run(run_file)
        if run_id is not None and not resumed:
            print(f"W&B: this start resumes no checkpoint of {cfg.run.out_dir}, so it logs to a new W&B run; the "
                  f"earlier attempt's steps stay in W&B run {run_id}", file=sys.stderr)
            run_id, may_hold = None, 0
        self.run = _start(cfg, run_id)
        if run_id is None:  # a new W&B run: its id, drawn by wandb, is this run folder's from now on
            runfolder.write_whole(run_file, json.dumps({"id": self.run.id}) + "\n")
        else:  # steps an earlier process of this run may have sent
            self.logged_step = max(start_step, last_jsonl_step or 0, may_hold, self.run.starting_step - 1)
            if self.logged_step > may_hold:  # kept before this start truncates metrics.jsonl
                runfolder.write_whole(run_file, json.dumps({"id": run_id, "may_hold": self.logged_step}) + "\n")

    def log(self, step: int, scalars: dict) -> None:
        """Add a metrics line's scalars (already named as W&B shows them) to the row of `step`."""
        if step <= self.logged_step or self.failed:
            return
        if self.row_step is not None and step != self.row_step:
            self.sync()
        self.row.update(scalars)
        self.row_step = step

    def sync(self) -> None:
        """Send the gathered row."""
        if self.row_step is not None and self._survived(self.run.log, self.row, step=self.row_step, commit=True):
            self.logged_step, self.row, self.row_step = self.row_step, {}, None

    def close(self) -> None:
        self.sync()
        if not self.failed:
            self._survived(self.run.finish)
            return
        with contextlib.suppress(Exception):  # its failure was said; finishing still writes down what W&B took
            self.run.finish()

    def _survived(self, call, *args, **kwargs) -> bool:
        """call(*args, **kwargs) on the W&B run, unless an earlier one failed; a failure (wandb-core gone, its
        connection lost) ends W&B's part of the run in one warning, never the training: metrics.jsonl has every
        step, and W&B the steps it took."""
        if self.failed:
            return False
        try:
            call(*args, **kwargs)
            return True
        except Exception as e:  # W&B's errors and the OS's (ConnectionResetError): whatever it is, W&B is optional
            self.failed = True
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            print(f"warning: W&B failed ({reason}); the run goes on without it, which holds the steps up to "
                  f"{self.logged_step} (metrics.jsonl holds every step)", file=sys.stderr)
            return False


def _saved_run(run_file) -> tuple[str | None, int]:
    """The W&B run id that wandb.json holds, and the step up to which that run may hold rows; (None, 0) where there
    is no such file yet (a new W&B run). A file written before may_hold was kept reads as 0."""
    if not run_file.exists():
        return None, 0
    try:
        saved = json.loads(run_file.read_bytes().decode("utf-8"))
        run_id, may_hold = saved["id"], saved.get("may_hold", 0)
    except (ValueError, KeyError, TypeError, AttributeError):  # not UTF-8 or not JSON; no "id" in it, or no object
        run_id, may_hold = None, None
    if not (isinstance(run_id, str) and run_id and type(may_hold) is int):
        raise UserError(f"{run_file} is damaged: it holds the id of this run folder's W&B run, as "
                        f"{{\"id\": \"<id>\"}}; write the id back (the W&B run's page shows it, and so do the names "
                        f"of its local folders, (offline-)run-<time>-<id>), or move the file aside to log to a new "
                        f"W&B run")
    return run_id, may_hold


def _start(cfg, run_id: str | None):
    """wandb.init for this run folder, continuing run `run_id` (None: a new run); online failing falls back to
    offline (one line, no traceback)."""
    import wandb

    local = not runfolder.is_url(cfg.run.out_dir)
    out_dir = cfg.run.out_dir.rstrip("/")
    args = dict(id=run_id, resume="allow" if run_id else None, project=cfg.log.wandb_project,
                name=cfg.log.wandb_name or os.path.basename(out_dir) or out_dir,
                dir=str(runfolder.path(out_dir)) if local else None, config=yaml.safe_load(config_lib.dump(cfg)))
    mode = config_checks.wandb_mode(cfg)
    if mode != "online":
        return wandb.init(mode=mode, **args)
    try:
        return wandb.init(mode="online", **args)
    except wandb.errors.Error as e:  # no API key, no server, refused: wandb's own errors, all raised at start
        where = runfolder.path(out_dir, "wandb") if local else "WANDB_DIR (default ./wandb)"
        reason = " ".join(str(e).split())[:300]
        print(f"W&B could not start online ({reason}); logging offline to {where} instead: `wandb sync` uploads it",
              file=sys.stderr)
        return wandb.init(mode="offline", **args)

