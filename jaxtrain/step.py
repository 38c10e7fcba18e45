"""The jitted train and eval steps: token-weighted loss, accumulation by scan, metrics without a host sync.

One call of `train_step` is one optimizer step: it scans over the k micro-batches of the window, adding each
micro-batch's gradient to optax.MultiSteps' accumulator, then has MultiSteps apply the inner chain to the sum once
(optim.add_to_window, optim.apply_window). The loss of micro-batch i is sum(CE_i) / N, with N the valid target
tokens of the WHOLE window, so the summed gradient is exactly that of one big batch, whatever the padding of each
micro-batch.

A scan inside one jitted call rather than k calls: 1.22x faster in fp32 and 1.31x in bf16 on the tiny model with
k=4 on a 2-core CPU (`python -m benchmarks.run --config configs/tiny.yaml --optim.grad_accum_steps=4`); one
dispatch per step, and the window's token count is known inside the call. MultiSteps' state after a window is the
one that feeding it the k gradients one by one gives (tests/test_step.py).
"""

import functools
import os
import sys
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtrain import autocast
from jaxtrain import head_lse
from jaxtrain import kernel_choice
from jaxtrain import loss
from jaxtrain import model
from jaxtrain import optim
from jaxtrain.config import Config


class TrainState(NamedTuple):
    """Everything a checkpoint holds. The optimizer step is opt_state.gradient_step; dropout keys derive from
    (seed, step, micro-step), so there is no RNG state to carry."""
    params: nnx.State
    opt_state: optax.MultiStepsState

    @property
    def step(self) -> jax.Array:
        return self.opt_state.gradient_step

    @property
    def skipped(self) -> jax.Array:
        """Windows whose update was left out (train.nan_policy=skip, fp16's overflows): metrics' `skipped`."""
        return optim.skipped_updates(self.opt_state)


