"""Throughput of jaxtrain and torchref on one config, and jaxtrain's accumulation by scan vs k jitted calls.

    python -m benchmarks.run --config configs/tiny.yaml [--steps 20] [--peak-tflops 989] [--section.key=value ...]

Prints one table. Each row times `--steps` optimizer steps after two warm-up steps (compilation, allocator), on
the same batches, and reports the median step time, tokens/s and MFU (nanoGPT's FLOPs per token; MFU needs the
device's peak, which is unknown for CPUs: pass --peak-tflops). Then what a checkpoint save costs the training, async
and sync, from about as many steps of each (benchmarks/save_cost.py). `--only throughput|save` prints one part. Run it
on a quiet machine: other jobs on the same cores show up as noise.
"""

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import time

import jax

from benchmarks.save_cost import save_cost_table
from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import metrics, optim
from jaxtrain import model as model_lib
from jaxtrain import step as step_lib


def jaxtrain_step_times(cfg, tokens, steps: int, per_micro_call: bool) -> list[float]:
    """Seconds per optimizer step. per_micro_call: the window's k micro-batches go to k jitted calls of a one-
    micro-batch step (MultiSteps counts them the same way) instead of one call that scans over them. For timing
    only: each call then normalizes the loss by its own micro-batch's tokens."""
    train_step = jitted_train_step(cfg)
    state = step_lib.fresh_state(cfg, cfg.model.vocab_size)
    times = []
    for t in range(steps + 2):
        inputs, targets = window(cfg, tokens, t)
        start = time.perf_counter()
        if per_micro_call:
            for i in range(inputs.shape[0]):
                state, m = train_step(state, inputs[i:i + 1], targets[i:i + 1])
        else:
            state, m = train_step(state, inputs, targets)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    return times[2:]


def torchref_step_times(cfg, tokens, steps: int) -> list[float]:
    import torch
    from torchref.model import GPT
    from torchref.optim import configure_optimizer, lr_scheduler
    from torchref.run import to_device, train_step

    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model)
    optimizer = configure_optimizer(model, cfg)
    scheduler = lr_scheduler(optimizer, cfg)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16")
    times = []
    for t in range(steps + 2):
        inputs, targets = window(cfg, tokens, t)
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, to_device(inputs, "cpu"), to_device(targets, "cpu"), autocast,
                   cfg.optim.max_grad_norm)
        times.append(time.perf_counter() - start)
    return times[2:]


def jitted_train_step(cfg):
    """jaxtrain's train step, jitted with the state donated, as run.Trainer does."""
    graphdef = model_lib.graphdef(cfg.model, vocab_size=cfg.model.vocab_size, precision=cfg.train.precision)
    return jax.jit(step_lib.make_train_step(graphdef, optim.optimizer(cfg), optim.lr_schedule(cfg), cfg.run.seed,
                                            cfg.model.dropout > 0), donate_argnums=0)


def window(cfg, tokens, step):
    return data_lib.window(tokens, seed=cfg.run.seed, step=step, batch_size=cfg.data.batch_size,
                           accum_steps=cfg.optim.grad_accum_steps, seq_len=cfg.model.seq_len)


def row(name: str, cfg, times: list[float], flops_per_token: float, peak: float | None) -> str:
    step_s = statistics.median(times)
    tokens_per_s = cfg.data.batch_size * cfg.model.seq_len / step_s
    mfu = f"{tokens_per_s * flops_per_token / peak:6.1%}" if peak else "   n/a"
    return f"| {name:<34} | {step_s * 1e3:9.1f} | {tokens_per_s:12,.0f} | {mfu} |"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--peak-tflops", type=float, help="device peak (bf16 dense) for MFU")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--only", choices=("throughput", "save"), help="print only this part")
    args, rest = ap.parse_known_args(argv)
    base = config_lib.load(rest)
    tokens = data_lib.load(base.data, base.model.seq_len)
    base = dataclasses.replace(base, model=dataclasses.replace(
        base.model, vocab_size=data_lib.resolve_vocab_size(base.model.vocab_size, tokens)))
    abstract = jax.eval_shape(functools.partial(step_lib.fresh_state, base, base.model.vocab_size))
    n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    flops_per_token = metrics.flops_per_token(base, n_params)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    k = base.optim.grad_accum_steps
    print(f"{jax.devices()[0].device_kind} x{jax.device_count()}, {n_params:,} params, batch {base.data.batch_size} x "
          f"seq {base.model.seq_len}, accumulation {k}, {args.steps} timed steps\n")
    if args.only != "save":
        throughput_table(base, tokens, args, flops_per_token, peak)
    if args.only != "throughput":
        print(save_cost_table(base, jitted_train_step(base), step_lib.fresh_state(base, base.model.vocab_size),
                              functools.partial(window, base, tokens), pairs=math.ceil(args.steps / 2)))


def throughput_table(base, tokens, args, flops_per_token: float, peak: float | None) -> None:
    k = base.optim.grad_accum_steps
    print(f"| {'run':<34} | {'step (ms)':>9} | {'tokens/s':>12} | {'MFU':>6} |\n|{'-' * 36}|{'-' * 11}|{'-' * 14}|{'-' * 8}|")
    for precision in ("fp32", "bf16"):
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, precision=precision))
        print(row(f"jaxtrain {precision}, scan over {k}", cfg,
                  jaxtrain_step_times(cfg, tokens, args.steps, False), flops_per_token, peak), flush=True)
        if k > 1:
            print(row(f"jaxtrain {precision}, {k} jitted calls", cfg,
                      jaxtrain_step_times(cfg, tokens, args.steps, True), flops_per_token, peak), flush=True)
        if not args.skip_torch:
            print(row(f"torchref {precision}", cfg, torchref_step_times(cfg, tokens, args.steps), flops_per_token,
                      peak), flush=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1:])
