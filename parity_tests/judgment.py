"""The judgment of two runs: each metric column and each final tensor against a bound that says where its number
comes from, widened by what rounding alone has done by then (the rounding floor, FLOOR_FACTOR).

Shared by the end-to-end tests (test_trajectories.py) and the report (report.py), on what runs.py reads back:

    rows = compare_metrics(runs.read_metrics(out_a), runs.read_metrics(out_b), FP32)   # per-column diffs vs bounds
    rows += compare_states(runs.final_state(...), runs.final_state(...), {...})        # final params and moments
    assert not failures(rows), format_rows(rows)

numpy only, as runs.py.
"""

import dataclasses
import math

import numpy as np

from parity_tests import runs


@dataclasses.dataclass(frozen=True)
class Bound:
    """|a - b| <= atol + rtol * |b| + peak_rtol * max |b| + floor_factor * (rounding floor so far) at every step
    (see FLOOR_FACTOR); `reason` says where the numbers come from. peak_rtol sizes an absolute part by the column's
    largest value: an LR schedule's rounding is a fraction of its peak, at every step, however small the LR. A
    statistic (scalar_row) is held to at most atol (+ floor_factor x its floor) and at least `least`."""
    atol: float
    rtol: float
    reason: str
    floor_factor: float = 0.0
    peak_rtol: float = 0.0
    least: float = 0.0

    def text(self) -> str:
        parts = [f"atol {_sci(self.atol)}"] if self.atol else []
        parts += [f"rtol {_sci(self.rtol)}"] if self.rtol else []
        parts += [f"{_sci(self.peak_rtol)} x peak"] if self.peak_rtol else []
        parts += [f"{self.floor_factor:g} x floor"] if self.floor_factor else []
        return " + ".join(parts) if parts else "exact"

    def allowed(self, b: np.ndarray, envelope: np.ndarray) -> np.ndarray:
        """The largest |a - b| allowed at each step, given the rounding floor's running max."""
        peak = np.abs(b).max(initial=0.0)
        return self.atol + self.rtol * np.abs(b) + self.peak_rtol * peak + self.floor_factor * envelope


def _sci(x: float) -> str:
    """x in e-notation to 3 significant digits, trailing zeros dropped (1e-05, 9.75e-03): a computed bound printed
    to one digit read as another (0.00975 as 1e-02, beside a 0.0099 difference marked FAIL)."""
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"


@dataclasses.dataclass
class Row:
    """One component of the comparison: the worst step and the first step out of bound."""
    component: str
    max_abs: float
    max_rel: float
    bound: Bound | None  # None: shown, not judged
    first_bad: int | None = None  # step (or index) where the bound is first exceeded
    detail: str = ""  # a sentence about the first violation, or the worst element
    floor: float | None = None  # the same statistic for each backend against itself, rounding only (the larger)

    @property
    def passed(self) -> bool | None:
        return None if self.bound is None else self.first_bad is None


# The rounding floor ------------------------------------------------------------------------------------------------
# How far apart rounding alone puts two runs of one backend, measured in the same report: each backend against itself
# with only its fp32 sums reordered (accumulation 2k instead of k, or another where the config refuses 2k:
# report.accumulations; same batches, same math). Training amplifies rounding (a trajectory is chaotic at a high
# enough LR), so what two correct implementations may differ by grows with the run; no constant measured on one run
# length holds at every length. The report's per-step bound is
#     |a_t - b_t| <= atol + rtol |b_t| + FLOOR_FACTOR * max_{s <= t} floor_s
# (the constant part: rounding at equal params, which is all there is at step 1), and the final params' is
# atol + FLOOR_FACTOR * floor. A rule difference (a mask, an LR offset, a clip epsilon, a mean of means) moves the
# trajectory from the step where it acts by an amount set by the rule, not by rounding; it hides only where it stays
# below FLOOR_FACTOR times what rounding alone has done by then.
# Measured, not derived: on tiny.yaml in fp32 the cross-backend gap reaches 5.0x (loss) and 6.0x (grad_norm) the
# larger self gap over 500 steps, 6.4x and 6.8x over 2,000; FLOOR_FACTOR = 15 leaves a 2.2x margin. The self gap is
# a low estimate of rounding's reach (two backends round every op differently, a reordered accumulation only the
# gradient sums), which is why the factor is well above 1. With the reference at half the accumulation (tiny.yaml at
# k=32, whose 2k does not split its batch of 32; 500 steps, 2026-12-01) the loss's gap reached 1.75x the floor so far
# (step 150), the grad norm's 0.16x over the last 100 steps (10x at step 3, where the bound's constant holds it).
FLOOR_FACTOR = 15.0
# bf16's floor is each backend's own bf16-vs-fp32 gap, and issue 4's rule sizes its factor: jaxtrain's bf16 may differ
# from torchref's bf16 by no more than 3x as much as bf16 moves either backend from its fp32 run (by then). Measured
# on tiny.yaml over 500 steps: the per-step gap reaches 0.71x that envelope, the mean 0.36x torchref's mean gap.
BF16_FLOOR_FACTOR = 3.0


