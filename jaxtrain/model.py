"""GPT-2 in Flax NNX: nanoGPT's model, with torch.autocast semantics under precision "bf16" and "fp16".

Params are fp32 and named so that each one maps mechanically onto nanoGPT's state-dict names (`torch_names`): the
path joined with dots, under `transformer.` except `lm_head`, where a Linear `kernel` (in, out) is torch's `weight`
(out, in) transposed. The trainer works functionally: `init_params` gives (graphdef, params) and `apply` runs the
model on them, so jit, grad and optax see params as a plain pytree.

Precision "bf16" follows autocast: every matmul takes bf16 operands and accumulates in fp32, in the backward pass
too (autocast.py, the ops' numerics); a Linear's bias is rounded to bf16 before it is added, and Linear outputs,
attention and MLP activations and the logits are bf16; the residual stream, LayerNorm and softmax are fp32, and the
loss upcasts the logits (model.residual_dtype=bf16 rounds the stream to bf16 after the embeddings, llm.c's
numerics). "fp16" is the same with fp16 (the train step adds the loss scaling fp16's range needs: step.py).
Precision "fp32" runs every dot at Precision.HIGHEST. On a GPU under bf16, attention runs as cuDNN's fused kernel
(model.attention), and on a GPU each residual add and the LayerNorm after it as one hand-written kernel each way
(model.norm, fused_norm.py); model.gelu_fwd=pallas computes the MLP's c_fc and GELU in one hand-written Hopper
kernel and model.gelu_grad=pallas its backward from c_proj to c_fc in another (gelu_gemm.py), model.qkv_grad=pallas
c_attn's input gradient from q's, k's and v's in a third (qkv_grad.py).

Decoding (`extend`) runs the same blocks on new tokens only, with the keys and values of the earlier positions kept
in a `KVCache` per layer: the attention takes the cache as an optional argument, and the math is the training
forward pass's (the written-out attention, whatever model.attention says).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.autocast import (BIAS_ROW_GEMM, COMPUTE_DTYPES, backend, column_blocks, gelu, linear, rounded_matmul,
                               row_major)
from jaxtrain.config import ModelConfig
from jaxtrain.errors import UserError
from jaxtrain.fused_norm import residual_norm
from jaxtrain import kernel_choice, qkv_grad
from jaxtrain.gelu_gemm import gelu_linear, mlp
from jaxtrain.gelu_tanh import gelu_tanh
from jaxtrain.layer_norm import layer_norm
from jaxtrain.mesh import batch_sharded, weight_shards

INIT_STD = 0.02  # nanoGPT's (GPT-2's) init scale for every weight
GEMM_BLOCKS = "gemm_blocks"  # the name of Linear.column_blocks' outputs, which remat's dots policy keeps


def _dropout(x, rate: float, key):
    """Inverted dropout, as torch's; the identity without a key (evaluation) or at rate 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0)


def _split(key, n: int) -> list:
    """n independent dropout keys, or n Nones when running deterministically."""
    return [None] * n if key is None else list(jax.random.split(key, n))