def ce_sum(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum of fp32 cross-entropy over valid targets (>= 0), and the number of valid targets."""
    return _sum_over_valid(lambda labels_BxT: loss.token_ce(logits_BxTxV, labels_BxT), targets_BxT)


def _sum_over_valid(token_ce, targets_BxT):
    """token_ce(labels) summed over the valid targets (>= 0; a padding target asks label 0 and counts nothing)."""
    valid_BxT = targets_BxT >= 0
    ce_BxT = token_ce(jnp.where(valid_BxT, targets_BxT, 0))
    return jnp.sum(jnp.where(valid_BxT, ce_BxT, 0.0)), jnp.sum(valid_BxT)


def model_ce_sum(graphdef: nnx.GraphDef, params: nnx.State, inputs_BxT, targets_BxT, *,
                 dropout_key: jax.Array | None = None, vocab_tiles: int = 1, lse_in_head: bool = False) -> jax.Array:
    """Sum of CE over the valid targets of the model's predictions: from its logits, or from its final hidden states
    and head weight, with `vocab_tiles` > 1 a tile of tokens at a time, never forming the logits
    (loss.tiled_ce_sum, model.vocab_tiles), with `lse_in_head` the logsumexp in the head gemm's epilogue
    (head_lse.head_token_ce, model.head_lse=pallas)."""
    if vocab_tiles == 1 and not lse_in_head:
        return ce_sum(model.apply(graphdef, params, inputs_BxT, dropout_key=dropout_key), targets_BxT)[0]
    gpt = nnx.merge(graphdef, params)
    x_BxTxD = gpt.hidden(inputs_BxT, dropout_key=dropout_key)
    if vocab_tiles > 1:
        return loss.tiled_ce_sum(x_BxTxD, gpt.head_weight(), targets_BxT, gpt.precision, vocab_tiles)
    return _sum_over_valid(lambda labels_BxT: head_lse.head_token_ce(x_BxTxD, gpt.head_weight(), labels_BxT,
                                                                     gpt.precision), targets_BxT)[0]


def correct_sum(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Number of targets that are the logits' top-1 prediction; a padding target (< 0) never is one.

    The prediction is jnp.argmax: among equal logits the lowest index (lax.argmax's reducer), the rule torch.argmax
    documents too, so both backends count a tie alike. A NaN logit counts as the largest in both; an eval with NaN
    logits has a NaN loss."""
    return jnp.sum(jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT)


def init_state(params: nnx.State, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(params, tx.init(params))


def fresh_state(cfg: Config, vocab_size: int) -> TrainState:
    """The state a run starts from: initialised params and the optimizer's initial state."""
    params = model.init_params(cfg.model, vocab_size=vocab_size, precision=cfg.train.precision, seed=cfg.run.seed)[1]
    return init_state(params, optim.optimizer(cfg))


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every float in `tree` is finite: one reduction on device, on whatever sharding the arrays have."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.array(leaves))


def non_finite_leaf(tree) -> str | None:
    """The name (its path, "/"-separated, without nnx's "value") of the first leaf of `tree` that holds inf or NaN;
    None where none does: one reduction over the tree, then one a leaf only where it found some."""
    if all_finite(tree):
        return None
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not all_finite(leaf):
            return jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
    return None


def compute_dtype_params(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.State:
    """params with every Linear's kernel and bias in its compute dtype (under fp32, as they are): the copies that
    autocast's matmuls cast at each use, made once. The gradient with respect to a copy is the fp32 param's, which
    autocast rounds to the compute dtype anyway (autocast.rounded_weight_grad), in that dtype. The train step makes
    them once a window, where each micro-batch would cast them again: XLA:GPU does not hoist a loop-invariant
    convert out of the scan's loop (benchmarks/NOTES.md). wte stays fp32: its lookup reads it so, as torch's
    embedding does (the head casts it), as do the LayerNorms' params. With one micro-batch a window the copies live
    as long as before (its backward pass keeps them for its input gradients either way)."""
    gpt = nnx.merge(graphdef, params, copy=True)  # its own Variables: params stay as they are
    for _, node in nnx.iter_graph(gpt):
        if isinstance(node, model.Linear):
            for param in (node.kernel, node.bias) if node.bias is not None else (node.kernel,):
                param.set_value(param.get_value().astype(autocast.COMPUTE_DTYPES[node.precision]))
    return nnx.state(gpt, nnx.Param)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    seed: int, dropout: bool, skip_non_finite: bool = False,
                    loss_scaling: optim.LossScaling | None = None, vocab_tiles: int = 1,
                    lse_in_head: bool = False) -> Callable:
    """train_step(state, inputs_KxBxT, targets_KxBxT) -> (state, metrics), metrics as device scalars.

    The loss and the gradient norm are checked on device: with `skip_non_finite` (train.nan_policy=skip) a window
    where either is inf or NaN leaves params and optimizer state as they were (optim.unless_finite); otherwise
    the host halts on the metrics before anything is saved (run.Divergence).

    With `loss_scaling` (train.precision=fp16), torch's GradScaler in the step: each micro-batch's loss is
    multiplied by the loss scale before the backward pass and its gradient divided by it after (exact: the scale is
    a power of 2, so this is GradScaler's unscale_ of the summed window), a window with a non-finite gradient is
    skipped as nan_policy=skip skips one, and the scale moves as GradScaler.update moves it, down to its floor.
    `vocab_tiles`, `lse_in_head`: model.vocab_tiles, model.head_lse=pallas (model_ce_sum)."""
    base_key = jax.random.key(seed)
    fp16 = loss_scaling is not None

    def micro_loss(params, inputs_BxT, targets_BxT, n_window, dropout_key, scale):
        ce = model_ce_sum(graphdef, params, inputs_BxT, targets_BxT, dropout_key=dropout_key, vocab_tiles=vocab_tiles,
                          lse_in_head=lse_in_head)
        return (ce / n_window) * scale if fp16 else ce / n_window, ce

    def train_step(state: TrainState, inputs_KxBxT, targets_KxBxT):
        n_window = jnp.maximum(jnp.sum(targets_KxBxT >= 0), 1)
        step_key = jax.random.fold_in(base_key, state.step)
        scaler = optim.loss_scale(state.opt_state) if fp16 else None

        low_params = compute_dtype_params(graphdef, state.params)  # once a window, not once a micro-batch

        def micro_step(opt_state, micro):
            i, inputs_BxT, targets_BxT = micro
            key = jax.random.fold_in(step_key, i) if dropout else None
            grads, ce = jax.grad(micro_loss, has_aux=True)(low_params, inputs_BxT, targets_BxT, n_window, key,
                                                           scaler.scale if fp16 else None)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)  # the fp32 params' gradients
            if fp16:
                grads = jax.tree.map(lambda g: g / scaler.scale, grads)
            return optim.add_to_window(opt_state, grads), ce

        k = inputs_KxBxT.shape[0]
        opt_state, ce_K = jax.lax.scan(micro_step, state.opt_state, (jnp.arange(k), inputs_KxBxT, targets_KxBxT))
        updates, opt_state = optim.apply_window(tx, opt_state, state.params, k)
        params = optax.apply_updates(state.params, updates)
        loss, grad_norm = jnp.sum(ce_K) / n_window, optim.grad_norm(opt_state)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip_non_finite or fp16:
            params, opt_state = optim.unless_finite(finite, state, (params, opt_state))
        metrics = {
            "loss": loss,
            "lr": schedule(optim.applied_updates(state.opt_state)),  # the LR this window's update applies
            "grad_norm": grad_norm,
            "tokens": n_window,
            "skipped": optim.skipped_updates(opt_state),
        }
        if fp16:
            opt_state = optim.with_loss_scale(opt_state, optim.next_loss_scale(scaler, finite, loss_scaling))
            metrics["loss_scale"] = scaler.scale  # the scale this window's backward pass ran with
        return TrainState(params, opt_state), metrics

    return train_step


def jit_train_step(cfg: Config, seed: int, out_shardings=None) -> Callable:
    """The run's train step (cfg's model with its resolved vocab_size, optimizer, schedule, nan_policy), jitted with
    the state donated: what run.Trainer trains with, the dry run compiles and the benchmarks time."""
    graphdef = model.graphdef(cfg.model, vocab_size=cfg.model.vocab_size, precision=cfg.train.precision)
    train_step = make_train_step(graphdef, optim.optimizer(cfg), optim.lr_schedule(cfg), seed, cfg.model.dropout > 0,
                                 skip_non_finite=cfg.train.nan_policy == "skip", loss_scaling=optim.loss_scaling(cfg),
                                 vocab_tiles=cfg.model.vocab_tiles, lse_in_head=cfg.model.head_lse == "pallas")
    return _jit_as_the_step(train_step, cfg, donate_argnums=0, out_shardings=out_shardings)


def _jit_as_the_step(fn: Callable, cfg: Config, **jit_kwargs) -> Callable:
    """jax.jit of fn, traced for the dots cfg picks (traced_for_dots) and compiled with the step's options; where
    those cannot be cached, process 0 says so once (uncached_dots_note): a run, a dry run and a benchmark alike."""
    onednn = kernel_choice.onednn_dots(cfg.model, cfg.train.precision)
    if (note := uncached_dots_note(cfg)) and jax.process_index() == 0:
        _print_once(note)
    return jax.jit(traced_for_dots(fn, onednn), compiler_options=compiler_options(cfg), **jit_kwargs)


@functools.cache
def _print_once(line: str) -> None:
    print(line, file=sys.stderr)


def traced_for_dots(fn: Callable, onednn: bool) -> Callable:
    """fn, traced for the dots its compile asks for (`onednn`: kernel_choice.onednn_dots, autocast.onednn_dots:
    which result dtypes and bias rows the model writes), whenever jit traces it."""
    @functools.wraps(fn)
    def traced(*args):
        with autocast.onednn_dots(onednn):
            return fn(*args)
    return traced


SOL_ESTIMATOR = "xla_gpu_enable_analytical_sol_latency_estimator"
DOT_MERGER = "xla_gpu_dot_merger_threshold_mb"
# XLA:CPU's dots as oneDNN's (kernel_choice.onednn_dots); its other ops stay XLA's (YNNPACK's, Eigen's)
ONEDNN_DOTS = {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
# jax's warning at each compile of a program holding oneDNN's dots while its persistent compilation cache is on
# ("... JaxRuntimeError: UNIMPLEMENTED: ToProto is not implemented for thunk kind: onednn-fusion")
UNCACHEABLE_ONEDNN = r"Error writing persistent compilation cache entry .*onednn-fusion"


def uncached_dots_note(cfg: Config) -> str | None:
    """Where the step's dots are oneDNN's and jax's persistent compilation cache is on: one line saying that the
    step compiles each run, and what caches it, said in place of jax's warning at each compile, which is silenced
    from here on. None elsewhere."""
    if not (jax.config.jax_compilation_cache_dir and kernel_choice.onednn_dots(cfg.model, cfg.train.precision)):
        return None
    warnings.filterwarnings("ignore", message=UNCACHEABLE_ONEDNN, category=UserWarning)
    return (f"note: XLA cannot store a step whose dots are oneDNN's (model.cpu_dots={cfg.model.cpu_dots}) in jax's "
            f"persistent compilation cache ({jax.config.jax_compilation_cache_dir}): it compiles each run; "
            "--model.cpu_dots=xla caches it, on XLA's default dots instead")


def compiler_options(cfg: Config) -> dict:
    """XLA options of the train and eval steps' compiles, each only where it was measured to pay, and never over the
    user's own setting of it in XLA_FLAGS (nor one given at compile time: benchmarks.xla_flags).

    On a GPU, for bf16 and fp16, every rounding the program writes kept (autocast.rounding_options: torch's
    autocast numerics, for no measured time); on every backend under model.residual_dtype=bf16 (XLA:CPU dropped the
    stream's roundings).

    On a GPU, with the weights whole on every device (mesh.fsdp=1), XLA's older latency estimator for its
    latency-hiding scheduler. The default analytical ("SoL") estimator moved the weight-gradient gemms of the
    backward pass toward the step's gradient all-reduces, keeping their inputs (the logits' gradient, LayerNorm
    outputs, the MLP's gradients) alive across layers: gpt-1b over 16 H100 data-parallel 39.72 GiB a device with
    fused_norm's kernels, 32.12 without that estimator, the same compute estimate, less exposed communication
    (benchmarks.xla_flags). Not under fsdp > 1, where the default overlapped the weights' gathers better (exposed
    7.63 ms, 11.52 without it).

    There too, where q, k and v are three gemms (kernel_choice.qkv_gemm_blocks), XLA's dot merger off: it merges
    them back into one and slices its output, the copies those gemms are there to avoid (GPT-2 124M's step on an
    H100, the roofline: 2.0 ms of 91.8; it merged nothing else there), and under model.qkv_grad=pallas the three
    weight gradients' gemms, which share x, back into one on the gradients side by side, the copy the kernel
    avoids.

    On a CPU, the dots as oneDNN's where kernel_choice.onednn_dots picks them: configs/small.yaml's bf16 step on a
    2-core AMX Xeon 2.15 s against 2.85 with XLA's default dots, its fp32 step 5.5 against 6.8 (benchmarks/NOTES.md,
    CPU step 15)."""
    onednn = kernel_choice.onednn_dots(cfg.model, cfg.train.precision)
    options = autocast.rounding_options(autocast.backend(), cfg.train.precision, cfg.model.residual_dtype == "bf16",
                                        onednn)
    if onednn:
        options.update(ONEDNN_DOTS)
    if autocast.backend() == "gpu" and cfg.mesh.fsdp == 1:
        options[SOL_ESTIMATOR] = False
        fused_attention = kernel_choice.fused_attention(cfg.model, cfg.train.precision)
        if kernel_choice.qkv_gemm_blocks(fused_attention, cfg.mesh.fsdp, cfg.model.qkv_grad == "pallas"):
            options[DOT_MERGER] = 0
    xla_flags = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in options.items() if name not in xla_flags}


def jit_eval_step(cfg: Config) -> Callable:
    """The run's eval step for cfg's model (its resolved vocab_size), jitted with the train step's compile options:
    the same forward pass compiles the same way (on a GPU, q, k and v stay three gemms)."""
    graphdef = model.graphdef(cfg.model, vocab_size=cfg.model.vocab_size, precision=cfg.train.precision)
    return _jit_as_the_step(make_eval_step(graphdef), cfg)


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    """eval_step(params, inputs_KxBxT, targets_KxBxT) -> (sum CE, correct top-1 predictions, valid tokens) over the
    k micro-batches, one at a time (a scan: evaluation fits where a training micro-step does), both sums from one
    forward pass. The caller sums over batches, so that the eval loss and accuracy are token-weighted over all of
    them. Whatever model.vocab_tiles says, it forms the logits whole (their top-1 is the accuracy): a forward pass
    alone holds them once, where training keeps them and their gradient besides the activations."""
    def eval_step(params, inputs_KxBxT, targets_KxBxT):
        def micro(totals, batch):
            logits_BxTxV = model.apply(graphdef, params, batch[0])
            ce, n = ce_sum(logits_BxTxV, batch[1])
            return (totals[0] + ce, totals[1] + correct_sum(logits_BxTxV, batch[1]), totals[2] + n), None
        zeros = (jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))
        return jax.lax.scan(micro, zeros, (inputs_KxBxT, targets_KxBxT))[0]
    return eval_step


def eval_means(sums: list) -> tuple[float, float]:
    """(loss, accuracy): eval_step's sums of each batch, added up in float64 (thousands of batches of fp32 sums
    would round), the CE and the correct predictions over the valid tokens of all: token-weighted."""
    ce, correct, n = np.sum(jax.device_get(sums), axis=0, dtype=np.float64)
    return float(ce / max(n, 1)), float(correct / max(n, 1))
