"""metrics.jsonl's throughput: tokens_per_s counts training time only, over the steps since the previous line, as
torchref's does (README, "Metrics"). A fake clock makes every number below a hand computation."""

import itertools
import json

import pytest

from jaxtrain import config, metrics


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_tokens_per_s_covers_the_steps_since_the_last_line_and_leaves_out_eval_and_saves(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.every=2", "--log.tensorboard=false", "--log.progress=false",
                       "--train.steps=4", "--optim.warmup_steps=1", "--model.vocab_size=256"])
    logger = metrics.MetricsLogger(cfg, start_step=0, resumed=False, flops_per_token=1.0, n_devices=1,
                                   device_kind="cpu", is_main=True)
    for step, at in [(1, 1.0), (2, 3.0)]:  # 100 tokens in 1 s, then 100 in 2 s: 200 / 3 s
        clock.now = at
        logger.train(step, 1.0, 1e-3, 1.0, 100)
    clock.now = 13.0  # a 10 s evaluation and save
    logger.exclude_time()
    for step, at in [(3, 14.0), (4, 15.0)]:  # 200 tokens in 2 s of training; 12 s of wall time
        clock.now = at
        logger.train(step, 1.0, 1e-3, 1.0, 100)
    logger.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(line["step"], line["tokens_per_s"]) for line in lines] == [(2, 200 / 3), (4, 100.0)]
    assert logger.mean_tokens_per_s() == 300 / 4  # steps 2 to 4: step 1 holds the runtime's warm-up


def test_the_summary_mfu_is_over_the_whole_run_not_its_last_line(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.tensorboard=false", "--log.progress=false",
                       "--train.steps=3", "--optim.warmup_steps=1", "--model.vocab_size=256",
                       "--log.peak_tflops=0.5"])
    logger = metrics.MetricsLogger(cfg, start_step=0, resumed=False, flops_per_token=1e10, n_devices=2,
                                   device_kind="cpu", is_main=True)
    for step, at, tokens in [(1, 1.0, 100), (2, 5.0, 300), (3, 6.0, 100)]:  # the last line: 100 tokens in 1 s
        clock.now = at
        line = logger.train(step, 1.0, 1e-3, 1.0, tokens)
    logger.close()
    assert line["mfu"] == 1.0  # 100 tokens/s x 1e10 FLOPs a token / (2 devices x 0.5e12 FLOP/s)
    assert logger.mean_mfu() == 0.8  # the run after step 1: 400 tokens in 5 s


@pytest.mark.parametrize("steps, want", [
    ([(100, 5.0)], 20.0),  # one step: its own rate, warm-up and all
    ([(100, 5.0), (100, 1.0)], 100.0),  # the first step's 5 s of warm-up left out
    ([(100, 5.0), (200, 1.0), (100, 3.0)], 75.0),  # 300 tokens in 4 s
    ([], None),  # no step trained
])
def test_the_runs_tokens_per_s_leaves_out_its_first_step_when_it_has_others(steps, want):
    throughput = metrics.RunThroughput()
    for tokens, seconds in steps:
        throughput.add(tokens, seconds)
    assert throughput.tokens_per_s() == want


def test_wandb_start_up_is_not_training_time(tmp_path, monkeypatch):
    """wandb.init may wait ~90 s for a network before it falls back to offline: step 1's tokens_per_s counted it."""
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)

    class SlowWandb:
        def __init__(self, cfg, **_):
            clock.now += 90.0

        def log(self, step, scalars):
            pass

        def close(self):
            pass

    monkeypatch.setattr(metrics.wandb_log, "WandbLog", SlowWandb)
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.every=1", "--log.tensorboard=false", "--log.progress=false",
                       "--log.wandb=true", "--train.steps=1", "--optim.warmup_steps=0", "--model.vocab_size=256"])
    logger = metrics.MetricsLogger(cfg, start_step=0, resumed=False, flops_per_token=1.0, n_devices=1,
                                   device_kind="cpu", is_main=True)
    clock.now += 2.0
    assert logger.train(1, 1.0, 1e-3, 1.0, 100)["tokens_per_s"] == 50.0  # 100 tokens in the step's 2 s


