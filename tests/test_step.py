"""The train step: token-weighted loss, accumulation through MultiSteps, and the metrics it returns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import compiled_hlo
import jaxpr_walk
from design_formulas import TOP1_HITS, TOP1_LOGITS, TOP1_TARGETS, default_lr_at
from jaxtrain import autocast, config, model, optim, step

VOCAB, SEQ, BATCH = 64, 16, 8


def config_of(accum: int, *overrides):
    return config.load([f"--optim.grad_accum_steps={accum}", f"--data.batch_size={BATCH}", "--model.n_layer=2",
                        "--model.d_model=32", "--model.n_head=2", f"--model.seq_len={SEQ}", "--train.precision=fp32",
                        "--optim.warmup_steps=2", "--train.steps=10", *overrides])


def make(accum: int, *overrides):
    cfg = config_of(accum, *overrides)
    graphdef, params = model.init_params(cfg.model, vocab_size=VOCAB, precision="fp32", seed=0)
    tx = optim.optimizer(cfg)
    train_step = jax.jit(step.make_train_step(graphdef, tx, optim.lr_schedule(cfg), seed=0, dropout=False))
    return cfg, graphdef, step.init_state(params, tx), train_step


def batch_with_padding():
    """8 sequences whose valid-target counts differ a lot between the four micro-batches of 2."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)
    targets = rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)
    for row, n_valid in enumerate([16, 16, 8, 8, 2, 1, 12, 4]):
        targets[row, n_valid:] = -1
    return inputs, targets


def test_ce_sum_ignores_negative_targets():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 5)), jnp.float32)
    targets = jnp.array([[0, -1, 4], [-1, -1, 2]])
    total, n = step.ce_sum(logits, targets)
    log_probs = jax.nn.log_softmax(logits)
    expected = -(log_probs[0, 0, 0] + log_probs[0, 2, 4] + log_probs[1, 2, 2])
    assert int(n) == 3
    assert float(total) == pytest.approx(float(expected), rel=1e-6)  # fp32: a few roundings of O(1) terms


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_correct_sum_counts_top1_hits_with_ties_to_the_lowest_index(dtype):
    hits = step.correct_sum(jnp.asarray(TOP1_LOGITS, dtype), jnp.asarray(TOP1_TARGETS, jnp.int32))
    assert int(hits) == TOP1_HITS