def _normal(rngs: nnx.Rngs, shape: tuple, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


def _residual_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init of the projections into the residual stream, which grows with every layer."""
    return INIT_STD / math.sqrt(2 * cfg.n_layer)


class Linear(nnx.Module):
    """y = x @ kernel + bias with kernel (in, out), torch's weight transposed; y in the compute dtype, as autocast.

    Under bf16 or fp16, autocast casts every floating input of torch's linear, the bias too: torch adds the rounded
    bias to the fp32 accumulator and rounds the sum once (addmm's beta term, cuBLASLt's bias epilogue), and the
    bias's gradient comes back as the fp32 sum of the output's gradient rounded to the compute dtype, then cast up
    to the fp32 param: autocast.biased_matmul. Without a bias the dot rounds its own result where the backend
    does that in the gemm (rounded_matmul)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, std: float, precision: str, rngs: nnx.Rngs):
        self.kernel = _normal(rngs, (d_in, d_out), std)
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32)) if bias else None
        self.precision = precision

    def __call__(self, x):
        return linear(x, self.kernel[...], self.bias_value(), self.precision)

    def column_blocks(self, x, parts: int, kernel_dx: bool = False) -> tuple:
        """The output's `parts` column blocks, each its own gemm (autocast.column_blocks): self(x) split, without
        the copies a split makes; with `kernel_dx`, x's gradient from the blocks' gradients in one kernel
        (qkv_grad.py). Named GEMM_BLOCKS: remat's dots policy keeps them, as it keeps self(x) (its dots are inside
        a custom_vjp, where the policy does not look)."""
        blocks = (qkv_grad.column_blocks if kernel_dx else column_blocks)(
            x, self.kernel[...], self.bias_value(), self.precision, parts)
        return tuple(checkpoint_name(block, GEMM_BLOCKS) for block in blocks)

    def bias_value(self):
        """The bias's array, None for none."""
        return None if self.bias is None else self.bias[...]


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm (eps 1e-5, optional bias) in fp32 whatever the input, as autocast runs it."""

    def __init__(self, d: int, *, bias: bool):
        self.weight = nnx.Param(jnp.ones((d,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d,), jnp.float32)) if bias else None

    def __call__(self, x):
        return layer_norm(x, self.weight[...], None if self.bias is None else self.bias[...])


class Embed(nnx.Module):
    """torch.nn.Embedding: weight (num, d), fp32 rows."""

    def __init__(self, num: int, d: int, *, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (num, d), INIT_STD)

    def __call__(self, idx):
        return self.weight[...][idx]


class KVCache(NamedTuple):
    """One attention layer's keys and values for decoding: the first `length` of model.seq_len positions hold those
    of the tokens seen so far, in the compute dtype; the rest is zeros, masked out."""
    k_BxLxHxS: jax.Array
    v_BxLxHxS: jax.Array
    length: jax.Array  # int32 scalar: where the next token's key goes

    def append(self, k_BxTxHxS, v_BxTxHxS) -> "KVCache":
        """The cache with T more positions written at `length`; the caller keeps length + T <= seq_len (past it,
        dynamic_update_slice would clamp the write onto earlier positions)."""
        at = (0, self.length, 0, 0)
        return KVCache(jax.lax.dynamic_update_slice(self.k_BxLxHxS, k_BxTxHxS.astype(self.k_BxLxHxS.dtype), at),
                       jax.lax.dynamic_update_slice(self.v_BxLxHxS, v_BxTxHxS.astype(self.v_BxLxHxS.dtype), at),
                       self.length + k_BxTxHxS.shape[1])


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, precision: str, rngs: nnx.Rngs):
        d = cfg.d_model
        self.c_attn = Linear(d, 3 * d, bias=cfg.bias, std=INIT_STD, precision=precision, rngs=rngs)
        self.c_proj = Linear(d, d, bias=cfg.bias, std=_residual_std(cfg), precision=precision, rngs=rngs)
        self.n_head, self.dropout, self.precision = cfg.n_head, cfg.dropout, precision
        self.fused, self.qkv_kernel = kernel_choice.fused_attention(cfg, precision), cfg.qkv_grad == "pallas"
        self.ones_width = kernel_choice.ones_width(self.qkv_kernel)  # its gradient by TMA (qkv_grad)

    def __call__(self, x_BxTxD, key, cache: KVCache | None = None):
        """(y, cache): with a cache (decoding), x continues the positions it holds, and comes back with x's keys and
        values added; without one, x starts at position 0 and the cache stays None."""
        B, T, D = x_BxTxD.shape[:2] + self.c_proj.kernel.shape[1:]  # x may carry the bias row's column (fused_norm)
        probs_key, resid_key = _split(key, 2)
        if kernel_choice.qkv_gemm_blocks(self.fused, weight_shards(), self.qkv_kernel):
            qkv = self.c_attn.column_blocks(x_BxTxD, 3, self.qkv_kernel)
        else:  # a split fuses into the attention's ops, or is local where fsdp splits the weight across devices
            qkv = jnp.split(self.c_attn(x_BxTxD), 3, -1)
        q, k, v = (t.reshape(B, T, self.n_head, D // self.n_head) for t in qkv)
        if cache is not None:
            cache = cache.append(k, v)
            y_BxTxHxS = self._written_out(q, cache.k_BxLxHxS, cache.v_BxLxHxS, probs_key, start=cache.length - T)
        elif self.fused:
            y_BxTxHxS = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
            y_BxTxHxS = self._written_out(q, k, v, probs_key)
        return _dropout(self.c_proj(y_BxTxHxS.reshape(B, T, D)), self.dropout, resid_key), cache

    def _written_out(self, q_BxTxHxS, k_BxLxHxS, v_BxLxHxS, probs_key, start=0):
        """softmax(q k^T / sqrt(hs)) v with the (B, nh, T, L) scores and probabilities in memory, as torchref. The
        T queries sit at positions start .. start+T-1 of the L keys, and each sees the keys up to its own position:
        in training start is 0 and L = T (the causal triangle); in decoding L is the cache's length."""
        q, k, v = (row_major(t.transpose(0, 2, 1, 3)) for t in (q_BxTxHxS, k_BxLxHxS, v_BxLxHxS))  # (B, nh, ., hs)
        T, L, head_size = q.shape[2], k.shape[2], q.shape[3]
        k_T = row_major(jnp.swapaxes(k, -1, -2))
        # torchref's `(q @ k^T) * scale` under autocast: the product rounded to the compute dtype, scaled in fp32 and
        # rounded again (torch's opmath), then upcast for the softmax; under fp32 the roundings are no-ops. The dot
        # rounds once, after it or in it, as the batched dots' gradients do (autocast._low_matmul_bwd).
        low = COMPUTE_DTYPES[self.precision]
        scale = jnp.float32(1.0 / math.sqrt(head_size))
        scores_BxHxTxL = rounded_matmul(q, k_T, self.precision, gpu_too=False).astype(jnp.float32) * scale
        scores_BxHxTxL = scores_BxHxTxL.astype(low).astype(jnp.float32)
        causal_TxL = jnp.arange(L)[None, :] <= start + jnp.arange(T)[:, None]
        scores_BxHxTxL = jnp.where(causal_TxL, scores_BxHxTxL, -jnp.inf)
        probs_BxHxTxL = jax.nn.softmax(scores_BxHxTxL, axis=-1).astype(q.dtype)
        probs_BxHxTxL = _dropout(probs_BxHxTxL, self.dropout, probs_key)
        y_BxHxTxS = rounded_matmul(probs_BxHxTxL, v, self.precision, gpu_too=False)
        return y_BxHxTxS.transpose(0, 2, 1, 3)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, precision: str, rngs: nnx.Rngs):
        d = cfg.d_model
        self.c_fc = Linear(d, 4 * d, bias=cfg.bias, std=INIT_STD, precision=precision, rngs=rngs)
        self.c_proj = Linear(4 * d, d, bias=cfg.bias, std=_residual_std(cfg), precision=precision, rngs=rngs)
        self.dropout, self.precision, self.remat = cfg.dropout, precision, cfg.remat
        self.fwd_kernel, self.grad_kernel = cfg.gelu_fwd == "pallas", cfg.gelu_grad == "pallas"
        self.gelu = gelu_tanh if cfg.gelu_approximate == "tanh" else gelu  # the kernels' is exact (config_checks)
        self.ones_width = kernel_choice.ones_width(self.fwd_kernel)  # its input by TMA (gelu_gemm)

    def __call__(self, x_BxTxD, key):
        if self.fwd_kernel and self.remat != "none" and backend() != "gpu":
            raise UserError(f"model.gelu_fwd=pallas off a GPU runs in Mosaic GPU's interpreter, whose host callbacks "
                            f"jax.checkpoint cannot recompute (model.remat={self.remat}); use model.remat=none here, "
                            f"or model.gelu_fwd=xla")
        if self.fwd_kernel:  # gelu_gemm's: c_fc with GELU (and, with grad_kernel, GELU's backward with c_proj's dx)
            y_BxTxD = mlp(x_BxTxD, self.c_fc.kernel[...], self.c_fc.bias_value(), self.c_proj.kernel[...],
                          self.c_proj.bias_value(), self.precision, self.grad_kernel)
        elif self.grad_kernel:  # c_fc outside the kernel's custom_vjp, where remat's dots policy keeps its output
            y_BxTxD = gelu_linear(self.c_fc(x_BxTxD), self.c_proj.kernel[...], self.c_proj.bias_value(),
                                  self.precision)
        else:
            y_BxTxD = self.c_proj(self.gelu(self.c_fc(x_BxTxD)))
        return _dropout(y_BxTxD, self.dropout, key)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, precision: str, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, precision=precision, rngs=rngs)
        self.ln_2 = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg, precision=precision, rngs=rngs)
        self.precision, self.norm_kernels = precision, kernel_choice.norm_kernels(cfg)

    def __call__(self, x_BxTxD, delta_BxTxD, key, cache: KVCache | None = None):
        """(x, delta, cache): the residual stream comes and goes as x and the MLP's output not yet added to it
        (None before the first block), so that the add runs in the next norm's kernel where model.norm picks the
        kernels (one pass fewer over the stream); the attention's cache passed through (CausalSelfAttention)."""
        attn_key, mlp_key = _split(key, 2)
        x_BxTxD, h_BxTxD = self._residual_norm(self.ln_1, x_BxTxD, delta_BxTxD, self.attn.ones_width)
        y_BxTxD, cache = self.attn(h_BxTxD, attn_key, cache)
        x_BxTxD, h_BxTxD = self._residual_norm(self.ln_2, x_BxTxD, y_BxTxD, self.mlp.ones_width)
        return x_BxTxD, self.mlp(h_BxTxD, mlp_key), cache

    def _residual_norm(self, ln: LayerNorm, x_BxTxD, y_BxTxD, ones_width: int):
        """(x + y, ln(x + y)), y None for none; fp32 + bf16 -> fp32, as in torch (bf16 + bf16 -> bf16 under
        model.residual_dtype=bf16). One Pallas kernel each way where
        model.norm picks it (fused_norm.py: then ln's output comes in the compute dtype, with `ones_width` columns
        for the next Linear's bias row), XLA's ops elsewhere."""
        if self.norm_kernels:
            return residual_norm(x_BxTxD, y_BxTxD, ln.weight[...], None if ln.bias is None else ln.bias[...],
                                 self.precision, ones_width)
        x_BxTxD = x_BxTxD if y_BxTxD is None else x_BxTxD + y_BxTxD
        return x_BxTxD, ln(x_BxTxD)


