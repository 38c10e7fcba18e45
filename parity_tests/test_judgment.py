"""The judgment itself (judgment.py), on hand-made numbers: the rounding-floor widening of per-step bounds, the
key-bias rule for final params, the steps each run logged, the low-precision gap rules; and params_bound's
derivation against torch's AdamW. Each expectation is worked out by hand in the comment beside it."""

import math

import numpy as np
import pytest

from parity_tests import bounds, judgment
from parity_tests.judgment import Bound

STEPS = [1, 2, 3, 4, 5]


def test_floor_widens_the_bound_by_its_running_max():
    b = np.zeros(5)
    floor_x, floor_y = np.zeros(5), np.array([0.0, 1e-6, 0.0, 3e-6, 0.0])  # envelope 0, 1e-6, 1e-6, 3e-6, 3e-6
    bound = Bound(1e-5, 0.0, "test", floor_factor=10.0)  # allowed: 1e-5, 2e-5, 2e-5, 4e-5, 4e-5
    ok = judgment.compare_series("loss", STEPS, [0.9e-5, 1.9e-5, 1.9e-5, 3.9e-5, 3.9e-5], b, bound, [(floor_x, floor_y)])
    assert ok.passed and ok.floor == 3e-6
    late = judgment.compare_series("loss", STEPS, [0.9e-5, 1.9e-5, 2.1e-5, 3.9e-5, 3.9e-5], b, bound, [(floor_x, floor_y)])
    assert late.first_bad == 3, late.detail  # step 3's floor is 0 but its envelope is still step 2's 1e-6
    alone = judgment.compare_series("loss", STEPS, [0.9e-5, 1.9e-5, 1.9e-5, 3.9e-5, 3.9e-5], b, bound)  # no floor: 1e-5
    assert alone.first_bad == 2 and alone.floor is None


def test_the_larger_of_the_two_backends_floors_counts():
    pairs = [(np.zeros(3), np.array([1e-6, 0, 0])), (np.zeros(3), np.array([0, 2e-6, 0]))]
    np.testing.assert_array_equal(judgment.floor_envelope(pairs, 3), [1e-6, 2e-6, 2e-6])


def _state(key_bias_shift=0.0, other_shift=0.0):
    """One attention bias of 6 entries (q, k, v: 2 each) and one LayerNorm weight, and their moments."""
    qkv = np.array([0.5, 0.5, key_bias_shift, key_bias_shift, 0.5, 0.5])  # a zero base: the shifts are exact
    ln = np.array([other_shift, 1.0])
    state = {"transformer.h.0.attn.c_attn.bias": qkv, "transformer.h.0.ln_1.weight": ln}
    return {**state, **{f"{n}.{m}": np.zeros_like(x) for n, x in state.items() for m in ("exp_avg", "exp_avg_sq")}}


def test_key_bias_is_judged_against_its_floor_and_the_rest_tightly():
    tight = {"params": Bound(1e-4, 0.0, "test")}
    floor = [(_state(), _state(key_bias_shift=1e-3))]  # one backend against itself: key bias 1e-3 apart
    rows = judgment.compare_states(_state(key_bias_shift=5e-3), _state(), tight, floor)
    by = {r.component: r for r in rows}
    key = by[f"final params: {judgment.ZERO_GRADIENT}"]
    assert by["final params"].passed and by["final params"].max_abs == 0.0  # the q and v thirds are equal
    assert key.passed and key.floor == 1e-3 and key.bound.atol == 1e-4 + judgment.FLOOR_FACTOR * 1e-3
    rows = judgment.compare_states(_state(key_bias_shift=2e-2), _state(), tight, floor)
    assert [r.passed for r in rows] == [True, False]  # 2e-2 > 1e-4 + 15 x 1e-3
    rows = judgment.compare_states(_state(key_bias_shift=5e-3), _state(), tight)  # no floor: the tight 1e-4
    assert [r.passed for r in rows] == [True, False]
    rows = judgment.compare_states(_state(other_shift=2e-4), _state(), tight, floor)  # its own floor is 0: 1e-4
    assert [r.passed for r in rows] == [False, True]
    bf16 = judgment.compare_states(_state(key_bias_shift=2e-2), _state(), {"params": None}, floor)
    assert [r.passed for r in bf16] == [None, False]  # params shown; the key bias judged by its floor alone