def window_of(inputs, targets, accum):
    return inputs.reshape(accum, BATCH // accum, SEQ), targets.reshape(accum, BATCH // accum, SEQ)


def test_accumulation_equals_one_big_batch():
    """k=4 micro-batches with unequal padding give the gradient of the whole batch: AdamW's first moment after
    one unclipped step is (1 - b1) * g, so comparing mu compares the accumulated gradients."""
    inputs, targets = batch_with_padding()
    results = {}
    for accum in (1, 4):
        cfg, _, state, train_step = make(accum, "--optim.max_grad_norm=0")
        state, metrics = train_step(state, *window_of(inputs, targets, accum))
        results[accum] = (optim.adam_state(state.opt_state).mu, metrics, int(state.step))
    (mu1, m1, step1), (mu4, m4, step4) = results[1], results[4]
    assert step1 == step4 == 1  # the schedule advanced once for the 4 micro-batches
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(mu1))  # numpy: jnp compiled per leaf
    # fp32: sums of ~100 terms in another order differ by a few ulps of the largest entry (2^-24 ~ 6e-8).
    for a, b in zip(jax.tree.leaves(mu1), jax.tree.leaves(mu4)):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)
    # Both measured equal here (jax 0.10.2); the bounds allow the sums' other order: the loss, an fp32 sum, a few
    # ulps (2^-24 each) of the whole; the gradient norm, the gradients' own 1e-5 of the largest entry (mu's, above).
    assert float(m4["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
    assert float(m4["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-5)
    assert int(m4["tokens"]) == int((targets >= 0).sum())


def test_window_leaves_multisteps_as_feeding_it_one_micro_batch_at_a_time():
    """optim.add_to_window / apply_window against optax's own protocol: MultiSteps.update called once per
    micro-batch, the params taking the k-th call's update. Two windows of k=4 (clipping on, so every part of the
    chain acts): params and every leaf of the optimizer state agree. fp32: the per-micro-batch gradients are the
    same dots, jitted apart, so they may differ in the last bits of their sums (2^-24 relative per sum); so may
    the chain's ops, MultiSteps.update jitted here once (op by op, each of its 8 calls took seconds)."""
    inputs, targets = batch_with_padding()
    cfg, graphdef, state, train_step = make(4, "--optim.max_grad_norm=0.05")
    update = jax.jit(optim.optimizer(cfg).update)
    n_window = jnp.sum(targets >= 0)
    micro_grad = jax.jit(jax.grad(lambda p, x, y: step.model_ce_sum(graphdef, p, x, y) / n_window))
    params, opt_state = state.params, state.opt_state
    for _ in range(2):
        state, metrics = train_step(state, *window_of(inputs, targets, 4))
        for x, y in zip(*window_of(inputs, targets, 4)):
            updates, opt_state = update(micro_grad(params, x, y), opt_state, params)
        params = optax.apply_updates(params, updates)
    assert float(optim.grad_norm(opt_state)) > 0.05  # the clip acted
    for a, b in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves((params, opt_state))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision,bias,tied,vocab_tiles", [
    ("bf16", True, True, 1), ("fp16", True, True, 1), ("bf16", False, False, 2), ("fp32", True, True, 1)])
def test_the_compute_dtype_copies_give_the_fp32_params_gradients(precision, bias, tied, vocab_tiles):
    """step.compute_dtype_params: each Linear's kernel and bias (an untied head's too) in the compute dtype (fp32
    under fp32), the LayerNorms' params and the embeddings (wte's lookup reads it in fp32, as torch's embedding) left
    fp32, the params given left as they were; and the gradient of the loss with respect to the copies, cast up, is
    the fp32 params' own bit for bit (autocast rounds a weight's gradient to the compute dtype either way), as
    jitted alike: from the logits, and a tile of the vocabulary at a time (loss.tiled_ce_sum's own backward)."""
    cfg = config_of(1, f"--model.bias={bias}", f"--model.tie_embeddings={tied}").model
    graphdef, params = model.init_params(cfg, vocab_size=VOCAB, precision=precision, seed=0)
    copies = step.compute_dtype_params(graphdef, params)  # not jitted: a param changed in place would show
    low = autocast.COMPUTE_DTYPES[precision]
    for (path, p), (copy_path, c) in zip(nnx.to_flat_state(params), nnx.to_flat_state(copies), strict=True):
        linear = path[-2] in ("c_attn", "c_proj", "c_fc", "lm_head")
        assert path == copy_path and p[...].dtype == jnp.float32 and c[...].dtype == (low if linear else jnp.float32)
    inputs, targets = batch_with_padding()
    ce = lambda p: step.model_ce_sum(graphdef, p, inputs, targets, vocab_tiles=vocab_tiles)
    grad = jax.jit(jax.grad(ce), compiler_options=autocast.rounding_options(jax.default_backend(), precision))
    got, want = nnx.to_flat_state(grad(copies)), nnx.to_flat_state(grad(params))
    for (path, g), (want_path, w) in zip(got, want, strict=True):
        assert path == want_path
        np.testing.assert_array_equal(np.asarray(g[...].astype(jnp.float32)), np.asarray(w[...]), err_msg=str(path))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_weights_compute_dtype_copies_are_made_once_a_window(precision):
    """step.compute_dtype_params before the scan over the micro-batches: each Linear's weight is cast to the compute
    dtype once outside it, and inside it only its gradient is (autocast.rounded_weight_grad), not the weight again
    (XLA:GPU does not hoist such a cast out of the loop: each micro-batch would cast every weight again). Casts are
    told by their operands' shapes: the kernels' (32, 96), (32, 32), (32, 128) and (128, 32), which no other array
    of this model has (wte is (64, 32), activations 3-D)."""
    cfg = config_of(2, f"--train.precision={precision}")
    graphdef, params = model.init_params(cfg.model, vocab_size=VOCAB, precision=precision, seed=0)
    tx = optim.optimizer(cfg)
    train_step = step.make_train_step(graphdef, tx, optim.lr_schedule(cfg), seed=0, dropout=False)
    state = step.init_state(params, tx)
    weights = {tuple(p.shape) for path, p in nnx.to_flat_state(params) if path[-1] == "kernel"}
    low = autocast.COMPUTE_DTYPES[precision]

    def weight_casts(eqns):
        return [e for e in eqns if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == low
                and e.invars[0].aval.dtype == jnp.float32 and tuple(e.invars[0].aval.shape) in weights]
    eqns = jaxpr_walk.equations(train_step, state, *window_of(*batch_with_padding(), 2))
    (scan,) = [e for e in eqns if e.primitive.name == "scan"]
    inside = len(weight_casts(jaxpr_walk.inner_equations(scan.params["jaxpr"].jaxpr)))
    linears = 4 * cfg.model.n_layer  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    assert (len(weight_casts(eqns)) - inside, inside) == (linears, linears)


def test_adamw_runs_once_per_window():
    """MultiSteps.update runs the inner chain at every micro-step and keeps its result at the k-th only; the step
    applies the window's sum once (optim.apply_window). So no sqrt (Adam's sqrt(v_hat), the clip's norm) runs in
    the compiled step's loop over micro-batches (the model's LayerNorms use rsqrt), and outside it, sqrts are there."""
    inputs, targets = batch_with_padding()
    _, _, state, train_step = make(4)
    hlo = train_step.lower(state, *window_of(inputs, targets, 4)).compile().as_text()
    sqrts = [looped for op, looped, _ in compiled_hlo.instructions(hlo) if op == "sqrt"]
    assert sqrts and not any(sqrts), sqrts


def test_mean_of_micro_means_would_differ():
    """The padding above is uneven enough that the naive per-micro-batch mean (the 2024 HF bug) is far outside
    the tolerance the equivalence test uses: that test can fail."""
    inputs, targets = batch_with_padding()
    cfg, graphdef, state, _ = make(1)

    @jax.jit  # op by op, the forward pass took seconds
    def token_ce(params):
        logits = model.apply(graphdef, params, jnp.asarray(inputs))
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0)) * (targets >= 0)
    ce = np.asarray(token_ce(state.params))
    token_mean = float(ce.sum() / (targets >= 0).sum())
    micro_means = [float(ce[i:i + 2].sum() / (targets[i:i + 2] >= 0).sum()) for i in range(0, BATCH, 2)]
    # measured 0.035, 8,000x the loss tolerance of the equivalence test above (rel 1e-6 of a loss of 4.2)
    assert abs(np.mean(micro_means) - token_mean) > 1e-3


