"""What a run reports: metrics.jsonl, TensorBoard, W&B (jaxtrain/wandb_log.py), the progress bar, and MFU.

metrics.jsonl has one JSON object per logged optimizer step: step (updates completed, 1-based), loss, lr,
grad_norm, tokens (cumulative), tokens_per_s, mfu (null where the device's peak is unknown), and with
train.nan_policy=skip or train.precision=fp16 `skipped` (updates skipped so far), with fp16 `loss_scale` (the loss
scale the window ran with); eval lines carry step, eval_loss and eval_accuracy (the
fraction of valid eval targets that are the top-1 prediction, ties to the lowest token id). Each line is strict JSON:
a value that is not finite (a skipped or diverged window's loss, an overflowed gradient norm) is written null
(`json_line`). torchref writes the same format, and gives tokens_per_s the same meaning: valid target tokens trained
since the previous line over the training time they took, evaluation and checkpoint saves left out (the loop calls
`exclude_time` after them; an async save's background writing that slows later steps still counts).
"""

import itertools
import json
import math
import os
import socket
import sys
import time

from etils import epath
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter
from tqdm import tqdm

from jaxtrain import runfolder
from jaxtrain import wandb_log
from jaxtrain.config import Config

# Dense bf16 peak TFLOP/s per device (vendor datasheets), matched in order as substrings of the device's name:
# jax's device_kind and torch.cuda.get_device_name() alike, so both backends take MFU against the same peak (in fp32
# runs too, as nanoGPT does); a key that is part of another comes after it (L4 of L40, TPU v5 of TPU v5 lite: jax
# names a v5e "TPU v5 lite" and a v5p "TPU v5"). CPUs vary too much to list: log.peak_tflops sets any device's peak.
PEAK_TFLOPS = {
    "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0,
    "L40S": 362.0, "L40": 181.0, "L4": 121.0,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0, "TPU v6 lite": 918.0,
}


def flops_per_token(cfg: Config, n_params: int) -> float:
    """Training FLOPs per token, as nanoGPT's estimate_mfu (PaLM appendix B): 6N for the weight matmuls forward
    and backward, plus 12 * L * d * T for attention scores and values. N excludes the embeddings that are only
    looked up: the position embedding, and the token embedding where lm_head has its own weight (untied)."""
    m = cfg.model
    looked_up = m.seq_len * m.d_model + (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    return 6 * (n_params - looked_up) + 12 * m.n_layer * m.d_model * m.seq_len


def peak_flops(cfg: Config, device_name: str) -> float | None:
    """FLOP/s for MFU: log.peak_tflops, else PEAK_TFLOPS's first key found in device_name, else unknown (None)."""
    if cfg.log.peak_tflops is not None:
        return cfg.log.peak_tflops * 1e12
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in device_name), None)


def kept_lines(path, resumed_step: int | None) -> list[str]:
    """The lines of metrics.jsonl (a path or URL) up to `resumed_step`, unchanged: what a run resumed there keeps,
    in both backends (torchref imports this). A start that resumed nothing (None: from scratch, or from init.from's
    checkpoint) keeps none: what is there was left by an attempt that saved no checkpoint. A damaged line is
    dropped, with a warning."""
    if resumed_step is None:
        return []
    logged, damaged = _logged(path)
    if damaged:
        print(f"warning: {path}: dropped {len(damaged)} damaged line(s) (line {damaged[0]} first), which are not "
              f"metrics records in UTF-8 JSON: what a crash can leave at the end of the file", file=sys.stderr)
    return [line if line.endswith("\n") else line + "\n" for at, line in logged if at <= resumed_step]


def last_step(path) -> int | None:
    """The step of metrics.jsonl's last line (a path or URL), None when it has none: how far an earlier process
    of the run logged (jaxtrain.wandb_log)."""
    return max((at for at, _ in _logged(path)[0]), default=None)


def _logged(path) -> tuple[list[tuple[int, str]], list[int]]:
    """(step, line) for each line of metrics.jsonl that is a record, and the numbers of the lines that are not: a
    line a kill cut short, or the NUL bytes or other garbage a crash can leave at the end of the file."""
    logged, damaged = [], []
    for number, raw in enumerate(runfolder.read_lines(epath.Path(path)), start=1):
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
        except ValueError:  # UnicodeDecodeError included
            record = None
        at = record.get("step") if isinstance(record, dict) else None
        if type(at) is int:
            logged.append((at, line))
        else:
            damaged.append(number)
    return logged, damaged


def scalars(line: dict) -> dict:
    """A metrics line's values as TensorBoard and W&B show them: train lines' fields under train/, eval lines' as
    they are (eval_loss, eval_accuracy); the step and unknown values (mfu null) left out."""
    return {key if key.startswith("eval_") else f"train/{key}": value for key, value in line.items()
            if key != "step" and value is not None}


