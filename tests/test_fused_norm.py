"""jaxtrain.fused_norm: the residual add and LayerNorm kernels, run here through Pallas's interpreter (no GPU), against
float64 formulas and XLA's autodiff of the same math; the model with model.norm=pallas against model.norm=xla, on
one device and on a (data 2, fsdp 2) mesh; and where the kernels are picked."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxtrain import autocast, config, fused_norm, kernel_choice, layer_norm, model

EPS32 = 2.0 ** -24  # fp32's unit roundoff


def _ulp_bf16(values):
    """bf16's spacing at each value (float64 array): 2^(exponent - 7)."""
    return 2.0 ** (np.floor(np.log2(np.abs(values) + 1e-30)) - 7)


def _xla_residual_norm(x, delta, w, b, low, pad):
    """The same op as XLA's ops, the model's LayerNorm math: what the kernels must reproduce. A bf16 x (the stream
    under model.residual_dtype=bf16) is added to in bf16, rounded, and upcast for the LayerNorm, as the model's
    XLA path does."""
    x = x if delta is None else x + delta.astype(x.dtype)
    x_sum, x = x, x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + layer_norm.LN_EPS) * w
    h = h if b is None else h + b
    return x_sum, autocast.with_ones_column(h, low, pad) if pad else h.astype(low)