def test_metrics_report_the_applied_lr_and_unclipped_norm():
    inputs, targets = batch_with_padding()
    cfg, _, state, train_step = make(2, "--optim.max_grad_norm=1e-3")
    for t in range(3):
        state, metrics = train_step(state, *window_of(inputs, targets, 2))
        # make()'s lr 1e-3 (the default), warmup 2, decay over train.steps 10: DESIGN.md's formula; fp32 ulps
        assert float(metrics["lr"]) == pytest.approx(default_lr_at(t, 1e-3, 1e-4, 2, 10), rel=1e-6)
        assert float(metrics["grad_norm"]) > 1e-3  # before clipping: far above the clip threshold
    assert int(state.step) == 3 and int(optim.adam_state(state.opt_state).count) == 3


def test_skip_leaves_the_update_out_and_moves_the_data_on():
    """nan_policy=skip: a window with a NaN (here a poisoned param, so the loss and gradient are NaN) leaves
    params and the optimizer state as they were, bit for bit, but counts as trained; finite windows train exactly
    as without the guard."""
    inputs, targets = batch_with_padding()
    cfg, graphdef, state, plain_step = make(2)
    skip_step = jax.jit(step.make_train_step(graphdef, optim.optimizer(cfg), optim.lr_schedule(cfg), seed=0,
                                             dropout=False, skip_non_finite=True))
    window = window_of(inputs, targets, 2)
    guarded, _ = skip_step(state, *window)
    unguarded, _ = plain_step(state, *window)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(guarded), jax.tree.leaves(unguarded)))

    leaves, treedef = jax.tree.flatten(guarded.params)  # every param takes part in every logit
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    poisoned = guarded._replace(params=jax.tree.unflatten(treedef, leaves))
    after, metrics = skip_step(poisoned, *window)
    assert np.isnan(float(metrics["loss"])) and int(metrics["skipped"]) == 1
    assert int(after.step) == 2 and int(optim.adam_state(after.opt_state).count) == 1
    before_leaves = jax.tree.leaves((poisoned.params, poisoned.opt_state.inner_opt_state))
    after_leaves = jax.tree.leaves((after.params, after.opt_state.inner_opt_state))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before_leaves, after_leaves))
    assert all(not np.any(x) for x in jax.tree.leaves(after.opt_state.acc_grads))  # nothing left accumulated
    # The next window's update applies LR(1), the position of the updates applied (1), not of the windows trained
    # (2: LR(2) = 1e-3, the warmup's end). fp32's warmup line against the float64 formula: a few ulps, rel=1e-6.
    next_lr = float(skip_step(after, *window)[1]["lr"])
    assert next_lr == pytest.approx(default_lr_at(1, 1e-3, 1e-4, 2, 10), rel=1e-6)


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_the_eval_step_runs_under_remat_and_sums_what_it_sums_without(remat):
    """model.remat under the eval step's scan, which closes over the params: nnx.remat wrote them back across trace
    levels, and flax refused it (TraceContextError) at a run's first evaluation, before that step's save. A forward
    pass alone computes the same ops either way: the same sums, bit for bit."""
    inputs, targets = batch_with_padding()
    window = window_of(inputs, targets, 4)
    sums = {}
    for policy in ("none", remat):
        cfg, graphdef, state, _ = make(4, f"--model.remat={policy}")
        sums[policy] = [np.asarray(x) for x in jax.jit(step.make_eval_step(graphdef))(state.params, *window)]
    assert sums[remat][2] == int((targets >= 0).sum())  # every valid token counted
    for got, want in zip(sums[remat], sums["none"]):
        np.testing.assert_array_equal(got, want)


