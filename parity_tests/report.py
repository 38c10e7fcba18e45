"""The parity report: both backends from one init, a table of how far apart they are, and the curves.

    python -m parity_tests.report --config configs/tiny.yaml --out out/parity-fp32          # the config's 500 steps
    python -m parity_tests.report --config configs/tiny.yaml --precision bf16 --out out/parity-bf16
    python -m parity_tests.report --config configs/tiny.yaml --precision fp16 --out out/parity-fp16
    python -m parity_tests.report --config configs/tiny.yaml --steps 2000 --out out/parity-fp32-2000

Exports jaxtrain's fresh params for the config to the torch format (weights only), starts `python -m jaxtrain.run`
and `python -m torchref.run` from them (dropout forced to 0, every step logged), then each backend once more as its
own rounding reference: in fp32 with another gradient accumulation, twice it where the config allows (same
batches, same math, only the fp32 sums reordered), in bf16 and fp16 in fp32 (the model in fp32 throughout:
FP32_COUNTERPARTS). Both configs are checked before anything runs. Writes into --out:

    report.md      a table (component, max abs diff, max rel diff, rounding floor, bound, pass/fail), the first step
                   where any column leaves its bound, each bound's reason, the commands and their runtimes
    lr.png         LR curves overlaid, and their ratio minus 1
    loss.png       loss curves overlaid; |dloss| per step, each backend's rounding floor, and the bound at each step
    grad_norm.png  pre-clip gradient norms with the clip threshold; the same below, relative

The floor (each backend against its reference) sizes the bounds to the config and the run length: training amplifies
rounding, so a constant measured on one run cannot hold at every length (judgment.FLOOR_FACTOR says how); the key bias,
whose true gradient is zero, is judged against the floor alone (judgment.ZERO_GRADIENT). In bf16 and fp16 the
cross-backend gap is also judged against torchref's own gap to fp32 (issue 4's 3x rule); fp16 adds its loss scaling
decisions (loss_scale, skipped), which must be the same at every step; and jaxtrain's own gap to fp32 must be
comparable to torchref's (bounds.OWN_GAP_RATIO). Further `--section.key=value` flags go to all runs. Exit status 1
when a bound is exceeded. A previous report's runs/ is replaced only once every run has finished: a refused command
(exit 2, its one line alone) or a failed run leaves it as it was.
The bounds and their reasons are bounds.FP32 / bounds.BF16 / bounds.params_bound, the same the tests assert.
"""

import argparse
import contextlib
import copy
import functools
import math
import os
import shutil
import sys
import tempfile
import threading

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from jaxtrain import cmdline, config_checks  # noqa: E402
from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain.cmdline import output_folder, positive_int  # noqa: E402
from jaxtrain.errors import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from parity_tests import bounds, judgment, runs  # noqa: E402
from parity_tests.report_text import markdown  # noqa: E402

COLORS = {"jaxtrain": "tab:blue", "torchref": "tab:orange"}  # the reference runs: gray
ZERO_FLOOR = 1e-9  # where an exact 0 difference is drawn on the log axes
# Keys the report sets in every run, which a flag of the user's would override (later flags win): the way instead.
REPORT_SETS = {
    "run.out_dir": "each run goes into --out's runs/: give --out",
    "run.fresh": "--out's runs/ is replaced at each report: give --out",
    "run.dry_run": "the report trains both backends; for a dry run, python -m jaxtrain.run",
    "init.from": "both backends start from jaxtrain's fresh params for the config, which the report exports",
    "train.precision": "give --precision",
    "train.steps": "give --steps",
    "model.dropout": "dropout masks cannot match across backends: the report runs without dropout",
    "train.eval_every": "the report evaluates once, at the end",
    "log.every": "the report compares every step, so each backend logs each one",
}