def floor_factor(precision: str) -> float:
    """The factor of the rounding floor in `precision`'s bounds: FLOOR_FACTOR in fp32, BF16_FLOOR_FACTOR in bf16 and
    fp16."""
    return FLOOR_FACTOR if precision == "fp32" else BF16_FLOOR_FACTOR


def compare_series(name: str, steps, a, b, bound: Bound | None, floors=()) -> Row:
    """Column `name` of two runs (a: jaxtrain, b: torchref unless said otherwise), aligned by step. `floors`:
    (x, y) pairs of the same column for one backend against itself, aligned the same way (see FLOOR_FACTOR)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    rel = diff / np.maximum(np.abs(b), np.finfo(np.float64).tiny)
    row = Row(name, float(diff.max(initial=0.0)), float(rel.max(initial=0.0)), bound)
    envelope = floor_envelope(floors, len(diff))
    if floors:
        row.floor = float(envelope.max(initial=0.0))
    if bound is not None:
        allowed = bound.allowed(b, envelope)
        bad = np.flatnonzero(~(diff <= allowed))  # NaN counts as out of bound
        if bad.size:
            i = bad[0]
            floor = f", floor so far {envelope[i]:.3g}" if bound.floor_factor else ""
            row.first_bad = int(steps[i])
            row.detail = (f"{name} leaves its bound ({bound.text()}{floor}) first at step {steps[i]}: {a[i]:.9g} vs "
                          f"{b[i]:.9g}, |diff| {diff[i]:.3g} (rel {rel[i]:.3g}) > {allowed[i]:.3g}; {bad.size} of "
                          f"{len(steps)} steps out of bound")
    return row


def floor_envelope(floors, n: int) -> np.ndarray:
    """max_{s <= t} over the (x, y) pairs of |x_s - y_s|: how far rounding alone has moved either backend by step t
    (zeros without floors)."""
    if not floors:
        return np.zeros(n)
    own = np.max([np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)) for x, y in floors], axis=0)
    return np.maximum.accumulate(own) if own.size else np.zeros(n)


def compare_metrics(a_lines: list[dict], b_lines: list[dict], bounds: dict[str, Bound | None],
                    steps: range | None = None, floors=()) -> list[Row]:
    """One Row per column in `bounds` (loss, lr, grad_norm, tokens; eval_loss and eval_accuracy from the eval lines),
    over the steps both runs logged (or those of `steps`). A step logged by one run only is itself a failure: of the
    `step` row for the train lines, of the `eval step` row (there when `bounds` has an eval column) for the eval
    lines. `floors`: pairs of metrics (one backend against itself, rounding only), which widen each bound as
    FLOOR_FACTOR says."""
    kinds = {"step": runs.train_lines}
    if any(column.startswith("eval_") for column in bounds):
        kinds["eval step"] = runs.eval_lines
    rows, at = [], {}
    for kind, select in kinds.items():
        a_by, b_by = _by_step(select(a_lines)), _by_step(select(b_lines))
        logged = sorted(a_by.keys() | b_by.keys())
        if steps is None:
            wanted = logged
        elif kind == "step":
            wanted = list(steps)  # a train line at each of `steps`
        else:
            wanted = [s for s in steps if s in logged]  # an eval line at those of them either run evaluated at
        row, at[select] = _logged_row(kind, wanted, a_by, b_by)
        rows.append(row)
    for column, bound in bounds.items():
        select = runs.eval_lines if column.startswith("eval_") else runs.train_lines
        pairs = [tuple(_values(_by_step(select(lines)), column, at[select]) for lines in pair) for pair in floors]
        a, b = (_values(_by_step(select(lines)), column, at[select]) for lines in (a_lines, b_lines))
        rows.append(compare_series(column, at[select], a, b, bound, pairs))
    return rows


def _logged_row(kind: str, wanted: list[int], a_by: dict, b_by: dict) -> tuple[Row, list[int]]:
    """The row that fails at the first of the `wanted` steps only one run logged a `kind` line at, and the steps
    both logged."""
    missing = [s for s in wanted if s not in a_by or s not in b_by]
    row = Row(kind, 0.0, 0.0, Bound(0, 0, f"same {kind}s logged"), first_bad=min(missing) if missing else None,
              detail=f"{kind}s logged by one run only: {missing[:10]}" if missing else "")
    return row, [s for s in wanted if s in a_by and s in b_by]


def _by_step(lines: list[dict]) -> dict[int, dict]:
    return {line["step"]: line for line in lines}


def _values(by_step: dict[int, dict], column: str, steps: list[int]) -> list:
    return [by_step[s][column] for s in steps]


# Directions with zero true gradient --------------------------------------------------------------------------------
# The attention scores of query i are q_i . (k_j + b_k) = q_i . k_j + q_i . b_k over keys j: the key bias adds the
# same q_i . b_k to every score of a row, and softmax ignores a shift shared by a row. So the loss does not depend on
# the key bias, its exact gradient is 0, and exact AdamW leaves it at its init (no decay: neither mask rule decays a
# bias). What fp32 computes there is the rounding residue of sums that should cancel (~1e-9), and Adam's
# m / (sqrt(v) + eps) turns that noise into steps of up to lr: the key bias random-walks, differently in any two
# implementations, and in one implementation when only its summation order changes (tiny.yaml, 500 steps: 1.4e-3
# between the backends, 1.0e-3 and 1.7e-3 for each against itself; every other entry 2.3e-5). Its final value says
# nothing about the update rule, so it gets a row and a rounding floor of its own: judged with the other params, its
# random walk would set their floor (and so their bound) 70x too wide, or fail a correct run without one. Every rule
# of the update (mask, clip, LR, AdamW, accumulation) acts on all other tensors too, which keep their own, tight
# floor: nothing singles out these entries, so judging them by their own floor cannot hide a rule difference.
# parity_tests/test_zero_gradient.py checks in fp64 that they are the model's only entries whose gradient is exactly
# zero.
ZERO_GRADIENT = "key bias (zero true gradient)"


def zero_gradient_part(name: str, n: int) -> slice | None:
    """The entries of tensor `name` (a torch name; `.exp_avg` and `.exp_avg_sq` of it too) whose true gradient is
    zero: the key third of each attention's c_attn.bias (q, k, v in that order), or None."""
    base = name.removesuffix(".exp_avg_sq").removesuffix(".exp_avg")
    return slice(n // 3, 2 * n // 3) if base.endswith(".attn.c_attn.bias") else None


def _parts(state: dict[str, np.ndarray], group: str) -> dict[str, dict[str, np.ndarray]]:
    """The group's tensors, flat, fp64, split into the entries with a true gradient ('') and without (ZERO_GRADIENT)."""
    parts = {"": {}, ZERO_GRADIENT: {}}
    for name, x in state.items():
        if _group_of(name) != group:
            continue
        x = x.astype(np.float64).ravel()
        zero = zero_gradient_part(name, x.size)
        keep = np.ones(x.size, bool)
        if zero is not None:
            keep[zero] = False
            parts[ZERO_GRADIENT][name] = x[zero]
        parts[""][name] = x[keep]
    return parts


def _group_of(name: str) -> str:
    """'exp_avg' or 'exp_avg_sq' for AdamW's moments (by their torch-format suffix), else 'params'."""
    return next((m for m in ("exp_avg_sq", "exp_avg") if name.endswith(f".{m}")), "params")


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float, str | None]:
    """Largest |a - b| over the tensors, the largest relative to a tensor's scale, and the tensor of the first."""
    worst, max_abs, max_rel = None, 0.0, 0.0
    for name in a:
        d = float(np.abs(a[name] - b[name]).max(initial=0.0))
        if d >= max_abs:
            worst, max_abs = name, d
        max_rel = max(max_rel, d / max(float(np.abs(b[name]).max(initial=0.0)), np.finfo(np.float64).tiny))
    return max_abs, max_rel, worst


