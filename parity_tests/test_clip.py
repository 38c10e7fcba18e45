"""Component 4, global-norm clipping, fp64: optax.clip_by_global_norm inside jaxtrain's real chain vs
torch.nn.utils.clip_grad_norm_, at global norms below, inside (max - 1e-6, max), at, and above max_norm.

The two rules differ on purpose, so the test asserts the difference itself, from the closed forms:
    optax  (optax/transforms/_clipping.py): g if |g| < max else (g / |g|) * max
    torch  (torch/nn/utils/clip_grad.py):   g * clamp(max / (|g| + 1e-6), max=1.0)
torch minus jaxtrain must equal g * (coef_torch - coef_optax) to 1e-12 (fp64: each side is a norm and a scale,
a few 1.1e-16 roundings on elements <= 1). Inside (max - 1e-6, max) only torch clips; above, torch clips by a
hair less; a clip without torch's epsilon (or with it on the jax side) changes the difference by >= 1e-8, four
orders of magnitude past the tolerance.

jaxtrain's clipped gradient is read from AdamW's first moment after one step with b1 = 0: mu = 1 * g_clipped + 0,
exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxtrain import optim
from parity_tests.conftest import FP64_ATOL, U32, assert_close, make_cfg, report

MAX_NORM = 1.0
TORCH_EPS = 1e-6  # torch's clip_grad_norm_ adds it to the norm (read from its source, not configurable)
NORMS = {"below": 0.5, "inside": MAX_NORM - 0.5e-6, "at": MAX_NORM, "above": 3.0}
SHAPES = {"w": (3, 4), "b": (4,)}


def grads_with_norm(norm: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    g = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
    scale = norm / np.sqrt(sum(np.sum(x ** 2) for x in g.values()))
    return {n: x * scale for n, x in g.items()}


def jaxtrain_clipped(g: dict) -> tuple[dict, float]:
    """(the gradient after jaxtrain's clip, the pre-clip norm it records), fp64."""
    cfg = make_cfg("--optim.b1=0", f"--optim.max_grad_norm={MAX_NORM}", "--optim.grad_accum_steps=1")
    tx = optim.optimizer(cfg)
    with jax.enable_x64(True):
        params = {n: jnp.zeros(s, jnp.float64) for n, s in SHAPES.items()}
        _, state = tx.update({n: jnp.asarray(x) for n, x in g.items()}, tx.init(params), params)
        mu = optim.adam_state(state).mu
        assert all(v.dtype == jnp.float64 for v in mu.values())
        return {n: np.asarray(v) for n, v in mu.items()}, float(optim.grad_norm(state))


def torch_clipped(g: dict) -> tuple[dict, float]:
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES.values()]
    for p, x in zip(params, g.values()):
        p.grad = torch.from_numpy(x.copy())
    total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    return {n: p.grad.numpy() for n, p in zip(g, params)}, float(total)


@pytest.mark.parametrize("where", list(NORMS))
def test_clip_difference_is_torchs_epsilon(where):
    g = grads_with_norm(NORMS[where])
    norm = float(np.sqrt(sum(np.sum(x ** 2) for x in g.values())))
    jg, j_norm = jaxtrain_clipped(g)
    tg, t_norm = torch_clipped(g)

    # Both report the pre-clip norm: torch in fp64, jaxtrain's record in fp32 (a logging value).
    assert t_norm == pytest.approx(norm, rel=1e-15), "torch's pre-clip norm"
    assert j_norm == pytest.approx(norm, rel=U32), "jaxtrain's recorded pre-clip norm (fp32)"

    coef_optax = 1.0 if norm < MAX_NORM else MAX_NORM / norm
    coef_torch = min(MAX_NORM / (norm + TORCH_EPS), 1.0)
    for n in SHAPES:  # each side against its own closed form, then the difference
        assert_close(jg[n], g[n] * coef_optax, atol=FP64_ATOL, what=f"jaxtrain clip ({where} max) [{n}]")
        assert_close(tg[n], g[n] * coef_torch, atol=FP64_ATOL, what=f"torch clip ({where} max) [{n}]")
    got = {n: tg[n] - jg[n] for n in SHAPES}
    want = {n: g[n] * (coef_torch - coef_optax) for n in SHAPES}
    worst = max(assert_close(got[n], want[n], atol=FP64_ATOL,
                             what=f"torch minus jaxtrain clipped gradient ({where} max) [{n}]")[0] for n in SHAPES)
    report(f"clip {where} max_norm (|g| = {norm:.7f}): |(torch - jax) - formula|", worst, FP64_ATOL)

    size = max(float(np.abs(w).max()) for w in want.values())
    if where == "below":
        assert size == 0.0  # neither clips
    else:  # the epsilon's effect is visible at this tolerance, so dropping or moving it fails the test
        assert size > 1e4 * FP64_ATOL, f"{where}: the epsilon changes the gradient by only {size:.3g}"
