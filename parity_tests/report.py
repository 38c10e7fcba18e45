"""The parity report: both backends from one init, a table of how far apart they are, and the curves.

    python -m parity_tests.report --config configs/tiny.yaml --steps 100 --precision fp32 --out out/parity-fp32
    python -m parity_tests.report --config configs/tiny.yaml --steps 100 --precision bf16 --out out/parity-bf16

Exports jaxtrain's fresh params for the config to the torch format (weights only), starts `python -m jaxtrain.run`
and `python -m torchref.run` from them (dropout forced to 0, every step logged), and writes into --out:

    report.md      a table (component, max abs diff, max rel diff, bound, pass/fail), the first step where any
                   column leaves its bound, each bound's reason, the commands and their runtimes
    lr.png         LR curves overlaid, and their ratio minus 1
    loss.png       loss curves overlaid, and |dloss| per step against its bound
    grad_norm.png  pre-clip gradient norms overlaid with the clip threshold, and their relative difference

A third run gives the scale of what rounding alone does on this config: in bf16, torchref in fp32 (the cross-backend
gap is judged against torchref's own bf16-vs-fp32 gap, issue 4's 3x rule); in fp32, torchref with twice the
gradient accumulation (same batches, same math, only the fp32 sums reordered), shown beside the cross-backend
gaps: where training amplifies rounding, that gap grows step after step too, and the per-step fp32 bounds
(measured on a run that does not amplify it) cannot be expected to hold. Further `--section.key=value` flags go to
both runs. Exit status 1 when a bound is exceeded.
The bounds and their reasons are runs.FP32 / runs.BF16 / runs.params_bound, the same the tests assert.
"""

import argparse
import os
import shutil
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from parity_tests import runs  # noqa: E402

COLORS = {"jaxtrain": "tab:blue", "torchref": "tab:orange"}  # the reference run: gray
ZERO_FLOOR = 1e-9  # where an exact 0 difference is drawn on the log axes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.report", description=__doc__.split("\n\n")[0],
                                 epilog="Any further --section.key=value flag is passed to both runs.")
    ap.add_argument("--config", required=True, help="run config YAML, e.g. configs/tiny.yaml")
    ap.add_argument("--steps", type=int, help="train.steps for both runs (default: the config's)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--out", required=True, help="folder for report.md, the PNGs and the runs (runs/ is replaced)")
    known, overrides = ap.parse_known_args(argv)
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a)]
    if bad:
        ap.error(f"unexpected argument {bad[0]!r}; overrides look like --section.key=value")
    report = build(os.path.abspath(known.config), known.steps, known.precision, os.path.abspath(known.out), overrides)
    print(report.summary)
    return 0 if report.passed else 1


class Report:
    def __init__(self, passed: bool, summary: str):
        self.passed, self.summary = passed, summary


