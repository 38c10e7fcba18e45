"""What each benchmark row times: one optimizer step of jaxtrain or torchref, or the device's matmul ceiling.

Each builder returns a `Timed`: `step()` runs one unit and returns its seconds (it waits for the device), and
`peak_memory()` is the bytes the framework's allocator held at most on an accelerator, or the process's peak RSS on
a CPU. Builders run in their own process (benchmarks/workers.py), so RSS, thread pools and allocators are the row's
own. Framework imports are inside the builders: a torch row never imports jax's allocator and the reverse.
"""

import dataclasses
import time
from typing import Callable, NamedTuple

import numpy as np

from jaxtrain import data as data_lib


class Timed(NamedTuple):
    step: Callable[[], float]
    peak_memory: Callable[[], int]
    program: Callable[[], str] | None = None  # the optimized HLO of what step() runs (jax rows)


def peak_rss() -> int:
    """The process's peak resident set (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def windows(cfg, data) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    """step -> that step's (inputs, targets), (k, B/k, T) each, as the trainer draws them."""
    return lambda step: data_lib.window(data, seed=cfg.run.seed, step=step, batch_size=cfg.data.batch_size,
                                        accum_steps=cfg.optim.grad_accum_steps, seq_len=cfg.model.seq_len)


def jaxtrain(cfg, data) -> Timed:
    import jax
    from jaxtrain import step as step_lib
    train_step, window = step_lib.jit_train_step(cfg, cfg.run.seed), windows(cfg, data)
    state = step_lib.fresh_state(cfg, cfg.model.vocab_size)
    device = jax.devices()[0]

    def step() -> float:
        nonlocal state
        batch = window(int(state.step))  # drawn before the clock starts, as torchref's row draws it
        start = time.perf_counter()
        state, metrics = train_step(state, *batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    def peak_memory() -> int:
        stats = device.memory_stats() if device.platform != "cpu" else None
        return stats["peak_bytes_in_use"] if stats else peak_rss()

    def program() -> str:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        return train_step.lower(abstract, *window(0)).compile().as_text()

    return Timed(step, peak_memory, program)


def torchref(cfg, data, compiled: bool) -> Timed:
    """torchref's train step, eager or with the model under torch.compile (the optimizer stays eager, as in
    nanoGPT)."""
    import torch
    from torchref.model import GPT
    from torchref.optim import configure_optimizer, lr_scheduler
    from torchref.run import to_device, train_step

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model).to(device)
    optimizer = configure_optimizer(model, cfg)
    scheduler = lr_scheduler(optimizer, cfg)
    forward = torch.compile(model) if compiled else model
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16")
    window, step_count = windows(cfg, data), 0

    def step() -> float:
        nonlocal step_count
        inputs, targets = window(step_count)
        start = time.perf_counter()
        train_step(forward, optimizer, scheduler, to_device(inputs, device), to_device(targets, device), autocast,
                   cfg.optim.max_grad_norm)
        if device == "cuda":  # its floats wait for the backward, not for the optimizer's kernels queued after them
            torch.cuda.synchronize()
        step_count += 1
        return time.perf_counter() - start

    def peak_memory() -> int:
        return torch.cuda.max_memory_allocated() if device == "cuda" else peak_rss()

    return Timed(step, peak_memory)


def matmul_shape(cfg) -> tuple[int, int, int]:
    """(m, k, n) of the model's largest weight matmul, the MLP's c_fc on one micro-batch: tokens x d @ d x 4d."""
    micro_batch = cfg.data.batch_size // cfg.optim.grad_accum_steps
    return micro_batch * cfg.model.seq_len, cfg.model.d_model, 4 * cfg.model.d_model


def jax_matmul(cfg, precision: str, calls: int = 20) -> Timed:
    """Seconds per matmul of matmul_shape: bf16 operands with fp32 accumulation, or fp32 at HIGHEST precision,
    the two dots jaxtrain's model issues (autocast.matmul), compiled as the step compiles them: where its dots are
    XLA:CPU's oneDNN dots (kernel_choice.onednn_dots), with the bf16 result they write there."""
    import jax
    import jax.numpy as jnp

    from jaxtrain import kernel_choice
    from jaxtrain import step as step_lib
    cfg = with_precision(cfg, precision)
    m, k, n = matmul_shape(cfg)
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    a = jax.random.normal(jax.random.key(0), (m, k), dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), dtype)
    out = dtype if kernel_choice.onednn_dots(cfg.model, precision) else jnp.float32
    dot = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=out,
                                          precision=jax.lax.Precision.HIGHEST if precision == "fp32" else None),
                  compiler_options=step_lib.compiler_options(cfg))

    def step() -> float:
        start = time.perf_counter()
        out = [dot(a, b) for _ in range(calls)]
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / calls

    return Timed(step, lambda: 0)


def torch_matmul(cfg, precision: str, calls: int = 20) -> Timed:
    """Seconds per matmul of matmul_shape as autocast runs it: bf16 operands and result (fp32 accumulation
    inside), or fp32 (no TF32)."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    m, k, n = matmul_shape(cfg)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(m, k, dtype=dtype, device=device, generator=generator)
    b = torch.randn(k, n, dtype=dtype, device=device, generator=generator)

    def step() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls

    return Timed(step, lambda: 0)


def with_precision(cfg, precision: str, accum_steps: int | None = None):
    """cfg at another train.precision, and optionally another optim.grad_accum_steps (same tokens per step)."""
    optim = cfg.optim if accum_steps is None else dataclasses.replace(cfg.optim, grad_accum_steps=accum_steps)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision), optim=optim)
