"""The training time a checkpoint save costs, through the run loop's own save path.

One state trains on in pairs of steps: a plain step, then what run.loop does at a save step
(checkpoint.Checkpointer.save: its finite check and fingerprint, then orbax) followed by the next step and by
whatever is left of the write. The second minus the first is what that save cost the training: the time the loop
waited for it, plus, for an async save, the cores its writer threads took from the step after it. Pairs with async
and sync saves (checkpoint.async_save) take turns, and each difference is taken between neighbouring steps, so that
drift on a shared machine cancels; the table gives medians.
"""

import dataclasses
import os
import statistics
import tempfile
import time

import jax

from jaxtrain import checkpoint
from jaxtrain.errors import exit_no_command_of_its_own

VARIANTS = {"async (checkpoint.async_save=true)": True, "sync (checkpoint.async_save=false)": False}


def step_seconds(train_step, state, window) -> tuple[object, float]:
    start = time.perf_counter()
    state, metrics = train_step(state, *window(int(state.step)))
    jax.block_until_ready(metrics)  # run.loop reads a save step's metrics before it saves
    return state, time.perf_counter() - start


def pair_seconds(train_step, state, window, saver) -> tuple[object, dict]:
    """Seconds of a plain step, of a save (until the loop goes on) and of the save and the next step together."""
    state, plain = step_seconds(train_step, state, window)
    start = time.perf_counter()
    saver.save(state, data_seed=0)
    held = time.perf_counter() - start
    state, _ = step_seconds(train_step, state, window)
    saver.wait()
    return state, {"plain": plain, "held": held, "saved": time.perf_counter() - start}


def save_costs(cfg, train_step, state, window, pairs: int) -> dict:
    """What a save costs the training: `pairs` pairs of steps per variant on `state`, trained on by `train_step`
    with window(step) as the batches of a step. cfg: the resolved config whose saves are measured. Medians, in
    ms; of_step: the cost as a fraction of a plain step."""
    times = measure(cfg, train_step, state, window, pairs)
    step_s = statistics.median(t["plain"] for name in VARIANTS for t in times[name])
    rows = []
    for name in VARIANTS:
        cost_s = statistics.median(t["saved"] - t["plain"] for t in times[name])
        rows.append({"save": name, "loop_waits_ms": statistics.median(t["held"] for t in times[name]) * 1e3,
                     "costs_ms": cost_s * 1e3, "of_step": cost_s / step_s})
    return {"state_mb": sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6, "step_ms": step_s * 1e3,
            "pairs": pairs, "rows": rows}


def save_cost_table(costs: dict) -> str:
    """save_costs' figures as a table."""
    lines = [f"checkpoint saves of the {costs['state_mb']:.0f} MB state; a train step without takes "
             f"{costs['step_ms']:,.0f} ms ({costs['pairs']} saves of each kind)\n",
             f"| {'save':<34} | {'loop waits (ms)':>15} | {'costs (ms)':>10} | {'of a step':>9} |",
             f"|{'-' * 36}|{'-' * 17}|{'-' * 12}|{'-' * 11}|"]
    lines += [f"| {r['save']:<34} | {r['loop_waits_ms']:15.1f} | {r['costs_ms']:10.1f} | {r['of_step']:9.1%} |"
              for r in costs["rows"]]
    return "\n".join(lines)


def measure(cfg, train_step, state, window, pairs: int) -> dict[str, list[dict]]:
    """Per variant, the pair_seconds of each of its pairs, after one pair of each to warm up."""
    times = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        savers = {name: checkpoint.Checkpointer(dataclasses.replace(
            cfg, run=dataclasses.replace(cfg.run, out_dir=os.path.join(tmp, str(async_save))),
            checkpoint=dataclasses.replace(cfg.checkpoint, async_save=async_save)))
            for name, async_save in VARIANTS.items()}
        for i in range(pairs + 1):
            for name, saver in savers.items():
                state, seconds = pair_seconds(train_step, state, window, saver)
                if i > 0:  # the first pair compiles, and warms the allocator and orbax
                    times[name].append(seconds)
        for saver in savers.values():
            saver.close()
    return times


if __name__ == "__main__":  # a likely guess at the command, which is benchmarks.run's: say so rather than do nothing
    exit_no_command_of_its_own("measure a save's cost with `python -m benchmarks.run --config CONFIG --only save "
                               "[--steps N]`")