def build(config: str, steps: int | None, precision: str, out: str, overrides: list[str]) -> Report:
    work = os.path.join(out, "runs")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    forced = [*(["--train.steps=%d" % steps] if steps else []), f"--train.precision={precision}",
              "--model.dropout=0.0", "--train.eval_every=0"]
    # User flags first, the forced ones last (later flags win): dropout masks cannot match across backends.
    args = lambda name, *more: runs.run_args(os.path.join(work, name), *_cache(overrides), *overrides, *forced,
                                             *more, config=config)
    walls = {}

    def step(label, fn):
        print(f"{label} ...", file=sys.stderr, flush=True)
        proc = fn()
        walls[label] = proc.wall_s if proc is not None else None
        print(f"{label}: {walls[label]:.1f} s", file=sys.stderr, flush=True)
        return proc

    init = os.path.join(work, "init")
    step("export init", lambda: runs.cli("parity_tests.runs", "export-init", init, *args("init-config")))
    dirs = {label: os.path.join(work, label) for label in runs.BACKENDS}
    for backend in runs.BACKENDS:
        step(backend, lambda: runs.train(backend, args(backend), init))
    # torchref's: it writes model.vocab_size resolved from the data (jaxtrain's config.yaml keeps null).
    with open(os.path.join(dirs["torchref"], "config.yaml"), encoding="utf-8") as f:
        resolved = yaml.safe_load(f)
    n_steps = resolved["train"]["steps"]
    ref, more = reference(precision, resolved)
    if ref is not None:
        dirs[ref] = os.path.join(work, "torchref-reference")
        step(ref, lambda: runs.train("torchref", args("torchref-reference", *more), init))
    lines = {label: runs.read_metrics(d) for label, d in dirs.items()}
    states = {label: runs.final_state(label.split()[0], d, n_steps) for label, d in dirs.items()}
    rows = compare(lines, states, precision, ref)

    plot_lr(lines, os.path.join(out, "lr.png"), precision)
    plot_loss(lines, os.path.join(out, "loss.png"), precision, ref)
    plot_grad_norm(lines, os.path.join(out, "grad_norm.png"), resolved["optim"]["max_grad_norm"], precision, ref)
    text = markdown(config, precision, n_steps, resolved, overrides + forced, rows, walls, dirs, ref)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    passed = all(r.passed is not False for r in rows)
    first = runs.first_violation(rows)
    verdict = "all bounds hold" if passed else (
        f"first out of bound: {first.detail}" if first else "out of bound:\n" + runs.failures(rows))
    return Report(passed, f"{runs.format_rows(rows)}\n\n{verdict}\nwrote {out}/report.md, lr.png, loss.png, "
                          f"grad_norm.png")


def reference(precision: str, resolved: dict) -> tuple[str | None, list[str]]:
    """The third run's label and flags: torchref in fp32 for a bf16 report; torchref with twice the accumulation
    for an fp32 one (None where the batch does not split further)."""
    if precision == "bf16":
        return "torchref fp32", ["--train.precision=fp32"]
    k, batch = resolved["optim"]["grad_accum_steps"], resolved["data"]["batch_size"]
    if batch % (2 * k):
        return None, []
    return f"torchref accum {2 * k}", [f"--optim.grad_accum_steps={2 * k}"]


def _cache(overrides: list[str]) -> tuple[str]:
    """run_args wants a data.cache_dir: the user's if given, else the trainers' default (~/.cache/jaxtrain)."""
    given = [a.split("=", 1)[1] for a in overrides if a.startswith("--data.cache_dir=")]
    return (given[-1] if given else os.path.join(os.path.expanduser("~"), ".cache", "jaxtrain"),)