# model.remat: what the backward pass finds kept from each block's forward (the rest it recomputes). full: nothing
# but the block's input; dots: also the outputs of matmuls without batch dimensions (the weight matmuls, not the
# attention's), as MaxText's and Levanter's save-dots policies, and by name the gemms inside custom_vjps, which the
# policy does not see (Linear.column_blocks', autocast.biased_matmul's where it pads its input).
REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                      jax.checkpoint_policies.save_only_these_names(GEMM_BLOCKS, BIAS_ROW_GEMM))}


def _run_block(block, x_BxTxD, delta_BxTxD, key):
    x_BxTxD, delta_BxTxD, _ = block(x_BxTxD, delta_BxTxD, key)
    return batch_sharded(x_BxTxD), batch_sharded(delta_BxTxD)


def _rematted(remat: str):
    """_run_block under jax.checkpoint with remat's policy, the block's params passed in as an argument. Not
    nnx.remat: it writes the block's params back after the call, which under a scan that closes over them (the
    eval step's, the sampler's) is a write across trace levels, and flax refuses it (TraceContextError)."""
    def run_block(block, x_BxTxD, delta_BxTxD, key):
        graphdef, state = nnx.split(block)
        pure = lambda state, *stream_and_key: _run_block(nnx.merge(graphdef, state), *stream_and_key)
        # a block's inputs are what remat keeps: the stream added up, not x and delta (a B x T x D more a layer)
        x_BxTxD = x_BxTxD if delta_BxTxD is None else x_BxTxD + delta_BxTxD
        return jax.checkpoint(pure, policy=REMAT_POLICIES[remat])(state, x_BxTxD, None, key)
    return run_block