def main(argv: list[str] | None = None) -> int:
    with exit_on_user_error():
        known, config, overrides = _arguments(argv)
        try:
            report = build(config, known.steps, known.precision, os.path.abspath(known.out), overrides)
        except runs.RunFailed as failed:
            if failed.returncode == 2:  # the trainers' user error: their one line, which names the fix
                print(failed.stderr.strip().splitlines()[-1], file=sys.stderr)
                return 2
            print(f"error: {failed}", file=sys.stderr)
            return 1
    print(report.summary)
    return 0 if report.passed else 1


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, str, list[str]]:
    """The report's flags, checked (a refusal is one line, exit 2): its own, its config's path, and the
    --section.key=value overrides both runs take."""
    ap = OneLineParser(prog="python -m parity_tests.report", description=__doc__.split("\n\n")[0],
                       epilog="Any further --section.key=value flag is passed to both runs.")
    ap.add_argument("--config", required=True, action="append", help="run config YAML, e.g. configs/tiny.yaml")
    ap.add_argument("--steps", type=positive_int, help="train.steps for both runs (default: the config's)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--out", required=True, type=output_folder,
                    help="folder for report.md, the PNGs and the runs (runs/ is replaced)")
    known, overrides = ap.parse_known_args(argv)
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a)]
    if bad:
        ap.error(f"unexpected argument {bad[0]!r}; overrides look like --section.key=value")
    reserved = [key for key in REPORT_SETS if cmdline.given(overrides, key) is not None]
    if reserved:
        ap.error(f"--{reserved[0]} is the report's to set ({REPORT_SETS[reserved[0]]})")
    config = cmdline.one_config(known.config)
    return known, (config if "://" in config else os.path.abspath(config)), overrides  # its runs start in REPO


class Report:
    def __init__(self, passed: bool, summary: str):
        self.passed, self.summary = passed, summary


def build(config: str, steps: int | None, precision: str, out: str, overrides: list[str]) -> Report:
    work = os.path.join(out, "runs")
    forced = [*(["--train.steps=%d" % steps] if steps else []), f"--train.precision={precision}",
              "--model.dropout=0.0", "--train.eval_every=0"]
    # User flags first, the forced ones last (later flags win): dropout masks cannot match across backends.
    args = lambda name, *more: runs.run_args(os.path.join(work, name), *_cache(overrides), *overrides, *forced,
                                             *more, config=config)
    # Both configs checked before anything is written: the runs' (as the export checks it again, with the data)
    # and the reference's, which a bf16- or fp16-only setting would otherwise have refused after four runs.
    suffix, more = reference(precision, yaml.safe_load(config_lib.dump(config_lib.load(args("jaxtrain")))))
    refs = {backend: f"{backend} {suffix}" for backend in runs.BACKENDS} if suffix else {}
    dirs = {label: os.path.join(work, label) for label in runs.BACKENDS}
    dirs.update({label: os.path.join(work, f"{backend}-reference") for backend, label in refs.items()})
    init, walls = os.path.join(work, "init"), {}
    with _replacing(out, work):
        # Not announced: a config or data the trainers refuse is refused here, in their one line alone.
        walls["export init"] = runs.cli("parity_tests.runs", "export-init", init, *args("init-config")).wall_s
        for label, folder in dirs.items():
            extra = more if label in refs.values() else []
            run = functools.partial(runs.train, label.split()[0], args(os.path.basename(folder), *extra), init)
            walls[label] = _timed(label, folder, run)
    # torchref's: it writes model.vocab_size resolved from the data (jaxtrain's config.yaml keeps null).
    with open(os.path.join(dirs["torchref"], "config.yaml"), encoding="utf-8") as f:
        resolved = yaml.safe_load(f)
    rows = judge(work, dirs, refs, precision, resolved)
    text = markdown(config, precision, resolved, overrides + forced, rows, walls, dirs, refs, more)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    passed = all(r.passed is not False for r in rows)
    first = judgment.first_violation(rows)
    verdict = "all bounds hold" if passed else (
        f"first out of bound: {first.detail}" if first else "out of bound:\n" + judgment.failures(rows))
    return Report(passed, f"{judgment.format_rows(rows)}\n\n{verdict}\nwrote {out}/report.md, lr.png, loss.png, "
                          f"grad_norm.png")


