"""benchmarks/norm_kernels.py: its byte counts are what the kernels' pallas_calls read and write, and each setting
it rates is the one the kernels were traced with, forward and backward (jax's caches do not know the settings)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import norm_kernels
from jaxtrain import fused_norm
from jaxpr_walk import equations


def _pallas_calls(fn, *args):
    return [eqn for eqn in equations(fn, *args) if eqn.primitive.name == "pallas_call"]


def _row_bytes(eqn, n):
    """Bytes of the call's (n, ...) operands and results: the rows it reads and writes (not the (d,) weights nor
    the per-instance partial sums)."""
    avals = [v.aval for v in eqn.invars] + [v.aval for v in eqn.outvars]
    return sum(a.size * a.dtype.itemsize for a in avals if a.shape[0] == n)


def test_pass_bytes_are_the_rows_the_kernels_move():
    n, d = 64, 96
    x, delta = jnp.ones((n, d), jnp.float32), jnp.ones((n, d), jnp.bfloat16)
    w, b = jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32)
    (forward,) = _pallas_calls(norm_kernels.kernel_residual_norm, x, delta, w, b)
    _, vjp = jax.vjp(norm_kernels.kernel_residual_norm, x, delta, w, b)
    cotangents = (jnp.ones((n, d), jnp.float32), jnp.ones((n, d + 8), jnp.bfloat16))
    (backward,) = _pallas_calls(vjp, cotangents)
    assert norm_kernels.pass_bytes(n, d) == (_row_bytes(forward, n), _row_bytes(backward, n))


def test_each_setting_is_traced_in_both_passes_and_the_defaults_come_back(monkeypatch):
    grids, defaults = [], (fused_norm.MAX_ROWS, fused_norm.NUM_WARPS)
    real = fused_norm.pl.pallas_call
    monkeypatch.setattr(fused_norm.pl, "pallas_call", lambda *a, **kw: grids.append(kw["grid"]) or real(*a, **kw))
    text = norm_kernels.table(64, 96, [(4, 8), (2, 4)], iters=1)
    # 64 rows in instances of 4, then of 2: each setting's forward (jit), forward (vjp's) and backward
    assert grids == [(16,)] * 3 + [(32,)] * 3
    assert "| kernels, 4 rows, 8 warps |" in text and "| kernels, 2 rows, 4 warps |" in text and "| XLA's ops |" in text
    assert (fused_norm.MAX_ROWS, fused_norm.NUM_WARPS) == defaults


def test_off_a_gpu_the_command_says_so_and_its_small_sizes_run(capsys):
    """Off a GPU the kernels run in Pallas's interpreter: the command's first line says so, with sizes that run
    quickly, and those sizes do (the defaults, GPT-2's, ran silently past 300 s)."""
    norm_kernels.main(["--tokens", "64", "--d", "96", "--rows", "4", "--warps", "4", "--iters", "1"])
    out, err = capsys.readouterr()
    assert err == ("warning: no GPU (cpu): the kernels run in Pallas's interpreter, and 64 rows of 96 take many "
                   "minutes here; --tokens 64 --d 96 --iters 1 checks that it runs\n")
    assert "| kernels, 4 rows, 4 warps |" in out


def test_xlas_path_is_the_kernels_math():
    """The reference row computes what the kernels compute (bf16 outputs within one rounding)."""
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(64, 96)), jnp.float32), jnp.asarray(rng.normal(size=(64, 96)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=96) + 1, jnp.float32), jnp.asarray(rng.normal(size=96), jnp.float32))
    (x_ref, h_ref), (x, h) = norm_kernels.xla_residual_norm(*args), norm_kernels.kernel_residual_norm(*args)
    np.testing.assert_array_equal(x, x_ref)
    h, h_ref = np.asarray(h, np.float64), np.asarray(h_ref, np.float64)
    assert np.all(np.abs(h - h_ref) <= 2.0 ** (np.floor(np.log2(np.abs(h_ref) + 1e-30)) - 7))  # a bf16 ulp


@pytest.mark.parametrize("rows,warps", [("3", "8"), ("4,x", "8"), ("", "8"), ("0", "4")])
def test_settings_that_are_not_powers_of_two_are_refused(rows, warps):
    with pytest.raises(norm_kernels.UserError, match="powers of two"):
        norm_kernels.settings(rows, warps)