def _inputs(n=64, d=96, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(2, n // 2, d)) * 3 + 1, jnp.float32),
            jnp.asarray(rng.normal(size=(2, n // 2, d)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=(d,)) + 1, jnp.float32), jnp.asarray(rng.normal(size=(d,)), jnp.float32))


@pytest.mark.parametrize("d", [1, 5, 64, 96, 768, 1000])
def test_pieces_cover_the_columns_in_powers_of_two(d):
    pieces = fused_norm.pieces(d)
    assert [i for p in pieces for i in range(p.start, p.stop)] == list(range(d))
    assert all((p.stop - p.start) & (p.stop - p.start - 1) == 0 for p in pieces)  # each a power of two


@pytest.mark.parametrize("n,rows", [(32768, 16), (48, 16), (24, 8), (12, 4), (6, 2), (1, 1)])
def test_an_instance_takes_the_most_rows_that_divide_the_rows(monkeypatch, n, rows):
    monkeypatch.setattr(fused_norm, "MAX_ROWS", 16)
    assert fused_norm._rows(n) == rows


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("pad", [0, autocast.BIAS_ROW_PAD, 64])  # none; the bias row's; gelu_gemm's forward kernel's
def test_forward_is_the_float64_formula_rounded_once(with_delta, with_bias, pad):
    x, delta, w, b = _inputs()
    delta, b = delta if with_delta else None, b if with_bias else None
    x_sum, h = fused_norm._residual_norm(x.reshape(64, 96), None if delta is None else delta.reshape(64, 96), w, b,
                                         jnp.bfloat16, pad)
    x32 = np.asarray(x).reshape(64, 96) + (0 if delta is None else np.asarray(delta, np.float32).reshape(64, 96))
    np.testing.assert_array_equal(x_sum, x32)  # the fp32 sum, rounded once (numpy's)
    x64 = x32.astype(np.float64)
    mean = x64.mean(1, keepdims=True)
    want = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(1, keepdims=True) + layer_norm.LN_EPS) * np.asarray(w)
    want = want + (0 if b is None else np.asarray(b))
    got = np.asarray(h[:, :96], np.float64)
    # The fp32 LayerNorm is within ~d * 2^-24 relative of the float64 one, far below bf16's half spacing (2^-9):
    # rounded once it is the float64 value's bf16 neighbour below or above.
    assert np.all(np.abs(got - want) <= _ulp_bf16(want))
    if pad:  # the bias row's partner, as autocast.with_ones_column writes it
        np.testing.assert_array_equal(h[:, 96:], autocast.with_ones_column(jnp.zeros((64, 0)), jnp.bfloat16, pad))
    else:
        assert h.shape == (64, 96)


@pytest.mark.parametrize("with_delta", [False, True])
def test_a_bf16_stream_is_added_rounded_then_normalized(with_delta):
    """model.residual_dtype=bf16: x + delta in fp32 rounded once to bf16 (numpy's float32 sum, rounded by
    ml_dtypes), written out, and the LayerNorm of that rounded sum: the float64 formula's bf16 neighbour."""
    x, delta, w, b = _inputs(seed=3)
    x = x.astype(jnp.bfloat16).reshape(64, 96)
    delta = delta.reshape(64, 96) if with_delta else None
    x_sum, h = fused_norm._residual_norm(x, delta, w, b, jnp.bfloat16, 0)
    x32 = np.asarray(x, np.float32) + (0 if delta is None else np.asarray(delta, np.float32))
    want_sum = x32.astype(ml_dtypes.bfloat16)
    assert x_sum.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x_sum), want_sum)
    x64 = want_sum.astype(np.float64)
    mean = x64.mean(1, keepdims=True)
    want = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(1, keepdims=True) + layer_norm.LN_EPS) * np.asarray(w)
    want = want + np.asarray(b)
    assert np.all(np.abs(np.asarray(h, np.float64) - want) <= _ulp_bf16(want))  # as the fp32 stream's test


@pytest.mark.parametrize("with_delta", [False, True])
def test_a_bf16_streams_gradient_is_torchs(with_delta):
    """The gradient of a bf16 stream as autograd sums it: the LayerNorm's input gradient rounded to bf16, added to
    the stream's own, the sum rounded; delta's the same array. Against jax.vjp of the XLA ops (the same roundings,
    the LayerNorm's fp32 sums in another order): equal, or a bf16 spacing apart where an order flips a rounding."""
    x, delta, w, b = _inputs(seed=4)
    x = x.astype(jnp.bfloat16)
    delta = delta if with_delta else None
    rng = np.random.default_rng(5)
    cotangents = (jnp.asarray(rng.normal(size=x.shape) * 0.1, jnp.bfloat16),
                  jnp.asarray(rng.normal(size=x.shape), jnp.bfloat16))
    rows = lambda t: None if t is None else t.reshape(64, 96)
    got = jax.vjp(lambda x, delta: fused_norm._residual_norm(rows(x), rows(delta), w, b, jnp.bfloat16, 0),
                  x, delta)[1]((cotangents[0].reshape(64, 96), cotangents[1].reshape(64, 96)))
    want = jax.jit(lambda *c: jax.vjp(lambda x, delta: _xla_residual_norm(x, delta, w, b, jnp.bfloat16, 0),
                                      x, delta)[1](c), compiler_options={"xla_allow_excess_precision": False})(
        *cotangents)
    g, r = np.asarray(got[0], np.float64).reshape(x.shape), np.asarray(want[0], np.float64)
    assert got[0].dtype == jnp.bfloat16
    # measured 1.0 and 0.9998 (a flipped rounding); with one rounding for the sum of the two, not two: 0.71
    assert np.all(np.abs(g - r) <= _ulp_bf16(r)) and np.mean(g == r) > 0.99
    if with_delta:
        np.testing.assert_array_equal(got[1], got[0])


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("low,pad", [(jnp.bfloat16, autocast.BIAS_ROW_PAD), (jnp.bfloat16, 64), (jnp.float32, 0)])
def test_gradients_are_xla_autodiffs(with_delta, low, pad):
    """Each gradient against jax.vjp of the XLA ops: the same formulas, fp32 sums in another order; the output's
    ones columns (8 for a bias row, 64 for gelu_gemm's forward kernel) take a gradient that goes nowhere."""
    x, delta, w, b = _inputs(seed=1)
    delta = delta if with_delta else None
    rng = np.random.default_rng(2)
    cotangents = (jnp.asarray(rng.normal(size=x.shape), jnp.float32),
                  jnp.asarray(rng.normal(size=x.shape[:-1] + (96 + pad,)), low))
    rows = lambda t: None if t is None else t.reshape(64, 96)
    got = jax.vjp(lambda x, delta, w, b: fused_norm._residual_norm(rows(x), rows(delta), w, b, low, pad),
                  x, delta, w, b)[1]((cotangents[0].reshape(64, 96), cotangents[1].reshape(64, -1)))
    want = jax.vjp(lambda *a: _xla_residual_norm(*a, low, pad), x, delta, w, b)[1](cotangents)
    assert (got[1] is None) == (delta is None)
    for name, g, r, terms in [("x", got[0], want[0], 96), ("w", got[2], want[2], 64), ("b", got[3], want[3], 64)]:
        # fp32 sums of `terms` products in another order: each differs by at most terms * 2^-24 of the sum of
        # magnitudes, bounded here by terms * 2^-24 * terms * max |term| (max |term| <= 4 * max |result|).
        bound = terms * EPS32 * terms * 4 * float(jnp.abs(r).max())
        assert float(jnp.abs(g.reshape(r.shape) - r).max()) <= bound, name
    if delta is not None:  # the fp32 gradient rounded to bf16 once: the neighbour of XLA's below or above
        r = np.asarray(want[1], np.float64)
        assert got[1].dtype == jnp.bfloat16
        assert np.all(np.abs(np.asarray(got[1], np.float64).reshape(r.shape) - r) <= _ulp_bf16(r))


def _loss_and_grads(norm: str, precision: str, stream: str = "fp32"):
    cfg = config.load(["--config", "configs/tiny.yaml", "--model.n_layer=2", f"--model.norm={norm}",
                       f"--model.residual_dtype={stream}"]).model
    graphdef, params = model.init_params(cfg, vocab_size=64, precision=precision, seed=0)
    idx = jax.random.randint(jax.random.key(0), (4, 32), 0, 64)

    def loss(params):
        logits = model.apply(graphdef, params, idx).astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    # Both compiled without excess precision, rounding where torch's autocast does. By default XLA:GPU drops a bf16
    # rounding that an fp32 consumer follows (on an H100, jax 0.11.2: c + bf16(a @ b) equalled the rounded value at 5
    # of 32768 elements, XLA:CPU at 32767), and drops different ones on either side: compiled for an H100 (jax 0.10.2,
    # ahead of time), this model keeps 18 more bf16 roundings without excess precision on XLA's side (1 in the
    # forward), 22 on the kernels' (5). The two losses were 1.9e-5 relative apart there (measured), 170x this test's
    # CPU measurement.
    return jax.jit(jax.value_and_grad(loss), compiler_options={"xla_allow_excess_precision": False})(params)


@pytest.mark.parametrize("precision,stream", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_the_model_with_the_kernels_is_the_model_without(precision, stream):
    (loss, grads), (ref_loss, ref_grads) = (_loss_and_grads(norm, precision, stream) for norm in ("pallas", "xla"))
    # Relative differences of the loss and of each gradient. fp32: only sum orders differ (measured 0 and 2.3e-7,
    # margin 40x+); bf16: a sum order may flip a bf16 rounding of an activation (measured on this CPU 0 and 9.5e-4,
    # the loss's 1e-5 sized on 1.1e-7 measured before the compile option; gradients margin 15x); a bf16 stream: a
    # flipped rounding of the stream itself carries into every later layer (measured 6.1e-6 and 1.8e-3, margin 8x).
    tol = {"fp32": (1e-6, 1e-5), "bf16": (1e-5, 1.5e-2)}[precision] if stream == "fp32" else (5e-5, 1.5e-2)
    assert abs(float(loss - ref_loss)) <= tol[0] * abs(float(ref_loss))
    for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        assert float(jnp.linalg.norm(g[...] - r[...]) / jnp.linalg.norm(r[...])) <= tol[1], path


@pytest.mark.parametrize("platform,norm,fused", [("gpu", "auto", True), ("cpu", "auto", False), ("tpu", "auto", False),
                                                 ("gpu", "xla", False), ("cpu", "pallas", True)])
def test_auto_picks_the_kernels_on_a_gpu(platform, norm, fused):
    cfg = config.load(["--config", "configs/tiny.yaml", f"--model.norm={norm}"]).model
    with autocast.compiling_for(platform):
        assert kernel_choice.norm_kernels(cfg) == fused


MESH_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxtrain import config, mesh as mesh_lib, model
precision, stream = sys.argv[1:]
results = []
for norm in ("pallas", "xla"):
    cfg = config.load(["--config", "configs/tiny.yaml", "--model.n_layer=2", "--mesh.fsdp=2", f"--model.norm={norm}",
                       f"--model.residual_dtype={stream}"])
    graphdef, params = model.init_params(cfg.model, vocab_size=64, precision=precision, seed=0)
    idx = jax.random.randint(jax.random.key(0), (4, 32), 0, 64)
    device_mesh = mesh_lib.make_mesh(cfg)
    with jax.set_mesh(device_mesh):
        idx = jax.device_put(idx, jax.sharding.NamedSharding(device_mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
        loss = lambda p: -jnp.mean(jax.nn.log_softmax(model.apply(graphdef, p, idx))[..., 0])
        fn = jax.jit(jax.value_and_grad(loss), compiler_options={"xla_allow_excess_precision": False})
        if norm == "pallas":  # the kernels, inside a per-device (manual) computation
            assert "pallas_call" in str(jax.make_jaxpr(loss)(params))
            assert "manual_computation" in fn.lower(params).as_text()
        results.append(fn(params))
(loss, grads), (ref_loss, ref_grads) = results
print(abs(float(loss - ref_loss)) / abs(float(ref_loss)))
print(max(float(jnp.linalg.norm(g[...] - r[...]) / jnp.linalg.norm(r[...]))
          for (_, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads))))
"""


@pytest.mark.parametrize("precision,stream,tol", [("fp32", "fp32", (1e-6, 1e-5)), ("bf16", "bf16", (5e-5, 1.5e-2))])
def test_the_kernels_run_on_each_devices_rows_under_a_mesh(precision, stream, tol):
    """On 4 devices (data 2, fsdp 2) each device's rows go through the kernels (shard_map) and the weights'
    gradients are summed over the devices: the same loss and gradients as XLA's ops, within the one-device test's
    bounds (fp32: sum orders only, measured 0 and 2.0e-7; a bf16 stream, whose backward writes one gradient for x
    and delta: measured 0 and 1.8e-3)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, precision, stream], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss_rel, grad_rel = (float(v) for v in proc.stdout.split())
    assert loss_rel <= tol[0] and grad_rel <= tol[1]


WITHOUT_TRITON = """
import sys
class NoTriton:  # a jax whose Pallas has no Triton backend (deprecated in jax 0.11.0, to be removed)
    def find_spec(self, name, path=None, target=None):
        if name == "jax.experimental.pallas.triton":
            raise ImportError("no Pallas Triton backend in this jax")
sys.meta_path.insert(0, NoTriton())
from jaxtrain import autocast, config, errors, kernel_choice, model  # model: imports without Triton too
cfg = lambda norm: config.load(["--config", "configs/tiny.yaml", f"--model.norm={norm}"]).model
with autocast.compiling_for("gpu"):
    print("auto on a gpu:", kernel_choice.norm_kernels(cfg("auto")))
    try:
        kernel_choice.norm_kernels(cfg("pallas"))
    except errors.UserError as e:
        print("pallas:", e)
"""


def test_a_jax_without_pallas_triton_runs_xlas_norm_and_refuses_pallas():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "auto on a gpu: False" in proc.stdout
    assert "pallas: model.norm=pallas needs Pallas's Triton backend" in proc.stdout and "model.norm=auto" in proc.stdout