@contextlib.contextmanager
def _replacing(out: str, work: str):
    """A fresh `work` (out/runs) for the block, which replaces the previous one only once the block has finished:
    meanwhile the previous one waits beside it, and comes back on any failure (a refusal, a failed run, Ctrl-C),
    and an `out` made here goes again. Set aside rather than the new runs staged: each run records its own folder
    and the init's (config.yaml, checkpoints), which a move would leave naming folders that are gone."""
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    aside = tempfile.mkdtemp(prefix=".runs-previous-", dir=out)
    previous = os.path.join(aside, "runs")
    try:
        if os.path.lexists(work):
            os.rename(work, previous)
        os.makedirs(work)
        try:
            yield
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            if os.path.lexists(previous):
                os.rename(previous, work)
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
        if made and not os.listdir(out):
            os.rmdir(out)


def _timed(label: str, folder: str, run) -> float:
    """run() (a trainer writing into `folder`), announced once it has started, and its wall seconds. Each trainer
    writes its config.yaml after its last start-up check, so a start it refuses prints its one line alone."""
    done = threading.Event()

    def announce():
        while not done.wait(0.2):
            if os.path.exists(os.path.join(folder, "config.yaml")):
                print(f"{label} ...", file=sys.stderr, flush=True)
                return

    watcher = threading.Thread(target=announce, daemon=True)
    watcher.start()
    try:
        wall = run().wall_s
    finally:
        done.set()
        watcher.join()
    print(f"{label}: {wall:.1f} s", file=sys.stderr, flush=True)
    return wall


def judge(work: str, dirs: dict, refs: dict, precision: str, resolved: dict) -> list[judgment.Row]:
    """Read the runs in `dirs` (label -> run folder), compare them and draw the curves into work's parent."""
    out, n_steps = os.path.dirname(work), resolved["train"]["steps"]
    lines = {label: runs.read_metrics(d) for label, d in dirs.items()}
    states = {label: runs.final_state(label.split()[0], d, n_steps) for label, d in dirs.items()}
    rows = compare(lines, states, precision, refs)
    plot_lr(lines, os.path.join(out, "lr.png"), precision)
    plot_gaps(lines, os.path.join(out, "loss.png"), "loss", "Training loss per step", precision, refs)
    plot_gaps(lines, os.path.join(out, "grad_norm.png"), "grad_norm", "Global gradient norm before clipping",
              precision, refs, relative=True, threshold=resolved["optim"]["max_grad_norm"])
    return rows


# The settings that exist in bf16 and fp16 only (jaxtrain/config_checks.py and kernel_choice.py refuse them under
# fp32), each with its fp32 counterpart, the same math. The fp32 reference measures how far low precision moves a
# backend, a bf16 residual stream or a bf16/fp16 kernel included: it runs the model in fp32 throughout, as
# test_trajectories.py's fp32 runs do, against which its bf16-stream runs are judged.
FP32_COUNTERPARTS = {"model.residual_dtype": ("bf16", "fp32"), "model.gelu_fwd": ("pallas", "xla"),
                     "model.gelu_grad": ("pallas", "xla"), "model.head_lse": ("pallas", "xla"),
                     "model.qkv_grad": ("pallas", "xla"), "model.attention": ("cudnn", "auto")}


def reference(precision: str, resolved: dict) -> tuple[str | None, list[str]]:
    """What each backend's second run changes, the rounding-only reference that gives the floor: fp32 (with
    FP32_COUNTERPARTS) for a bf16 or fp16 report, a UserError where the config refuses that; for an fp32 one,
    another accumulation (accumulations: twice it where the config takes that), None where the config takes no
    other (a batch of one sequence a device, or micro-batches that break another of its rules, such as
    model.vocab_tiles'). Checked as the trainers check a config."""
    if precision != "fp32":
        changes = {"train.precision": "fp32", **{key: fp32 for key, (low, fp32) in FP32_COUNTERPARTS.items()
                                                 if _get(resolved, key) == low}}
        flags = [f"--{key}={value}" for key, value in changes.items()]
        try:
            _check(resolved, changes)
        except UserError as e:
            raise UserError(f"the fp32 reference runs ({' '.join(flags)}) would be refused: {e}") from None
        return "fp32", flags
    for k in accumulations(resolved["optim"]["grad_accum_steps"], resolved["data"]["batch_size"]):
        try:
            _check(resolved, {"optim.grad_accum_steps": k})
        except UserError:
            continue
        return f"accum {k}", [f"--optim.grad_accum_steps={k}"]
    return None, []