def column(lines: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    train = runs.train_lines(lines)
    return np.array([x["step"] for x in train]), np.array([x[key] for x in train], np.float64)


def compare(lines: dict, states: dict, precision: str, ref: str | None) -> list[runs.Row]:
    j, t = lines["jaxtrain"], lines["torchref"]
    if precision == "fp32":
        rows = runs.compare_metrics(j, t, runs.FP32)
        rows += runs.compare_states(states["jaxtrain"], states["torchref"], {
            "params": runs.params_bound(column(t, "lr")[1]), "exp_avg": None, "exp_avg_sq": None})
        if ref is not None:  # shown, not judged: the scale of rounding on this run
            steps, own = column(lines[ref], "loss")
            rows.append(runs.compare_series(f"loss: torchref vs {ref}", steps, column(t, "loss")[1], own, None))
            own_p = runs.compare_states(states["torchref"], states[ref], {"params": None})[0]
            own_p.component = f"final params: torchref vs {ref}"
            rows.append(own_p)
        return rows
    rows = runs.compare_metrics(j, t, runs.BF16)
    cross = np.abs(column(j, "loss")[1] - column(t, "loss")[1])
    own = np.abs(column(t, "loss")[1] - column(lines[ref], "loss")[1])
    rows.append(runs.scalar_row("loss mean |dloss|", float(cross.mean()), runs.BF16_MEAN_LOSS))
    rows.append(runs.scalar_row("loss gap / torchref's bf16-fp32 gap", float(cross.mean() / own.mean()),
                                runs.BF16_GAP_RATIO))
    cross_states = runs.compare_states(states["jaxtrain"], states["torchref"],
                                       {"params": None, "exp_avg": None, "exp_avg_sq": None})
    own_p = runs.compare_states(states["torchref"], states[ref], {"params": None})[0].max_abs
    rows.append(runs.scalar_row("final params gap / torchref's bf16-fp32 gap", cross_states[0].max_abs / own_p,
                                runs.BF16_GAP_RATIO))
    return rows + cross_states


# The PNGs ----------------------------------------------------------------------------------------------------------

def _curves(ax, lines: dict, key: str, ylabel: str) -> None:
    for label, ls in lines.items():
        steps, y = column(ls, key)
        ax.plot(steps, y, label=label, color=COLORS.get(label, "tab:gray"), lw=1.6 if label == "jaxtrain" else 1.1,
                ls="-" if label == "jaxtrain" else "--")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()


def _gaps(ax, steps, d: np.ndarray, label: str, reference: bool = False) -> None:
    """|differences| on a log axis: markers per step, exact zeros as triangles on the floor."""
    color, marker = ("tab:gray", "x") if reference else ("tab:purple", "o")
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
    bottom.plot(steps, (j / t - 1) * 1e6, color="tab:purple", marker=".", ms=3, lw=0.8)
    bound = runs.FP32["lr"].rtol * 1e6
    for sign in (1, -1):
        bottom.axhline(sign * bound, color="tab:red", ls=":", lw=1, label="bound (rtol 1e-6)" if sign > 0 else None)
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_ylabel("jaxtrain / torchref - 1  (x 1e-6)")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    _save(fig, path)


def plot_loss(lines: dict, path: str, precision: str, ref: str | None) -> None:
    fig, top, bottom = _figure(f"Training loss per step ({precision})")
    _curves(top, lines, "loss", "loss (nats)")
    steps, j = column(lines["jaxtrain"], "loss")
    _, t = column(lines["torchref"], "loss")
    _gaps(bottom, steps, np.abs(j - t), "|jaxtrain - torchref|")
    if ref is not None:
        _gaps(bottom, steps, np.abs(t - column(lines[ref], "loss")[1]), f"|torchref - {ref}|", reference=True)
    bounds = runs.FP32 if precision == "fp32" else runs.BF16
    bottom.axhline(bounds["loss"].atol, color="tab:red", ls=":", lw=1, label=f"bound ({bounds['loss'].text()})")
    if precision == "bf16":
        bottom.axhline(runs.BF16_MEAN_LOSS.atol, color="tab:red", ls="-.", lw=1, label="bound on the mean (1e-3)")
    bottom.set_ylabel("|dloss| (nats)")
    bottom.legend(loc="lower right", fontsize=8)
    bottom.grid(alpha=0.3, which="both")
    _save(fig, path)


def plot_grad_norm(lines: dict, path: str, max_grad_norm: float, precision: str, ref: str | None) -> None:
    fig, top, bottom = _figure(f"Global gradient norm before clipping ({precision})")
    _curves(top, lines, "grad_norm", "grad norm")
    if max_grad_norm > 0:
        top.axhline(max_grad_norm, color="tab:red", ls=":", lw=1, label=f"clip threshold {max_grad_norm:g}")
        top.legend()
    steps, j = column(lines["jaxtrain"], "grad_norm")
    _, t = column(lines["torchref"], "grad_norm")
    _gaps(bottom, steps, np.abs(j - t) / t, "|jaxtrain - torchref| / torchref")
    if ref is not None:
        r = column(lines[ref], "grad_norm")[1]
        _gaps(bottom, steps, np.abs(t - r) / r, f"|torchref - {ref}| / {ref}", reference=True)
    bound = (runs.FP32 if precision == "fp32" else runs.BF16)["grad_norm"]
    if bound is not None:  # bf16's grad norm is shown, not bounded (runs.BF16)
        bottom.axhline(bound.rtol, color="tab:red", ls=":", lw=1, label=f"bound ({bound.text()})")
    bottom.set_ylabel("relative difference")
    bottom.legend(loc="lower right", fontsize=8)
    bottom.grid(alpha=0.3, which="both")
    _save(fig, path)


# report.md ---------------------------------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.3g}"


def markdown(config: str, precision: str, n_steps: int, resolved: dict, flags: list[str], rows: list[runs.Row],
             walls: dict, dirs: dict, ref: str | None) -> str:
    first = runs.first_violation(rows)
    failed = [r for r in rows if r.passed is False]
    m, o = resolved["model"], resolved["optim"]
    out = [f"# jaxtrain vs torchref: {os.path.relpath(config, runs.REPO)}, {n_steps} steps, {precision}", "",
           f"Model {m['n_layer']} layers, d={m['d_model']}, T={m['seq_len']}, vocab {m['vocab_size']}; batch "
           f"{resolved['data']['batch_size']} sequences in {o['grad_accum_steps']} micro-batches; lr {o['lr']:g} "
           f"(warmup {o['warmup_steps']}, cosine to {o['min_lr']:g}), clip {o['max_grad_norm']:g}, weight decay "
           f"{o['weight_decay']:g}. Both runs start from one init (jaxtrain's fresh params exported to the torch "
           f"format, weights only) and go through their command lines; flags: `{' '.join(flags)}`.", ""]
    if not failed:
        out.append(f"**Every component is within its bound at every step.**")
    elif first is not None:
        out.append(f"**First step out of bound: {first.first_bad}** ({first.detail}).")
    if failed:
        out.append("")
        out += [f"- FAIL: {r.detail}" for r in failed]
    out += ["", "| component | max abs diff | max rel diff | bound | pass/fail |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = {None: "(shown)", True: "pass", False: "**FAIL**"}[r.passed]
        name = r.component.replace("|", "\\|")
        out.append(f"| {name} | {_fmt(r.max_abs)} | {_fmt(r.max_rel)} | {runs.bound_text(r)} | {verdict} |")
    out += ["", "Per-step columns compare jaxtrain (a) with torchref (b): abs |a-b|, rel |a-b|/|b|; final tensors "
                "by name in the torch layout (rel: to the tensor's largest entry)."]
    if ref is not None and precision == "fp32":
        out += ["", f"How to read it: `{ref}` is torchref against itself with only the order of its fp32 sums "
                    f"changed. Where the cross-backend gaps are of its size, what separates the backends is "
                    f"rounding that the training dynamics amplify, not a different update rule. It is a low "
                    f"estimate of rounding's reach (only the gradient sums are reordered, whereas the two backends "
                    f"round every op differently); where it too grows step after step, the run amplifies rounding "
                    f"and the per-step bounds, measured on a run that does not (parity_tests/runs.py, SMALL), "
                    f"cannot be expected to hold."]
    out += ["", "## Why these bounds", ""]
    seen = set()
    for r in rows:
        if r.bound is not None and r.bound.reason not in seen:
            seen.add(r.bound.reason)
            out.append(f"- **{r.component}** ({runs.bound_text(r)}): {r.bound.reason}.")
    out += ["", "## Curves", "", "![learning rate](lr.png)", "", "![loss](loss.png)", "", "![grad norm](grad_norm.png)",
            "", "## Runs", "", "| run | wall s | folder |", "|---|---|---|"]
    for label, wall in walls.items():
        folder = dirs.get(label, dirs["jaxtrain"].rsplit("/", 1)[0] + "/init" if label == "export init" else "")
        out.append(f"| {label} | {wall:.1f} | `{folder}` |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
