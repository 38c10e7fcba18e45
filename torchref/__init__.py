"""The PyTorch reference: GPT-2 (model.py), AdamW + LambdaLR (optim.py) and the standard training loop (run.py),
run from the same config as jaxtrain to show that jaxtrain trains like it. Never imports jax."""