def accumulations(k: int, batch_size: int) -> list[int]:
    """The accumulation counts an fp32 reference may run at, in the order tried: twice k (FLOOR_FACTOR's
    measurement), half of it where k is even, then every other count that splits the batch, the nearest to k
    first. Each reorders only the fp32 gradient sums."""
    half = [k // 2] if k % 2 == 0 else []
    others = sorted((n for n in range(1, batch_size + 1) if batch_size % n == 0 and n not in {k, 2 * k, *half}),
                    key=lambda n: (abs(math.log(n / k)), n))
    return [2 * k, *half, *others]


def _get(resolved: dict, key: str):
    section, name = key.split(".")
    return resolved[section][name]


def _check(resolved: dict, changes: dict) -> None:
    """config_checks.validate on `resolved` with `changes` (section.key -> value)."""
    raw = copy.deepcopy(resolved)
    for key, value in changes.items():
        section, name = key.split(".")
        raw[section][name] = value
    config_checks.validate(config_lib.from_dict(raw))


def _cache(overrides: list[str]) -> tuple[str]:
    """run_args wants a data.cache_dir: the user's if given, else the trainers' default (~/.cache/jaxtrain)."""
    given = [a.split("=", 1)[1] for a in overrides if a.startswith("--data.cache_dir=")]
    return (given[-1] if given else os.path.join(os.path.expanduser("~"), ".cache", "jaxtrain"),)


def column(lines: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    train = runs.train_lines(lines)
    return np.array([x["step"] for x in train]), np.array([x[key] for x in train], np.float64)


def compare(lines: dict, states: dict, precision: str, refs: dict) -> list[judgment.Row]:
    """jaxtrain against torchref, each bound widened by the rounding floor (each backend against its reference)."""
    j, t = lines["jaxtrain"], lines["torchref"]
    floor_lines = [(lines[b], lines[r]) for b, r in refs.items()]
    floor_states = [(states[b], states[r]) for b, r in refs.items()]
    if precision == "fp32":
        rows = judgment.compare_metrics(j, t, bounds.FP32, floors=floor_lines)
        return rows + judgment.compare_states(states["jaxtrain"], states["torchref"], {
            "params": bounds.params_bound(column(t, "lr")[1]), "exp_avg": None, "exp_avg_sq": None}, floor_states)
    step_bounds, mean_loss, gap_ratio = bounds.LOW_PRECISION[precision]
    rows = judgment.compare_metrics(j, t, step_bounds, floors=floor_lines)
    if precision == "fp16":  # the loss scaling's decisions: the fp32 references have none
        rows += judgment.compare_metrics(j, t, bounds.FP16_DECISIONS)[1:]
    loss = {label: column(lines[label], "loss")[1] for label in lines}  # refs' labels: "<backend> fp32"
    rows.append(judgment.scalar_row("loss mean |dloss|", judgment.mean_gap(loss["jaxtrain"], loss["torchref"]),
                                    mean_loss, _own_mean(lines, refs)))
    rows += judgment.gap_rows(precision, loss, gap_ratio, bounds.OWN_GAP_RATIO)
    # The params are judged by the gap ratio (their key bias by its floor, which compare_states applies).
    cross_states = judgment.compare_states(states["jaxtrain"], states["torchref"],
                                           {"params": None, "exp_avg": None, "exp_avg_sq": None}, floor_states,
                                           judgment.floor_factor(precision))
    own_p = judgment.compare_states(states["torchref"], states[refs["torchref"]], {"params": None})[0].max_abs
    rows.append(judgment.gap_ratio_row("final params", precision, cross_states[0].max_abs, own_p, gap_ratio))
    return rows + cross_states


def _own_mean(lines: dict, refs: dict) -> float:
    """The mean |dloss| of each backend against its reference run, the larger: the floor of the bf16 mean row."""
    return max(judgment.mean_gap(column(lines[b], "loss")[1], column(lines[r], "loss")[1]) for b, r in refs.items())


# The PNGs ----------------------------------------------------------------------------------------------------------

def _curves(ax, lines: dict, key: str, ylabel: str) -> None:
    for label, ls in lines.items():
        steps, y = column(ls, key)
        ax.plot(steps, y, label=label, color=COLORS.get(label, "tab:gray"), lw=1.6 if label == "jaxtrain" else 1.1,
                ls="-" if label == "jaxtrain" else "--")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()


def _gaps(ax, steps, d: np.ndarray, label: str, style: tuple[str, str] = ("tab:purple", "o")) -> None:
    """|differences| on a log axis: markers per step, exact zeros as triangles on the floor."""
    color, marker = style
    nonzero = d > 0
    ax.semilogy(steps[nonzero], d[nonzero], ls="none", marker=marker, ms=3.5, color=color, label=label)
    if (~nonzero).any():
        ax.semilogy(steps[~nonzero], np.full((~nonzero).sum(), ZERO_FLOOR), ls="none", marker="v", ms=3.5,
                    color=color, alpha=0.6, label=f"{label}: exactly 0 (drawn at {ZERO_FLOOR:g})")


def _figure(title: str):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 2))
    fig.suptitle(title)
    bottom.set_xlabel("optimizer step")
    return fig, top, bottom


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lr(lines: dict, path: str, precision: str) -> None:
    fig, top, bottom = _figure(f"Learning rate applied at each step ({precision})")
    _curves(top, {k: lines[k] for k in ("jaxtrain", "torchref")}, "lr", "lr")
    steps, j = column(lines["jaxtrain"], "lr")
    _, t = column(lines["torchref"], "lr")
    bottom.plot(steps, (j - t) / np.abs(t).max() * 1e6, color="tab:purple", marker=".", ms=3, lw=0.8)
    bound = bounds.FP32["lr"].peak_rtol * 1e6
    for sign in (1, -1):
        bottom.axhline(sign * bound, color="tab:red", ls=":", lw=1,
                       label=f"bound ({bounds.FP32['lr'].text()})" if sign > 0 else None)
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_ylabel("(jaxtrain - torchref) / peak LR  (x 1e-6)")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    _save(fig, path)