class GPT(nnx.Module):
    """Token ids (B, T) -> logits (B, T, V) in the compute dtype. vocab_size is explicit because cfg.vocab_size
    may be None (taken from the data); it wins over cfg.vocab_size."""

    def __init__(self, cfg: ModelConfig, *, vocab_size: int, precision: str, rngs: nnx.Rngs):
        if precision not in COMPUTE_DTYPES:
            raise ValueError(f"precision must be one of {sorted(COMPUTE_DTYPES)}, got {precision!r}")
        self.wte = Embed(vocab_size, cfg.d_model, rngs=rngs)
        self.wpe = Embed(cfg.seq_len, cfg.d_model, rngs=rngs)
        self.h = nnx.List([Block(cfg, precision=precision, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = None if cfg.tie_embeddings else Linear(
            cfg.d_model, vocab_size, bias=False, std=INIT_STD, precision=precision, rngs=rngs)
        self.dropout, self.precision, self.remat = cfg.dropout, precision, cfg.remat
        self.stream_dtype = jnp.bfloat16 if cfg.residual_dtype == "bf16" else jnp.float32

    def __call__(self, idx_BxT, *, dropout_key: jax.Array | None = None):
        return self._logits(self.hidden(idx_BxT, dropout_key=dropout_key))

    def hidden(self, idx_BxT, *, dropout_key: jax.Array | None = None):
        """The final hidden states (B, T, D), fp32: after ln_f, what the head multiplies into logits."""
        T = idx_BxT.shape[1]
        if T > self.wpe.weight.shape[0]:  # jax would clamp the position lookup silently
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len {self.wpe.weight.shape[0]}")
        emb_key, *block_keys = _split(dropout_key, len(self.h) + 1)
        x_BxTxD = _dropout(self.wte(idx_BxT) + self.wpe(jnp.arange(T)), self.dropout, emb_key)
        x_BxTxD = batch_sharded(x_BxTxD.astype(self.stream_dtype))  # after the dropout, as torchref casts it
        run_block = _run_block if self.remat == "none" else _rematted(self.remat)
        delta_BxTxD = None
        for block, key in zip(self.h, block_keys):
            x_BxTxD, delta_BxTxD = run_block(block, x_BxTxD, delta_BxTxD, key)
        return self.ln_f(x_BxTxD + delta_BxTxD)

    def extend(self, idx_BxT, caches: list[KVCache]) -> tuple[jax.Array, list[KVCache]]:
        """Logits (B, T, V) of tokens that continue the positions `caches` hold (one per layer, all of the same
        length), and the caches with their keys and values added. No dropout: this is for decoding. The caller
        keeps length + T <= seq_len: past it, the position lookup and the cache writes would clamp silently."""
        positions_T = caches[0].length + jnp.arange(idx_BxT.shape[1])
        x_BxTxD = (self.wte(idx_BxT) + self.wpe(positions_T)).astype(self.stream_dtype)
        delta_BxTxD, extended = None, []
        for block, cache in zip(self.h, caches):
            x_BxTxD, delta_BxTxD, cache = block(x_BxTxD, delta_BxTxD, None, cache)
            extended.append(cache)
        return self._logits(self.ln_f(x_BxTxD + delta_BxTxD)), extended

    def _logits(self, x_BxTxD):
        return head_logits(x_BxTxD, self.head_weight(), self.precision)

    def head_weight(self):
        """The head's (D, V) fp32 weight: wte's transposed when tied, lm_head's kernel otherwise."""
        return self.wte.weight[...].T if self.lm_head is None else self.lm_head.kernel[...]


def head_logits(x_BxTxD, w_DxV, precision: str):
    """Logits in the compute dtype: under bf16 from bf16 operands with fp32 accumulation, rounded once to bf16 as
    autocast's head returns them (the loss upcasts). B x T x V is the step's largest tensor: in bf16 it moves half
    the bytes (GPT-2 124M on an H100: see benchmarks/NOTES.md); model.vocab_tiles never forms it (loss.py). On a
    GPU or TPU the dot returns bf16 itself: rounded after an fp32 dot, XLA:GPU wrote the logits in fp32 and rounded
    them in a pass of their own (6.4 ms of a 173 ms step on the H100). XLA:CPU would run a bf16-result dot on fp32
    copies of its operands, not in bf16 (row_major), so there the fp32 result is rounded after the dot."""
    return rounded_matmul(x_BxTxD, w_DxV, precision)


def init_params(cfg: ModelConfig, *, vocab_size: int, precision: str, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params): the model's structure and its fp32 params, the model's only state."""
    model = GPT(cfg, vocab_size=vocab_size, precision=precision, rngs=nnx.Rngs(seed))
    return nnx.split(model, nnx.Param)


def apply(graphdef: nnx.GraphDef, params: nnx.State, idx_BxT, *, dropout_key: jax.Array | None = None):
    """Logits (B, T, V), in the compute dtype (GPT), of the model `graphdef` with `params`: a pure function for jit
    and grad."""
    return nnx.merge(graphdef, params)(idx_BxT, dropout_key=dropout_key)


def extend(graphdef: nnx.GraphDef, params: nnx.State, idx_BxT, caches: list[KVCache]):
    """(logits (B, T, V), caches): GPT.extend as a pure function for jit."""
    return nnx.merge(graphdef, params).extend(idx_BxT, caches)


def empty_caches(cfg: ModelConfig, *, batch: int, precision: str) -> list[KVCache]:
    """One zero KVCache of cfg.seq_len positions per layer, for `batch` sequences."""
    shape = (batch, cfg.seq_len, cfg.n_head, cfg.d_model // cfg.n_head)
    zeros = jnp.zeros(shape, COMPUTE_DTYPES[precision])
    return [KVCache(zeros, zeros, jnp.zeros((), jnp.int32)) for _ in range(cfg.n_layer)]


def torch_names(params: nnx.State) -> dict[str, tuple[tuple, bool]]:
    """nanoGPT state-dict name -> (path in params, whether torch's tensor is ours transposed).

    Tied, there is no `lm_head.weight`: it is `transformer.wte.weight` (torch's state_dict lists the alias,
    safetensors cannot store it, and loaders drop it)."""
    names = {}
    for path, _ in nnx.to_flat_state(params):
        *modules, leaf = (str(p) for p in path)
        transposed = leaf == "kernel"
        prefix = [] if modules[0] == "lm_head" else ["transformer"]
        names[".".join(prefix + modules + ["weight" if transposed else leaf])] = (path, transposed)
    return names


def graphdef(cfg: ModelConfig, *, vocab_size: int, precision: str) -> nnx.GraphDef:
    """The model's structure alone, without allocating params (the trainer creates them directly sharded)."""
    abstract = nnx.eval_shape(lambda: GPT(cfg, vocab_size=vocab_size, precision=precision, rngs=nnx.Rngs(0)))
    return nnx.graphdef(abstract)