def test_the_progress_bar_shows_each_step_with_its_own_loss(tmp_path, monkeypatch):
    """What the bar draws at each update: the step count beside that step's loss (it showed the step before's)."""
    drawn = []

    class Bar:
        def __init__(self, **_):
            self.n, self.postfix = 0, {}

        def set_postfix(self, refresh=True, **postfix):
            self.postfix = postfix

        def update(self, n):
            self.n += n
            drawn.append((self.n, self.postfix["loss"]))

        def close(self):
            pass

    monkeypatch.setattr(metrics, "tqdm", Bar)
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.tensorboard=false", "--train.steps=2",
                       "--optim.warmup_steps=1", "--model.vocab_size=256"])
    logger = metrics.MetricsLogger(cfg, start_step=0, resumed=False, flops_per_token=1.0, n_devices=1,
                                   device_kind="cpu", is_main=True)
    logger.train(1, 2.5, 1e-3, 1.0, 100)
    logger.train(2, 1.25, 1e-3, 1.0, 100)
    assert drawn == [(1, "2.5000"), (2, "1.2500")]


def test_lines_come_every_log_every_steps_and_at_the_last(tmp_path):
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.every=2", "--log.tensorboard=false", "--log.progress=false",
                       "--train.steps=5", "--optim.warmup_steps=1", "--model.vocab_size=256"])
    logger = metrics.MetricsLogger(cfg, start_step=0, resumed=False, flops_per_token=1.0, n_devices=1,
                                   device_kind="cpu", is_main=True)
    for step in range(1, 6):
        logger.train(step, 1.0, 1e-3, 1.0, 100)
    logger.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [2, 4, 5]


def test_a_value_that_is_not_finite_is_written_null_and_shown_as_itself(tmp_path):
    """metrics.jsonl stays strict JSON through a diverged or skipped window (JSON has no NaN or Infinity; a strict
    reader refuses the whole file over one bare NaN), while TensorBoard, which has NaN, is given the value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.every=1", "--log.progress=false", "--train.steps=2",
                       "--optim.warmup_steps=1", "--model.vocab_size=256"])
    logger = metrics.MetricsLogger(cfg, start_step=0, resumed=False, flops_per_token=1.0, n_devices=1,
                                   device_kind="cpu", is_main=True)
    logger.train(1, float("nan"), 1e-3, float("inf"), 100)
    logger.eval(1, float("-inf"), 0.25)
    logger.train(2, 2.5, 1e-3, 0.5, 100)
    logger.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text, text
    lines = [json.loads(line, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) for line in text.splitlines()]
    assert [(line["loss"], line["grad_norm"]) for line in lines if "loss" in line] == [(None, None), (2.5, 0.5)]
    assert [(line["eval_loss"], line["eval_accuracy"]) for line in lines if "eval_loss" in line] == [(None, 0.25)]
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    loss = [event.value for event in accumulator.Scalars("train/loss")]
    assert loss[0] != loss[0] and loss[1] == 2.5  # NaN, then the finite loss
    assert accumulator.Scalars("train/grad_norm")[0].value == float("inf")
    assert accumulator.Scalars("eval_loss")[0].value == float("-inf")


def test_a_resumed_run_keeps_the_lines_up_to_its_step_and_drops_a_cut_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [f'{{"step": {s}, "loss": 1.0}}\n' for s in (1, 2, 3)] + ['{"step": 3, "eval_loss": 2.0}\n']
    path.write_text("".join(lines) + '{"step": 4, "lo')  # killed while writing step 4
    assert metrics.kept_lines(str(path), 2) == lines[:2]
    assert metrics.kept_lines(str(path), 3) == lines
    assert metrics.kept_lines(str(tmp_path / "none.jsonl"), 3) == []


@pytest.mark.parametrize("backend", ["jaxtrain", "torchref"])
def test_a_start_that_resumed_nothing_begins_metrics_jsonl_empty(tmp_path, backend):
    """A start from init.from's checkpoint at step 2 (or from scratch) into a folder an attempt that saved no
    checkpoint wrote lines into: both backends drop them all (jaxtrain kept those up to init.from's step, as if they
    were this run's history, where torchref dropped them); resumed at step 2, both keep steps 1 and 2."""
    path = tmp_path / "metrics.jsonl"
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.tensorboard=false", "--log.progress=false",
                       "--train.steps=4", "--optim.warmup_steps=1", "--model.vocab_size=256"])
    lines = [f'{{"step": {s}, "loss": 99.0, "tokens": {100 * s}}}\n' for s in (1, 2, 3)]
    for resumed, kept in ((False, []), (True, lines[:2])):
        path.write_text("".join(lines))
        if backend == "jaxtrain":
            metrics.MetricsLogger(cfg, start_step=2, resumed=resumed, flops_per_token=1.0, n_devices=1,
                                  device_kind="cpu", is_main=True, start_tokens=200).close()
        else:
            from torchref.metrics_log import MetricsLog
            with MetricsLog(cfg, 2 if resumed else None, 1.0, None):
                pass
        assert path.read_text() == "".join(kept), resumed