def json_line(record: dict) -> str:
    """A metrics record as a line of strict JSON, NaN and infinities written null: Python's json writes them as bare
    NaN and Infinity, which JSON lacks and strict readers refuse (JavaScript's JSON.parse, Go's, DuckDB's), the
    whole file with them. TensorBoard and W&B are given the values themselves."""
    finite = {key: None if isinstance(value, float) and not math.isfinite(value) else value
              for key, value in record.items()}
    return json.dumps(finite, allow_nan=False) + "\n"


def mfu(tokens_per_s: float, flops_per_token: float, flops_per_s_peak: float | None) -> float | None:
    """Model FLOPs utilisation at `tokens_per_s` valid tokens a second (compute spent on padding is not useful
    work); None where the device's peak is unknown."""
    return tokens_per_s * flops_per_token / flops_per_s_peak if flops_per_s_peak else None


def train_line(step: int, loss: float, lr: float, grad_norm: float, tokens: int, tokens_per_s: float,
               flops_per_token: float, flops_per_s_peak: float | None) -> dict:
    """A training line of metrics.jsonl; `tokens` counts the run's valid target tokens so far; mfu null where the
    device's peak is unknown."""
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
            "tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s, flops_per_token, flops_per_s_peak)}


def summary_line(s: dict) -> str:
    """The end-of-run line, both backends': `s` holds start_step, step, loss, eval_loss, eval_accuracy, tokens_per_s
    (over the run's training steps), mfu and wall_s (start-up included); n/a for what it lacks."""
    def fmt(key, spec):
        return format(s[key], spec) if s.get(key) is not None else "n/a"
    return (f"done: steps {s.get('start_step', 0)}->{s.get('step', 'n/a')}  loss {fmt('loss', '.4f')}  "
            f"eval_loss {fmt('eval_loss', '.4f')}  eval_accuracy {fmt('eval_accuracy', '.2%')}  "
            f"tokens/s {fmt('tokens_per_s', ',.0f')}  mfu {fmt('mfu', '.1%')}  wall {fmt('wall_s', '.1f')}s")


def eval_text(step: int, eval_loss: float, eval_accuracy: float) -> str:
    """The line both backends print after an evaluation (on stdout, above the progress bar)."""
    return f"step {step}: eval loss {eval_loss:.4f}, accuracy {eval_accuracy:.2%}"


class RunThroughput:
    """The summary's tokens/s, both backends': the run's training steps after its first, whose time holds the
    runtime's first-execution warm-up (jaxtrain, tiny.yaml: 41 ms against 2.4 ms after; ~a quarter off a short
    run's mean); a run of one step has only that one."""

    def __init__(self):
        self.steps, self.first, self.after_first = 0, (0, 0.0), (0, 0.0)

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        if self.steps == 1:
            self.first = (tokens, seconds)
        else:
            self.after_first = (self.after_first[0] + tokens, self.after_first[1] + seconds)

    def tokens_per_s(self) -> float | None:
        tokens, seconds = self.after_first if self.steps > 1 else self.first
        return tokens / seconds if seconds else None