FLOOR_STYLE = {"jaxtrain": ("tab:gray", "+"), "torchref": ("tab:gray", "x")}  # each backend against itself


def plot_gaps(lines: dict, path: str, key: str, title: str, precision: str, refs: dict,
              relative: bool = False, threshold: float | None = None) -> None:
    """Top: the column's curves. Bottom: |jaxtrain - torchref| per step, each backend's rounding floor (against its
    reference run), and the bound the comparison applies at each step (judgment.Bound.allowed)."""
    fig, top, bottom = _figure(f"{title} ({precision})")
    _curves(top, lines, key, key)
    if threshold:
        top.axhline(threshold, color="tab:red", ls=":", lw=1, label=f"clip threshold {threshold:g}")
        top.legend()
    steps, j = column(lines["jaxtrain"], key)
    t = column(lines["torchref"], key)[1]
    scale, per = (np.abs(t), " / torchref") if relative else (1.0, "")
    _gaps(bottom, steps, np.abs(j - t) / scale, f"|jaxtrain - torchref|{per}")
    floors = [(column(lines[b], key)[1], column(lines[r], key)[1]) for b, r in refs.items()]
    for (backend, ref), (x, y) in zip(refs.items(), floors):
        _gaps(bottom, steps, np.abs(x - y) / scale, f"floor: |{backend} - {ref}|{per}", FLOOR_STYLE[backend])
    bound = (bounds.FP32 if precision == "fp32" else bounds.LOW_PRECISION[precision][0])[key]
    if bound is not None:  # bf16's grad norm is shown, not bounded (bounds.BF16)
        allowed = bound.allowed(t, judgment.floor_envelope(floors, len(t)))
        bottom.plot(steps, allowed / scale, color="tab:red", ls=":", lw=1, label=f"bound ({bound.text()})")
    if key == "loss" and precision != "fp32":
        mean = bounds.LOW_PRECISION[precision][1]
        mean_bound = mean.atol + mean.floor_factor * _own_mean(lines, refs)
        bottom.axhline(mean_bound, color="tab:red", ls="-.", lw=1, label=f"bound on the mean ({mean_bound:.2g})")
    bottom.set_ylabel("relative difference" if relative else f"|d{key}|")
    bottom.legend(loc="lower right", fontsize=8)
    bottom.grid(alpha=0.3, which="both")
    _save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