def test_a_resumed_run_counts_tokens_on_from_its_last_line(tmp_path):
    """Resumed at step 5 with lines every 2 steps, the last kept at 4: its tokens (a run begun from init.from's state
    of another batch size has no multiple of this one) and step 5's window of 4 x 32."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0, "tokens": 1000}\n'
                                            '{"step": 4, "loss": 1.0, "tokens": 1256}\n')
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.every=2", "--log.tensorboard=false",
                       "--log.progress=false", "--train.steps=8", "--optim.warmup_steps=1", "--model.vocab_size=256",
                       "--data.batch_size=4", "--model.seq_len=32"])
    logger = metrics.MetricsLogger(cfg, start_step=5, resumed=True, flops_per_token=1.0, n_devices=1,
                                   device_kind="cpu", is_main=True)
    line = logger.train(6, 1.0, 1e-3, 1.0, 128)
    logger.close()
    assert line["tokens"] == 1256 + 128 + 128


# A crash's leftovers: a block of NUL bytes (a file system that had sized the file but not written it), bytes that are
# not UTF-8, a JSON value that is no record, a record without an int step.
DAMAGED = [b"\0" * 40 + b"\n", b"\xff\xfe garbage\n", b"[1]\n", b'{"step": "4"}\n']


def test_damaged_lines_are_dropped_with_one_warning_and_the_records_kept(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    records = [f'{{"step": {s}, "loss": 1.0}}\n' for s in (1, 2, 3)]
    path.write_bytes(records[0].encode() + DAMAGED[1] + b"".join(r.encode() for r in records[1:]) +
                     b"".join(DAMAGED))
    assert metrics.kept_lines(str(path), 2) == records[:2]
    assert capsys.readouterr().err == (f"warning: {path}: dropped 5 damaged line(s) (line 2 first), which are not "
                                       f"metrics records in UTF-8 JSON: what a crash can leave at the end of the "
                                       f"file\n")
    assert metrics.last_step(str(path)) == 3


def test_a_resumed_run_rewrites_metrics_jsonl_without_its_damaged_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [f'{{"step": {s}, "loss": 1.0, "tokens": {100 * s}}}\n' for s in (1, 2)]
    path.write_bytes("".join(records).encode() + b"".join(DAMAGED))
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.tensorboard=false", "--log.progress=false",
                       "--train.steps=4", "--optim.warmup_steps=1", "--model.vocab_size=256"])
    logger = metrics.MetricsLogger(cfg, start_step=2, resumed=True, flops_per_token=1.0, n_devices=1,
                                   device_kind="cpu", is_main=True)
    logger.close()
    assert path.read_text() == "".join(records) and logger.tokens == 200


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA H200 141GB HBM3e", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-40GB", 312), ("NVIDIA L4", 121),
    ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("TPU v5 lite", 197), ("TPU v5", 459), ("TPU v6 lite", 918),
    ("TPU v4", 275), ("cpu", None)])
def test_peak_flops_one_table_for_both_backends(name, tflops):
    """jax's device_kind and torch's get_device_name() both contain these names (vendor datasheet peaks, bf16
    dense); log.peak_tflops wins over the table."""
    cfg = config.load([])
    assert metrics.peak_flops(cfg, name) == (tflops * 1e12 if tflops else None)
    assert metrics.peak_flops(config.load(["--log.peak_tflops=2.5"]), name) == 2.5e12


def test_flops_per_token_are_the_same_with_the_head_tied_or_not():
    """Untying lm_head from wte adds a weight that is only looked up (the head's matmul is there either way): the
    FLOPs, and so MFU, stay nanoGPT's estimate_mfu of the tied model."""
    import functools
    import jax
    from jaxtrain import step

    def model(tied: bool) -> tuple[config.Config, int]:
        cfg = config.load(["--model.vocab_size=256", "--model.n_layer=2", "--model.d_model=32", "--model.n_head=2",
                           "--model.seq_len=16", f"--model.tie_embeddings={str(tied).lower()}"])
        params = jax.eval_shape(functools.partial(step.fresh_state, cfg, 256)).params
        return cfg, sum(x.size for x in jax.tree.leaves(params))

    (tied, n_tied), (untied, n_untied) = model(True), model(False)
    assert n_untied == n_tied + 256 * 32  # lm_head's own (V, d) weight
    nanogpt = 6 * (n_tied - 16 * 32) + 12 * 2 * 32 * 16  # 6 (N - wpe) + 12 L d T
    assert metrics.flops_per_token(tied, n_tied) == metrics.flops_per_token(untied, n_untied) == nanogpt


def test_tensorboard_events_read_back_by_tensorboard_and_never_go_back_in_step(tmp_path, monkeypatch):
    """The event files, read by TensorBoard's own loader and accumulator: each logged field under its tag at its step,
    and a run resumed at step 4 after the first had logged up to 6 shows steps 1..8 once each, 5 and 6 from the
    resumed run. The resumed file opens with a SessionLog START at its first step, which tells TensorBoard to drop
    the earlier file's events from there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    def log(start_step, last_step, loss_at):
        cfg = config.load([f"--run.out_dir={tmp_path}", "--log.every=1", "--log.progress=false",
                           f"--train.steps={last_step}", "--optim.warmup_steps=1", "--model.vocab_size=256"])
        logger = metrics.MetricsLogger(cfg, start_step=start_step, resumed=start_step > 0, flops_per_token=1.0,
                                       n_devices=1, device_kind="cpu", is_main=True)
        for step in range(start_step + 1, last_step + 1):
            logger.train(step, loss_at(step), 1e-3 * step, 0.5, 100)
        logger.eval(last_step, 2.5, 0.25)
        logger.close()

    # The process's 10th and 11th event files (likely within one second): their names must still sort in order.
    monkeypatch.setattr(metrics, "_FILE_COUNT", itertools.count(9))
    log(0, 6, lambda step: 10.0 + step)
    log(4, 8, lambda step: 20.0 + step)
    files = sorted((tmp_path / "tb").iterdir())
    assert len(files) == 2
    resumed = list(EventFileLoader(str(files[1])).Load())
    assert resumed[0].file_version == "brain.Event:2"
    assert (resumed[1].step, resumed[1].session_log.status) == (5, resumed[1].session_log.START)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    loss = [(event.step, event.value) for event in accumulator.Scalars("train/loss")]
    assert loss == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0), (7, 27.0), (8, 28.0)]
    lrs = [event.value for event in accumulator.Scalars("train/lr")]
    assert lrs == pytest.approx([1e-3 * s for s in range(1, 9)], rel=1e-6)  # TensorBoard's fp32: 2^-24 rounding
    assert [(event.step, event.value) for event in accumulator.Scalars("eval_loss")] == [(8, 2.5)]
    assert [(event.step, event.value) for event in accumulator.Scalars("eval_accuracy")] == [(8, 0.25)]
    assert set(accumulator.Tags()["scalars"]) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens",
                                                  "train/tokens_per_s", "eval_loss", "eval_accuracy"}


def test_the_summary_line_puts_each_value_under_its_name_and_n_a_for_what_is_missing():
    s = {"start_step": 2, "step": 6, "loss": 1.23456, "eval_loss": 2.5, "eval_accuracy": 0.125,
         "tokens_per_s": 12345.6, "mfu": 0.0, "wall_s": 7.3}
    assert metrics.summary_line(s) == ("done: steps 2->6  loss 1.2346  eval_loss 2.5000  eval_accuracy 12.50%  "
                                       "tokens/s 12,346  mfu 0.0%  wall 7.3s")
    assert metrics.summary_line({"step": 6, "loss": 1.0, "eval_loss": None, "mfu": None, "wall_s": 1.0}) == (
        "done: steps 0->6  loss 1.0000  eval_loss n/a  eval_accuracy n/a  tokens/s n/a  mfu n/a  wall 1.0s")