def compare_states(a: dict[str, np.ndarray], b: dict[str, np.ndarray], bounds: dict[str, Bound | None],
                   floors=(), floor_factor: float = FLOOR_FACTOR) -> list[Row]:
    """Final params ('params') and AdamW's moments ('exp_avg', 'exp_avg_sq'), max over all tensors, in two rows per
    group: the entries with a true gradient and the key bias (see ZERO_GRADIENT), each under bounds[group] plus
    floor_factor x its own rounding floor, which `floors` (state pairs, one backend against itself) give
    (with_floor). The params' key bias is judged against its floor even where bounds[group] is None (bf16)."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    rows = []
    for group, bound in bounds.items():
        pa, pb = _parts(a, group), _parts(b, group)
        own = [(_parts(x, group), _parts(y, group)) for x, y in floors]
        for part in pa:
            if not pa[part]:
                continue  # a model without biases has no key bias
            max_abs, max_rel, worst = _max_diff(pa[part], pb[part])
            floor = max((_max_diff(x[part], y[part])[0] for x, y in own), default=None)
            judged = bound is not None or (part and group == "params" and floor is not None)
            part_bound = with_floor(bound, floor, floor_factor) if judged else None
            name = f"final {group}" + (f": {part}" if part else "")
            row = Row(name, max_abs, max_rel, part_bound, detail=f"largest in {worst}", floor=floor)
            if part_bound is not None and not max_abs <= part_bound.atol:
                row.first_bad = -1
                row.detail = f"{name} differ by {max_abs:.3g} > {part_bound.text()} (largest in {worst})"
            rows.append(row)
    return rows


def with_floor(tight: Bound | None, floor: float | None, factor: float) -> Bound:
    """A final-tensor bound: the tight constant (none for the bf16 params, which the gap ratio judges) plus
    `factor` x the rounding floor measured on the same entries; without a floor, the tight bound."""
    if floor is None:
        return tight
    why = f"{tight.reason}; plus " if tight else ""
    return Bound((tight.atol if tight else 0.0) + factor * floor, 0.0,
                 f"{why}{factor:g} x the rounding floor measured on these entries ({floor:.3g}: each backend against "
                 f"itself, the larger). The key bias (zero true gradient) has its own floor, so its random walk "
                 f"widens no other entry's bound")


def bitwise_equal_states(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> str | None:
    """None when every tensor is identical bit for bit; else a message naming the first that is not."""
    if a.keys() != b.keys():
        return f"different tensors: {sorted(a.keys() ^ b.keys())}"
    for name in sorted(a):
        if a[name].shape != b[name].shape or a[name].tobytes() != b[name].tobytes():
            d = np.abs(a[name].astype(np.float64) - b[name].astype(np.float64)).max()
            return f"{name} differs (max |diff| {d:.3g})"
    return None


def first_difference(a_lines: list[dict], b_lines: list[dict]) -> str | None:
    """None when the two metrics files are identical minus timing; else which column differs first, where."""
    a, b = runs.without_timing(a_lines), runs.without_timing(b_lines)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            cols = [k for k in sorted(x.keys() | y.keys()) if x.get(k) != y.get(k)]
            k = cols[0]
            return (f"line {i + 1} (step {x.get('step')}): column {k!r} differs first, {x.get(k)!r} vs {y.get(k)!r}"
                    + (f" (|diff| {abs(x[k] - y[k]):.3g})" if isinstance(x.get(k), float) and
                       isinstance(y.get(k), float) else "") + f"; all differing columns: {cols}")
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} lines"
    return None


def failures(rows: list[Row]) -> str:
    """The failing rows, earliest step first: what a failed assertion prints."""
    bad = sorted((r for r in rows if r.passed is False), key=lambda r: (r.first_bad if r.first_bad >= 0 else math.inf))
    return "\n".join(r.detail for r in bad)


def bound_text(row: Row) -> str:
    """How a row's bound reads in a table: per-step tolerances, or an upper limit for a statistic."""
    if row.bound is None:
        return "-"
    if not math.isnan(row.max_rel):
        return row.bound.text()
    if row.bound.least:
        return f"{row.bound.least:.3g} to {row.bound.atol:g}"
    floor = f" + {row.bound.floor_factor:g} x floor" if row.bound.floor_factor and row.floor is not None else ""
    return f"<= {row.bound.atol:g}{floor}"