def test_the_gpu_step_drops_xlas_sol_latency_estimator_under_data_parallelism_only(monkeypatch):
    """XLA's analytical ("SoL") latency estimator kept gradients alive across layers to overlap the all-reduces
    (gpt-1b over 16 H100 data-parallel: 39.72 against 32.12 GiB a device, benchmarks/NOTES.md): off for a GPU step
    with mesh.fsdp=1; left to XLA under fsdp > 1, off a GPU, and where the user's XLA_FLAGS set it. This fp32 model
    has no cuDNN attention, so XLA's dot merger stays (the next test)."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cfg = make(1, "--model.cpu_dots=xla")[0]  # oneDNN's CPU dots: tests/test_cpu_dots.py
    fsdp = config.load(["--mesh.fsdp=2", "--data.batch_size=8", "--train.precision=fp32"])
    assert step.compiler_options(cfg) == {}  # this CPU
    with autocast.compiling_for("gpu"):
        assert step.compiler_options(cfg) == {"xla_gpu_enable_analytical_sol_latency_estimator": False}
        assert step.compiler_options(fsdp) == {}
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_analytical_sol_latency_estimator=true")
        assert step.compiler_options(cfg) == {}


def test_the_gpu_step_keeps_xlas_dot_merger_off_the_qkv_gemms_where_attention_is_cudnns(monkeypatch):
    """Where attention is cuDNN's kernel and the weights are whole, q, k and v are three gemms
    (model.Linear.column_blocks), which XLA's dot merger would merge back into one and slice: the GPU step compiles
    with its threshold 0; not for the written-out attention, not under fsdp > 1, and never over the user's
    XLA_FLAGS."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    bf16 = make(1, "--train.precision=bf16", "--model.cpu_dots=xla")[0]  # oneDNN's CPU dots: tests/test_cpu_dots.py
    dropout = make(1, "--train.precision=bf16", "--model.dropout=0.1")[0]
    fsdp = config.load(["--mesh.fsdp=2", "--data.batch_size=8", "--train.precision=bf16"])
    sol = {"xla_gpu_enable_analytical_sol_latency_estimator": False, "xla_allow_excess_precision": False}
    assert step.compiler_options(bf16) == {}  # this CPU
    with autocast.compiling_for("gpu"):
        assert step.compiler_options(bf16) == {**sol, "xla_gpu_dot_merger_threshold_mb": 0}
        assert step.compiler_options(dropout) == sol  # cuDNN's kernel has no dropout: attention written out
        # ...unless model.qkv_grad=pallas's kernel is the backward of three gemms there
        qkv = config.load(["--train.precision=bf16", "--model.dropout=0.1", "--model.qkv_grad=pallas",
                           "--model.d_model=128"])
        assert step.compiler_options(qkv) == {**sol, "xla_gpu_dot_merger_threshold_mb": 0}
        assert step.compiler_options(fsdp) == {"xla_allow_excess_precision": False}
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_dot_merger_threshold_mb=32")
        assert step.compiler_options(bf16) == sol


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_a_low_precision_gpu_step_keeps_every_rounding_it_writes(precision, monkeypatch):
    """XLA:GPU's default may drop a bf16 or fp16 rounding that an fp32 consumer follows, where torch's autocast
    keeps each: a bf16 or fp16 step compiles for a GPU with xla_allow_excess_precision=false, under any mesh; not
    an fp32 one (nothing to round), not off a GPU on XLA's default dots (XLA:CPU kept them; its oneDNN dots:
    tests/test_cpu_dots.py), and never over the user's XLA_FLAGS."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cfgs = [config.load([f"--train.precision={precision}", f"--mesh.fsdp={n}", "--data.batch_size=8",
                         "--model.cpu_dots=xla"]) for n in (1, 2)]
    kept = precision != "fp32"
    assert all("xla_allow_excess_precision" not in step.compiler_options(cfg) for cfg in cfgs)  # this CPU
    with autocast.compiling_for("gpu"):
        assert [step.compiler_options(cfg).get("xla_allow_excess_precision") for cfg in cfgs] == [
            False if kept else None] * 2
        monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=true")
        assert all("xla_allow_excess_precision" not in step.compiler_options(cfg) for cfg in cfgs)


def test_the_train_and_eval_steps_both_compile_with_the_steps_compiler_options(monkeypatch):
    """The eval step is the train step's forward pass: it compiles under the same XLA options (on a GPU, the dot
    merger off the q, k and v gemms). An option XLA does not know, put in their place, fails both compiles by name."""
    cfg, _, state, _ = make(4)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
    window = window_of(*batch_with_padding(), 4)
    monkeypatch.setattr(step, "compiler_options", lambda _: {"xla_no_such_option": True})
    for jitted, args in ((step.jit_train_step(cfg, seed=0), (state, *window)),
                         (step.jit_eval_step(cfg), (state.params, *window))):
        with pytest.raises(Exception, match="xla_no_such_option"):
            jitted.lower(*args).compile()
