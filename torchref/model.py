"""GPT-2 in plain PyTorch, laid out as nanoGPT's model.py: attention, MLP, Block, GPT.

The state-dict names are nanoGPT's (transformer.wte, transformer.h.0.attn.c_attn, ..., lm_head), so a checkpoint
reads the same in nanoGPT, here, and in jaxtrain's torch-format bridge. The parity traps are pinned down to match
jaxtrain/model.py: exact GELU (tanh only as model.gelu_approximate says), LayerNorm eps 1e-5, a -inf causal mask,
softmax in fp32, GPT-2's init. The forward returns logits only; the training loop owns the loss.
"""

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from jaxtrain.config import ModelConfig


def upcast(x):
    """At least fp32: bf16 activations become fp32, fp32 and the float64 of exactness tests pass through."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class CausalSelfAttention(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        # Not persistent: the mask is derived from seq_len, so it stays out of the state dict and checkpoints.
        causal = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("causal", causal.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        # -inf, not a large negative number: masked keys get exactly zero weight, and jaxtrain masks with -inf too.
        att = att.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
        # Softmax in fp32 under bf16 autocast too (CPU autocast would keep it in bf16); att @ v is bf16 again.
        att = F.softmax(upcast(att), dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.gelu = nn.GELU(approximate=cfg.gelu_approximate)  # exact erf GELU unless model.gelu_approximate=tanh
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=1e-5, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=1e-5, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        """The LayerNorms take the stream upcast, as CUDA's autocast runs layer_norm (in fp32); CPU's autocast would
        run it on a bf16 stream (model.residual_dtype=bf16) in bf16, and sum its weight's gradient less exactly."""
        x = x + self.attn(self.ln_1(upcast(x)))
        x = x + self.mlp(self.ln_2(upcast(x)))
        return x


class GPT(nn.Module):
    """GPT-2. `cfg.vocab_size` must be resolved (an int) before construction; see data.resolve_vocab_size. The keys
    that say how jaxtrain computes, not what (attention, norm, gelu_grad, head_lse, qkv_grad, remat, vocab_tiles),
    are not read here."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
            wpe=nn.Embedding(cfg.seq_len, cfg.d_model),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.d_model, eps=1e-5, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # one tensor, two names in the state dict
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer), one per residual add.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameter count, shared tensors once (jaxtrain.metrics.flops_per_token leaves out the position embedding,
        which costs no matmul FLOPs, and wte unless it is the tied lm_head)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx):
        """idx: (B, T) token ids -> logits (B, T, V). Under bf16 autocast the logits come out in bf16."""
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        if self.cfg.residual_dtype == "bf16":  # llm.c's stream: every residual add below then rounds to bf16
            x = x.to(torch.bfloat16)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(upcast(x))
        return self.lm_head(x)