def format_rows(rows: list[Row]) -> str:
    """The comparison as a plain-text table (for assertion messages), with the rounding floor where measured."""
    lines = [f"{'component':<48} {'max abs':>10} {'max rel':>10} {'floor':>10}  {'bound':<25} result"]
    for r in rows:
        verdict = {None: "shown", True: "pass",
                   False: "FAIL" if r.first_bad is None or r.first_bad < 0 else f"FAIL at step {r.first_bad}"}
        floor = "-" if r.floor is None else f"{r.floor:.3g}"
        lines.append(f"{r.component:<48} {r.max_abs:>10.3g} {r.max_rel:>10.3g} {floor:>10}  "
                     f"{bound_text(r):<25} {verdict[r.passed]}")
    return "\n".join(lines)


def first_violation(rows: list[Row]) -> Row | None:
    bad = [r for r in rows if r.passed is False and r.first_bad is not None and r.first_bad >= 0]
    return min(bad, key=lambda r: r.first_bad) if bad else None


def scalar_row(component: str, value: float, bound: Bound, floor: float | None = None) -> Row:
    """A statistic (a mean, a ratio) against an upper limit: bound.atol, plus bound.floor_factor x the same statistic
    for each backend against its reference (`floor`), where measured; and against bound.least below."""
    limit = bound.atol + bound.floor_factor * (floor or 0.0)
    row = Row(component, value, float("nan"), bound, floor=floor)
    if not bound.least <= value <= limit:  # NaN fails
        row.first_bad = -1
        side = f"< {bound.least:.3g}" if value < bound.least else f"> {limit:.3g}"
        row.detail = f"{component} = {value:.3g} {side} ({bound.reason})"
    return row


