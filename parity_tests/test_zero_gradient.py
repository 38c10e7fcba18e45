"""The directions the parity judgment treats apart (judgment.zero_gradient_part) are exactly the model's entries whose
true gradient is zero: computed in fp64 with torchref's GPT, where a true zero shows as ~1e-19 next to gradients of
~1e-3 and more, and compared with what the rule names. If the model gains or loses such a direction, the report's
judgment must change with it, and this test says so.

Params are random (biases and LayerNorms too, so no entry is zero because its init is) and every token id appears in
the batch, so an untied embedding row has a gradient too.
"""

import dataclasses

import numpy as np
import pytest
import torch

from parity_tests.conftest import make_cfg, torch_grads
from parity_tests.judgment import zero_gradient_part
from torchref.model import GPT

VOCAB, T, B = 64, 16, 8
ZERO = 1e-12  # relative to the tensor's largest gradient: fp64 leaves ~1e-19 where the true value is 0 (1e-16 rel)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_zero_gradient_entries_are_exactly_the_key_bias(tied, bias):
    cfg = make_cfg(f"--model.tie_embeddings={str(tied).lower()}", f"--model.bias={str(bias).lower()}")
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(cfg.model, vocab_size=VOCAB, seq_len=T)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randperm(B * T).view(B, T) % VOCAB  # every id appears
    targets = torch.roll(idx, -1, dims=1)
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)).backward()
    for name, g in torch_grads(model).items():
        if tied and name == "lm_head.weight":
            continue  # the same tensor as transformer.wte.weight
        zero = np.abs(g) <= ZERO * np.abs(g).max()
        named = np.zeros(g.shape, bool)
        part = zero_gradient_part(name, g.shape[0])
        if part is not None:
            named[part] = True
        assert np.array_equal(zero, named), (
            f"{name}: fp64 gradient is ~0 at {np.flatnonzero(zero.ravel())[:8]}... ({zero.sum()} entries), the rule "
            f"names {np.flatnonzero(named.ravel())[:8]}... ({named.sum()} entries)")