class MetricsLogger:
    """Writes metrics for steps start_step+1 .. cfg.train.steps. Only the main process writes. `resumed`: whether
    start_step is the run folder's own checkpoint (else a start from scratch or from init.from). `start_tokens`: the
    tokens trained up to start_step (the resumed checkpoint's count, init.from's training state's); None: from
    metrics.jsonl's last line kept, or start_step windows of this config's size where there is none."""

    def __init__(self, cfg: Config, *, start_step: int, resumed: bool, flops_per_token: float, n_devices: int,
                 device_kind: str, is_main: bool, start_tokens: int | None = None):
        self.cfg, self.is_main = cfg, is_main
        # The lines past start_step, left by a run that went on after its last checkpoint, are dropped: the
        # resumed run writes them again.
        path = runfolder.path(cfg.run.out_dir, "metrics.jsonl")
        kept = kept_lines(path, start_step if resumed else None) if is_main else []
        last_jsonl_step = last_step(path) if is_main and cfg.log.wandb else None
        train_lines = [record for record in map(json.loads, kept) if "loss" in record]
        last = train_lines[-1] if train_lines else None
        tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        if start_tokens is not None:
            self.tokens = start_tokens
        elif last:  # its tokens and the steps since it, whole windows of this config (a resume: the same run)
            self.tokens = last["tokens"] + (start_step - last["step"]) * tokens_per_step
        else:
            self.tokens = start_step * tokens_per_step
        peak = peak_flops(cfg, device_kind)
        self.flops_per_s_peak = peak * n_devices if peak else None
        self.flops_per_token = flops_per_token
        self.line_tokens = self.line_seconds = 0  # since the last metrics line
        self.run = RunThroughput()  # this process's training, for the summary
        # W&B first: it keeps what metrics.jsonl says W&B may hold before the file is cut back (wandb_log)
        self.wandb = wandb_log.WandbLog(cfg, start_step=start_step, resumed=resumed,
                                        last_jsonl_step=last_jsonl_step) if is_main and cfg.log.wandb else None
        self.log = runfolder.GrowingFile(path, kept) if is_main else None
        self.tb = TensorBoardLog(runfolder.path(cfg.run.out_dir, "tb"), first_step=start_step + 1) \
            if is_main and cfg.log.tensorboard else None
        self.bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not (is_main and cfg.log.progress))
        self.last_time = time.perf_counter()  # after wandb.init, which may wait ~90 s for a network: not training

    def train(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int,
              counters: dict | None = None) -> dict:
        """Record optimizer step `step` (1-based); `tokens` are the valid target tokens of its window; `counters`
        join the line: `skipped`, the updates skipped so far (train.nan_policy=skip, fp16), and fp16's
        `loss_scale`."""
        now = time.perf_counter()
        seconds, self.last_time, self.tokens = now - self.last_time, now, self.tokens + tokens
        self.line_tokens, self.line_seconds = self.line_tokens + tokens, self.line_seconds + seconds
        self.run.add(tokens, seconds)
        tokens_per_s = self.line_tokens / max(self.line_seconds, 1e-9)
        line = train_line(step, loss, lr, grad_norm, self.tokens, tokens_per_s, self.flops_per_token,
                          self.flops_per_s_peak)
        line.update(counters or {})
        # the step's numbers first: update() redraws the bar, which showed the step before's loss beside this step
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.bar.update(step - self.bar.n)
        if self.cfg.logs_at(step):
            self._write(line)  # its time counts: the device runs the next step meanwhile, which leaving it out
            # would leave out too (an object store's upload, 1 s, made a line's tokens/s ~100x)
            self.line_tokens = self.line_seconds = 0
        return line

    def exclude_time(self) -> None:
        """Leave the time since the last recorded step (an evaluation, a checkpoint save) out of tokens_per_s."""
        self.last_time = time.perf_counter()

    def mean_tokens_per_s(self) -> float | None:
        """tokens_per_s over this run's training steps (RunThroughput), for the summary."""
        return self.run.tokens_per_s()

    def mean_mfu(self) -> float | None:
        """MFU at mean_tokens_per_s, for the summary."""
        tokens_per_s = self.mean_tokens_per_s()
        return mfu(tokens_per_s, self.flops_per_token, self.flops_per_s_peak) if tokens_per_s is not None else None

    def eval(self, step: int, eval_loss: float, eval_accuracy: float) -> None:
        self._write({"step": step, "eval_loss": eval_loss, "eval_accuracy": eval_accuracy})
        if self.is_main:
            self.bar.write(eval_text(step, eval_loss, eval_accuracy))

    def _write(self, line: dict) -> None:
        if not self.is_main:
            return
        self.log.write(json_line(line))
        if self.tb:
            for tag, value in scalars(line).items():
                self.tb.scalar(tag, value, line["step"])
        if self.wandb:  # after metrics.jsonl, whose last step bounds what W&B may have (wandb_log)
            self.wandb.log(line["step"], scalars(line))

    def sync(self) -> None:
        """Every line written so far is in the run folder (an object store's copy is uploaded): called before a
        checkpoint save, so that a resumed run finds the lines up to its checkpoint."""
        if self.log:
            self.log.sync()
        if self.tb:
            self.tb.sync()
        if self.wandb:
            self.wandb.sync()

    def close(self) -> None:
        self.bar.close()
        if self.log:
            self.log.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.close()


_FILE_COUNT = itertools.count()


class TensorBoardLog:
    """Scalars in a TensorBoard event file of its own in `folder`, one per process that logs. Written with
    tensorboard's protos and record framing, not tensorboardX's SummaryWriter: that imports torch wherever torch is
    installed, and a jaxtrain process never loads torch. The file grows as metrics.jsonl does (runfolder.GrowingFile:
    appended locally, uploaded whole to an object store). It opens with a SessionLog START at `first_step`:
    TensorBoard then drops the events that earlier files of the folder hold from that step on (a run that went on
    past its last checkpoint before it stopped), so a resumed run's curves never go back in step."""

    def __init__(self, folder: epath.Path, *, first_step: int):
        # TensorBoard reads a folder's event files in name order; the count, zero-padded so that it sorts as a
        # number, keeps two of one process in one second in order (unpadded, a 10th file sorted before a 9th).
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_COUNT):06d}"
        folder.mkdir(parents=True, exist_ok=True)
        self.file = runfolder.GrowingFile(folder / name, [], binary=True)
        self.records = RecordWriter(self.file)  # frames each event: length, data, masked CRC-32Cs
        self._add(Event(file_version="brain.Event:2"))
        self._add(Event(step=first_step, session_log=SessionLog(status=SessionLog.START)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._add(Event(step=step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))

    def _add(self, event: Event) -> None:
        event.wall_time = time.time()
        self.records.write(event.SerializeToString())

    def sync(self) -> None:
        self.file.sync()

    def close(self) -> None:
        self.file.close()