# The low-precision rules --------------------------------------------------------------------------------------------
# bf16 and fp16 are judged on gaps, each the mean over steps of |dloss| (or the final params' max |diff|): between the
# backends in that precision (cross), and each backend against its own fp32 run (own). The cross gap may be at most
# a bound's factor times torchref's own (issue 4's 3x rule), and jaxtrain's own gap must be comparable to
# torchref's (bounds.OWN_GAP_RATIO): a jaxtrain that silently computed in fp32 has no gap of its own and sits close
# to torchref's fp16, which the first rule alone passes. The report and the tests (test_trajectories.py,
# test_fp16.py) take both rules from here.

def ratio(num: float, den: float) -> float:
    """num / den of two gaps (>= 0): 0 / 0 is 0 (nothing moved either: no gap to exceed), x / 0 is inf (a gap where
    the reference has none: out of any bound); NaN stays NaN (out of bound too)."""
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def mean_gap(a, b) -> float:
    """Mean over steps of |a - b|."""
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).mean())


def gap_ratio_row(what: str, precision: str, cross: float, own: float, bound: Bound) -> Row:
    """The cross-backend gap of `what` against torchref's own `precision`-vs-fp32 gap."""
    return scalar_row(f"{what} gap / torchref's {precision}-fp32 gap", ratio(cross, own), bound)


def gap_rows(precision: str, loss: dict, cross_bound: Bound, own_bound: Bound) -> list[Row]:
    """Both rules on the loss. `loss`: the column at the same steps of 'jaxtrain' and 'torchref' in `precision`, and
    of each in fp32 ('jaxtrain fp32', 'torchref fp32')."""
    own = {b: mean_gap(loss[b], loss[f"{b} fp32"]) for b in runs.BACKENDS}
    cross = gap_ratio_row("loss", precision, mean_gap(loss["jaxtrain"], loss["torchref"]), own["torchref"],
                          cross_bound)
    mine = scalar_row(f"jaxtrain's {precision}-fp32 loss gap / torchref's", ratio(own["jaxtrain"], own["torchref"]),
                      own_bound)
    if mine.first_bad is not None:
        mine.detail += f"; mean |dloss| {own['jaxtrain']:.3g} (jaxtrain) vs {own['torchref']:.3g} (torchref)"
    return [cross, mine]
