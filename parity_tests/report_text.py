"""report.md: the table, the first step out of bound, why each bound is what it is, and the runs
(parity_tests/report.py writes it, from judgment.py's rows)."""

import os

import numpy as np

from parity_tests import judgment, runs


def _fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.3g}"


def markdown(config: str, precision: str, resolved: dict, flags: list[str], rows: list[judgment.Row], walls: dict,
             dirs: dict, refs: dict, ref_flags: list[str] = ()) -> str:
    """report.md; `ref_flags`: what the reference runs add to `flags` (report.reference)."""
    first = judgment.first_violation(rows)
    failed = [r for r in rows if r.passed is False]
    m, o = resolved["model"], resolved["optim"]
    out = [f"# jaxtrain vs torchref: {os.path.relpath(config, runs.REPO)}, {resolved['train']['steps']} steps, "
           f"{precision}", "",
           f"Model {m['n_layer']} layers, d={m['d_model']}, T={m['seq_len']}, vocab {m['vocab_size']}; batch "
           f"{resolved['data']['batch_size']} sequences in {o['grad_accum_steps']} micro-batches; lr {o['lr']:g} "
           f"(warmup {o['warmup_steps']}, cosine to {o['min_lr']:g}), clip {o['max_grad_norm']:g}, weight decay "
           f"{o['weight_decay']:g}. Both runs start from one init (jaxtrain's fresh params exported to the torch "
           f"format, weights only) and go through their command lines; flags: `{' '.join(flags)}`.", ""]
    if not failed:
        out.append("**Every component is within its bound at every step.**")
    elif first is not None:
        out.append(f"**First step out of bound: {first.first_bad}** ({first.detail}).")
    if failed:
        out.append("")
        out += [f"- FAIL: {r.detail}" for r in failed]
    out += ["", "| component | max abs diff | max rel diff | rounding floor | bound | pass/fail |",
            "|---|---|---|---|---|---|"]
    for r in rows:
        verdict = {None: "(shown)", True: "pass", False: "**FAIL**"}[r.passed]
        name = r.component.replace("|", "\\|")
        out.append(f"| {name} | {_fmt(r.max_abs)} | {_fmt(r.max_rel)} | {_fmt(r.floor)} | {judgment.bound_text(r)} | "
                   f"{verdict} |")
    out += ["", "Per-step columns compare jaxtrain (a) with torchref (b): abs |a-b|, rel |a-b|/|b|; final tensors "
                "by name in the torch layout (rel: to the tensor's largest entry)."]
    out += ["", floor_paragraph(precision, refs, ref_flags), "", _zero_gradient_paragraph()]
    out += ["", "## Why these bounds", ""]
    seen = set()
    for r in rows:
        if r.bound is not None and r.bound.reason not in seen:
            seen.add(r.bound.reason)
            out.append(f"- **{r.component}** ({judgment.bound_text(r)}): {r.bound.reason}.")
    out += ["", "## Curves", "", "![learning rate](lr.png)", "", "![loss](loss.png)", "",
            "![grad norm](grad_norm.png)", "", "## Runs", "", "| run | wall s | folder |", "|---|---|---|"]
    for label, wall in walls.items():
        folder = dirs.get(label, dirs["jaxtrain"].rsplit("/", 1)[0] + "/init" if label == "export init" else "")
        out.append(f"| {label} | {wall:.1f} | `{folder}` |")
    return "\n".join(out) + "\n"


def floor_paragraph(precision: str, refs: dict, ref_flags: list[str] = ()) -> str:
    if not refs:
        return ("**No rounding floor**: the config runs at no other accumulation (the batch splits no other way, or "
                "the other micro-batches break another of its rules), so no reference run was made; "
                "every bound is its constant part alone, and the key bias is held like the other params.")
    what = (f"in fp32 (how far {precision} alone moves it)" if precision != "fp32" else
            "with only the order of its fp32 sums changed (another accumulation: same batches, same math)")
    factor = judgment.floor_factor(precision)
    given = f" (`{' '.join(ref_flags)}`)" if ref_flags else ""
    return (f"**Rounding floor**: each backend run again {what}: `{'`, `'.join(refs.values())}`{given}. The floor "
            f"column is the larger of the two backends' gaps to their reference, in the same statistic as the row. "
            f"Training "
            f"amplifies rounding, so what two correct implementations may differ by grows with the run; a per-step "
            f"bound marked `+ {factor:g} x floor` allows, at step t, its constant part (rounding at equal "
            f"params, sized on a run that does not amplify it) plus {factor:g} times the largest floor up "
            f"to step t; a final-tensor bound, its constant plus {factor:g} times the floor of the same "
            f"entries. A different update rule moves the runs apart from the step where it acts, by an amount "
            f"the rule sets, not rounding; it could hide only where it stays under {factor:g}x what "
            f"rounding alone has done by then (parity_tests/judgment.py, floor_factor).")


def _zero_gradient_paragraph() -> str:
    return (f"**Zero-gradient directions**: the attention's key bias (the middle third of each `c_attn.bias`) adds "
            f"the same amount to every score of a softmax row, so the loss does not depend on it and its true "
            f"gradient is exactly 0; the only such entries of the model (checked in fp64 by "
            f"parity_tests/test_zero_gradient.py). fp32 leaves rounding noise there, which Adam scales to steps of "
            f"up to lr, so the key bias random-walks in every implementation, and in each backend against itself. "
            f"Its rows (`{judgment.ZERO_GRADIENT}`) have a floor of their own, so its random walk widens no other "
            f"entry's bound; every other entry keeps the tight bound plus its own, much smaller floor. No update "
            f"rule treats the key bias apart from the other biases, so a rule difference shows in the tightly held "
            f"entries.")
