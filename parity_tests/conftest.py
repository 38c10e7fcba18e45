"""Shared by the component parity tests: a small config, the jax <-> torch param bridge (by model.torch_names
alone), and assertions that say which component diverged first, where, and by how much.

fp64 on the jax side is always scoped, `with jax.enable_x64(True):` around the computation (jax 0.10 spells the
context manager so; jax.experimental.enable_x64 is gone), so x64 never leaks into the other tests of the process."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxtrain import config, model

U32 = 2.0 ** -24  # fp32 unit roundoff: one correctly rounded op errs by at most this, relatively
FP64_ATOL = 1e-12  # fp64 throughout: ~1e-15 per op, so 1e-12 leaves ~1,000 ops of headroom yet catches any rule change
# fp32 GPT math (forward and backward): each backend is an fp32 evaluation of the same function, off from the exact
# (fp64) result, relative to a tensor's scale (max |x|), by ~ (sequential stages, 2 (2 n_layer + 3) = 14 for two
# layers) x (a reduction over <= 128 terms, statistically sqrt(128) / 2 U32 ~ 6 U32) ~ 84 U32 = 5e-6. Two fp32
# evaluations (two backends, or two batchings) then differ by at most twice that: 1e-5.
FP32_SIDE_RTOL = 5e-6
FP32_CROSS_RTOL = 2 * FP32_SIDE_RTOL


def make_cfg(*overrides: str) -> config.Config:
    """A 2-layer, d=32, T=16, V=64 fp32 config; overrides are CLI-style (`--optim.lr=1e-3`)."""
    return config.load(["--model.n_layer=2", "--model.n_head=4", "--model.d_model=32", "--model.seq_len=16",
                        "--model.vocab_size=64", "--train.precision=fp32", "--train.steps=100",
                        "--optim.warmup_steps=10", *overrides])


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module of tiny tensors (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): on a shared
    2-core machine torch's intra-op thread pool costs far more than it saves (measured: fused fp64 AdamW 35 s vs
    0.1 s for 1,000 steps; a first GPT forward + backward 2.5 s vs 0.03 s). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- the param bridge (torch names, torch layout)

def jax_gpt(model_cfg: config.ModelConfig, precision: str = "fp32") -> tuple[nnx.GraphDef, nnx.State]:
    """jaxtrain's GPT as (graphdef, abstract params): the structure only; values come from torch's model through
    from_torch_layout, so both backends hold the same weights."""
    abstract = nnx.eval_shape(lambda: model.GPT(model_cfg, vocab_size=model_cfg.vocab_size, precision=precision,
                                                rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param)


def torch_layout(tree: nnx.State, names: dict) -> dict[str, np.ndarray]:
    """A tree shaped like the params (params, grads, mu, nu) -> {nanoGPT name: array in torch's layout}."""
    leaves = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(tree)}
    return {name: (leaves[path].T if t else leaves[path]) for name, (path, t) in names.items()}


def from_torch_layout(template: nnx.State, arrays: dict, names: dict, dtype=None) -> nnx.State:
    """`template` with every leaf replaced by arrays[name] (torch layout, transposed back), in `dtype` or the
    template's dtype."""
    by_path = {path: (name, t) for name, (path, t) in names.items()}

    def leaf(path, var):
        name, t = by_path[path]
        x = np.asarray(arrays[name])
        return var.replace(jnp.asarray(x.T if t else x, dtype or var.get_value().dtype))

    return nnx.from_flat_state([(path, leaf(path, var)) for path, var in nnx.to_flat_state(template)])


def torch_params(module) -> dict[str, np.ndarray]:
    return {n: p.detach().cpu().numpy().copy() for n, p in module.named_parameters()}


def torch_grads(module) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().cpu().numpy().copy() for n, p in module.named_parameters()}


# ---------------------------------------------------------------- diffs that say where

def stats(got, want) -> tuple[float, float]:
    """(max |got - want|, max elementwise |got - want| / |want| over want != 0)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    d = np.abs(got - want)
    rel = np.divide(d, np.abs(want), out=np.zeros_like(d), where=want != 0)
    return float(d.max(initial=0.0)), float(rel.max(initial=0.0))


def assert_close(got, want, *, atol: float = 0.0, rtol: float = 0.0, what: str) -> tuple[float, float]:
    """|got - want| <= atol + rtol * |want| elementwise; the message names the first index that breaks it
    (C order) and the max abs and rel diffs. Returns (max abs, max rel)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bound = atol + rtol * np.abs(want)
    bad = ~(np.abs(got - want) <= bound)  # NaN counts as bad
    max_abs, max_rel = stats(got, want)
    if bad.any():
        i = np.unravel_index(np.argmax(bad), got.shape) if got.ndim else ()
        raise AssertionError(
            f"{what} diverged: first at index {tuple(int(j) for j in i)}: got {got[i]:.17g}, want {want[i]:.17g}, "
            f"|diff| {abs(got[i] - want[i]):.3g} > bound {bound[i]:.3g} (atol {atol:g}, rtol {rtol:g}); "
            f"max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}")
    return max_abs, max_rel


def assert_named_close(got: dict, want: dict, *, atol: float = 0.0, rtol: float = 0.0, scale_atol: float = 0.0,
                       what: str) -> tuple[float, float]:
    """assert_close for every name of `want` (same names in `got`), in sorted order so the first failure is stable.
    scale_atol adds scale_atol * max|want[name]| to atol: fp32 rounding is relative to a tensor's scale, not to
    each element (an element that cancels to ~0 keeps the absolute error of its terms). Returns the worst
    (max abs, max rel) over all names."""
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    worst = (0.0, 0.0)
    for name in sorted(want):
        a = atol + scale_atol * float(np.abs(np.asarray(want[name], np.float64)).max(initial=0.0))
        m = assert_close(got[name], want[name], atol=a, rtol=rtol, what=f"{what} [{name}]")
        worst = (max(worst[0], m[0]), max(worst[1], m[1]))
    return worst


def assert_trajectory_close(got: dict, want: dict, bound_T, *, what: str) -> float:
    """Per-step histories {name: (T, ...)} on both sides; bound_T the allowed |diff| after each step (scalar or
    (T,)). Fails at the first step where any tensor leaves its bound, naming step (1-based: updates done),
    tensor and index. Returns the max |diff| over the run."""
    names = sorted(want)
    T = len(want[names[0]])
    bound_T = np.broadcast_to(np.asarray(bound_T, np.float64), (T,))
    diff = {n: np.abs(np.asarray(got[n], np.float64) - np.asarray(want[n], np.float64)).reshape(T, -1)
            for n in names}
    per_step = np.max([d.max(axis=1) for d in diff.values()], axis=0)  # (T,)
    bad = ~(per_step <= bound_T)
    if bad.any():
        t = int(np.argmax(bad))
        name = next(n for n in names if not diff[n][t].max() <= bound_T[t])
        i = int(np.argmax(diff[name][t]))
        raise AssertionError(
            f"{what} diverged first at step {t + 1} in {name} (flat index {i}): |diff| {diff[name][t, i]:.3g} > "
            f"bound {bound_T[t]:.3g}; max over the run {per_step.max():.3g} at step {int(per_step.argmax()) + 1}")
    return float(per_step.max())


def report(label: str, measured: float, bound: float) -> None:
    """One line per measured diff, shown with `pytest -s` (and kept in the captured output of a failure)."""
    print(f"[parity] {label}: {measured:.3g} (bound {bound:.3g}, {measured / bound:.1%} of it)")