def test_peak_rtol_is_a_fraction_of_the_columns_largest_value():
    b = np.array([1e-3, 5e-4, 1e-5, 0.0, 0.0])  # peak 1e-3: allowed 1e-9 + 1e-3 x |b| at every step
    bound = Bound(1e-9, 1e-3, "test", peak_rtol=2e-6)  # + 2e-9: 1e-6 + 3e-9, 5e-7 + 3e-9, 1e-8 + 3e-9, 3e-9, 3e-9
    assert judgment.compare_series("lr", STEPS, b + [1e-6, 5e-7, 1e-8, 2.9e-9, -2.9e-9], b, bound).passed
    assert judgment.compare_series("lr", STEPS, b + [0, 0, 0, 0, 3.1e-9], b, bound).first_bad == 5
    assert bound.text() == "atol 1e-09 + rtol 1e-03 + 2e-06 x peak"


@pytest.mark.parametrize("atol, text", [(1e-5, "atol 1e-05"), (5e-3, "atol 5e-03"), (0.00975, "atol 9.75e-03"),
                                        (3.45e-4, "atol 3.45e-04"), (1.2345e-6, "atol 1.23e-06")])
def test_a_bound_reads_to_three_digits(atol, text):
    """A computed bound (3 x 0.00325 = 0.00975) printed to one digit read as 1e-02, beside a 0.0099 difference
    marked FAIL."""
    assert Bound(atol, 0.0, "test").text() == text


def test_the_lr_bound_holds_for_optaxs_float32_schedule_at_any_run_length():
    """jaxtrain's schedule (optax, float32) against the cosine written out in float64, as torchref evaluates it, over
    long runs and to min_lr = 0, where a bound relative to the LR itself fails at the last steps (it did, in a
    report of 20 steps): the LR's bound is a fraction of its peak."""
    import jax.numpy as jnp

    from jaxtrain import optim
    from parity_tests.conftest import make_cfg

    # (the relative bound fails at the long run's last steps; at 20 it still held here, 7.9e-7)
    for lr, min_lr, warmup, steps, relative_fails in ((1e-3, 0.0, 10, 20, False), (6e-4, 0.0, 2000, 100_000, True),
                                                      (3e-3, 3e-4, 500, 50_000, False)):
        cfg = make_cfg(f"--optim.lr={lr}", f"--optim.min_lr={min_lr}", f"--optim.warmup_steps={warmup}",
                       f"--train.steps={steps}")
        t = np.arange(steps + 1, dtype=np.float64)
        warm = lr * (t + 1) / (warmup + 1)  # the default warmup_init_lr = lr / (W + 1)
        cosine = min_lr + (lr - min_lr) * 0.5 * (1 + np.cos(np.pi * (t - warmup) / (steps - warmup)))
        want = np.where(t < warmup, warm, cosine)
        got = np.asarray(optim.lr_schedule(cfg)(jnp.arange(steps + 1)), np.float64)
        assert judgment.compare_series("lr", t, got, want, bounds.FP32["lr"]).passed, (lr, min_lr, steps)
        if relative_fails:
            assert not judgment.compare_series("lr", t, got, want, Bound(0.0, 1e-6, "relative")).passed


def _metrics(n: int, evals=()) -> list[dict]:
    """n identical train lines, and eval lines at the steps `evals`."""
    train = [{"step": s, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100 * s} for s in range(1, n + 1)]
    return train + [{"step": s, "eval_loss": 3.0, "eval_accuracy": 0.5} for s in evals]


@pytest.mark.parametrize("a_evals, b_evals, steps, first_bad, missing", [
    ((2, 4), (4,), None, 2, "[2]"),  # one run skipped an eval: its other columns equal, the eval rows compared at 4
    ((2, 4), (), None, 2, "[2, 4]"),  # one run never evaluated: before, no eval pair at all passed unsaid
    ((), (3,), None, 3, "[3]"),
    ((2, 4), (2, 4), None, None, ""),
    ((2, 4), (4,), range(3, 5), None, ""),  # `steps` 3..4: the eval at 2 lies outside what is compared
])
def test_an_eval_step_logged_by_one_run_only_fails_the_eval_step_row(a_evals, b_evals, steps, first_bad, missing):
    rows = judgment.compare_metrics(_metrics(4, a_evals), _metrics(4, b_evals), bounds.FP32, steps=steps)
    by = {r.component: r for r in rows}
    assert by["eval step"].first_bad == first_bad and by["step"].passed
    assert judgment.failures(rows) == (f"eval steps logged by one run only: {missing}" if missing else "")
    assert all(by[c].passed for c in ("eval_loss", "eval_accuracy", "loss"))  # the values themselves agree
    no_eval_columns = {k: v for k, v in bounds.FP32.items() if not k.startswith("eval_")}
    assert "eval step" not in [r.component for r in judgment.compare_metrics(
        _metrics(4, a_evals), _metrics(4, b_evals), no_eval_columns)]  # judged only where eval columns are


@pytest.mark.parametrize("num, den, want", [(0.0, 0.0, 0.0), (1e-6, 0.0, math.inf), (1.0, 4.0, 0.25),
                                            (math.nan, 1.0, math.nan)])
def test_a_ratio_of_gaps_takes_a_zero_reference_gap(num, den, want):
    """0 / 0: neither moved, no gap to exceed; x / 0: a gap where the reference has none, out of any bound."""
    row = judgment.gap_ratio_row("loss", "bf16", num, den, bounds.BF16_GAP_RATIO)
    if math.isnan(want):
        assert math.isnan(judgment.ratio(num, den)) and row.passed is False
    else:
        assert judgment.ratio(num, den) == row.max_abs == want and row.passed == (want <= 3.0)


def _loss(jax_gap: float) -> dict[str, np.ndarray]:
    """torchref's bf16 1e-3 from its fp32 run at every step; jaxtrain's bf16 at `jax_gap` from its own fp32 run, which
    equals torchref's; the two bf16 runs 1e-3 - jax_gap apart (per step, hence in the mean)."""
    fp32 = np.array([2.0, 1.9, 1.8])
    return {"torchref": fp32 + 1e-3, "torchref fp32": fp32, "jaxtrain": fp32 + jax_gap, "jaxtrain fp32": fp32}


@pytest.mark.parametrize("jax_gap, passed, own_ratio", [
    (1e-3, True, 1.0),  # the same own gap
    (0.5e-3, True, 0.5),  # half of torchref's: within 3x either way
    (0.0, False, 0.0),  # jaxtrain in fp32 when asked for bf16: the cross gap is 1x torchref's own, which passed alone
    (0.2e-3, False, 0.2),  # below a third
    (3.5e-3, False, 3.5),  # above 3x (its cross gap, 2.5x torchref's own, passes the first rule)
])
def test_jaxtrains_own_low_precision_gap_must_be_comparable_to_torchrefs(jax_gap, passed, own_ratio):
    cross, mine = judgment.gap_rows("bf16", _loss(jax_gap), bounds.BF16_GAP_RATIO, bounds.OWN_GAP_RATIO)
    assert cross.passed and cross.max_abs == pytest.approx(abs(1e-3 - jax_gap) / 1e-3, rel=1e-9)
    assert mine.passed == passed and mine.max_abs == pytest.approx(own_ratio, rel=1e-9, abs=1e-12)
    assert judgment.bound_text(mine) == "0.333 to 3"
    if not passed:
        assert f"mean |dloss| {jax_gap:.3g} (jaxtrain) vs 0.001 (torchref)" in mine.detail, mine.detail


def test_adam_moves_a_coordinate_at_most_adam_step_max_times_lr():
    """bounds.params_bound's derivation, against torch's AdamW (fp64, no decay, eps 1e-8, jaxtrain's betas): a
    gradient growing by b2 / b1 a step is Cauchy-Schwarz's equality case, whose step |dp| / lr rises to
    ADAM_STEP_MAX = 1.165 (where "<= ~1" was claimed); 200 random gradient sequences, signs and scales drawn,
    never exceed it."""
    import torch

    def steps(gradients) -> np.ndarray:
        p = torch.nn.Parameter(torch.zeros(len(gradients[0]), dtype=torch.float64))
        opt = torch.optim.AdamW([p], lr=1.0, betas=(bounds._B1, bounds._B2), eps=1e-8, weight_decay=0.0)
        moves = []
        for g in gradients:
            before = p.detach().clone()
            p.grad = torch.as_tensor(g, dtype=torch.float64)
            opt.step()
            moves.append((p.detach() - before).abs().numpy())
        return np.array(moves)

    growing = steps([[(bounds._B2 / bounds._B1) ** t] for t in range(400)])[:, 0]
    assert growing[0] == pytest.approx(1.0, rel=1e-6) and growing.max() > 1.16, growing.max()
    rng = np.random.default_rng(0)
    drawn = steps(rng.standard_normal((300, 200)) * np.exp(rng.uniform(-3, 3, (300, 1))))
    assert max(growing.max(), drawn.max()) <= bounds.ADAM_STEP_MAX * (1 + 1e-12)  # fp64 rounding of the step
