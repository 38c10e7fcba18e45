"""jaxtrain against the PyTorch loop it mirrors, on one config and one device, in one table.

    python -m benchmarks.run --config configs/small.yaml [--rounds 2] [--steps 6] [--rows a,b] [--synthetic]
                             [--one-at-a-time] [--json out.json] [--peak-tflops P] [--only throughput|save] [--section.key=value ...]

Rows: jaxtrain bf16 and fp32; torchref eager bf16 and fp32; torchref under torch.compile bf16; jaxtrain bf16 with
one micro-batch and with four at the same tokens per step; and the matmul ceiling of each framework (the model's
largest weight matmul). Each row runs in its own process (benchmarks/workers.py), warmed up, and the rows take turns:
`--rounds` rounds of `--steps` timed steps each (A B C A B C), so drift of a shared machine falls on all of them.
Then the cost of a checkpoint save (benchmarks/save_cost.py). MFU is nanoGPT's FLOPs per token against the best
measured matmul of the row's precision, and against the device's nominal bf16 peak where it is known
(jaxtrain.metrics.PEAK_TFLOPS, or --peak-tflops). `--synthetic`: uniform random token ids, no data folder needed.
"""

if __name__ == "__main__":  # jaxtrain's own command line does the same; the rows' processes inherit it
    from jaxtrain import hostmem
    hostmem.use_huge_pages()

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
from typing import Callable

from benchmarks import workers
from benchmarks.steps import matmul_shape, with_precision
from jaxtrain import config as config_lib, config_checks
from jaxtrain.cmdline import CONFIG_FLAGS_HELP, output_file, positive_float, positive_int
from jaxtrain.errors import OneLineParser, UserError, exit_on_user_error

# key -> (row name, steps builder, precision, grad_accum_steps (None: the config's), builder args)
ROWS = {
    "jax-bf16": ("jaxtrain bf16", "jaxtrain", "bf16", None, ()),
    "torch-bf16": ("torchref eager bf16", "torchref", "bf16", None, (False,)),
    "compile-bf16": ("torchref torch.compile bf16", "torchref", "bf16", None, (True,)),
    "jax-fp32": ("jaxtrain fp32", "jaxtrain", "fp32", None, ()),
    "torch-fp32": ("torchref eager fp32", "torchref", "fp32", None, (False,)),
    "jax-bf16-k1": ("jaxtrain bf16, k=1", "jaxtrain", "bf16", 1, ()),
    "jax-bf16-k4": ("jaxtrain bf16, k=4", "jaxtrain", "bf16", 4, ()),
    "matmul-jax-bf16": ("matmul jax bf16", "jax_matmul", "bf16", None, ("bf16",)),
    "matmul-torch-bf16": ("matmul torch bf16", "torch_matmul", "bf16", None, ("bf16",)),
    "matmul-jax-fp32": ("matmul jax fp32", "jax_matmul", "fp32", None, ("fp32",)),
    "matmul-torch-fp32": ("matmul torch fp32", "torch_matmul", "fp32", None, ("fp32",)),
}


def main(argv: list[str]) -> None:
    args, rest = parser().parse_known_args(argv)
    keys = row_keys(",".join(ROWS) if args.rows is None else args.rows)
    check_only_save(args)
    workers.quiet_gpu_allocators()
    base = resolved_config(rest, args.synthetic)
    device, n_params, peak = describe_device(base, args.peak_tflops)
    rounds = "" if args.only == "save" else f"; {args.rounds} rounds x {args.steps} steps per row"
    print(f"{device}; {n_params:,} params; batch {base.data.batch_size} x seq {base.model.seq_len} in "
          f"{base.optim.grad_accum_steps} micro-batches{rounds}\n", flush=True)
    results = {"device": device, "config": rest, "n_params": n_params, "rows": []}
    if args.only != "save":
        results["rows"] = measure(base, keys, args, lambda rows: write_json(args.json, dict(results, rows=rows)))
        print(table(results["rows"], base, n_params, peak), flush=True)
        write_json(args.json, results)  # before the save's cost, which takes minutes on a big model
    if args.only != "throughput":
        from benchmarks.save_cost import save_cost_table  # jax and orbax: not in the rows' spawned processes
        results["save"] = save_cost(base, args)
        print(save_cost_table(results["save"]), flush=True)
        write_json(args.json, results)


def write_json(path: str | None, results: dict) -> None:
    """--json's file (none where not given): the results so far, each row's config as a dict."""
    if path is None:
        return
    rows = [{k: dataclasses.asdict(v) if k == "cfg" and dataclasses.is_dataclass(v) else v
             for k, v in r.items() if k != "worker"} for r in results["rows"]]
    with open(path, "w") as f:
        json.dump(dict(results, rows=rows), f, indent=1)


def parser() -> argparse.ArgumentParser:
    """This tool's own flags; the rest (--config, --section.key=value) go to config.load."""
    ap = OneLineParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                       epilog=CONFIG_FLAGS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--steps", type=positive_int, default=6, help="timed steps per row and round")
    ap.add_argument("--rows", help=f"comma-separated, of: {', '.join(ROWS)} (default: all)")
    ap.add_argument("--synthetic", action="store_true", help="random token ids instead of data.path")
    ap.add_argument("--peak-tflops", type=positive_float, help="the device's nominal dense bf16 peak, for MFU")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="each row's process runs all its rounds alone (a GPU that cannot hold every row at once)")
    ap.add_argument("--json", type=output_file, help="also write the results here (the rows, and the save costs)")
    ap.add_argument("--only", choices=("throughput", "save"), help="print only this part")
    return ap


def check_only_save(args) -> None:
    """--only save measures a checkpoint save, no row: a flag that picks or reads the rows would be passed over."""
    given = {"--rows": args.rows, "--one-at-a-time": args.one_at_a_time, "--peak-tflops": args.peak_tflops}
    ignored = [flag for flag, value in given.items() if value not in (None, False)]
    if args.only == "save" and ignored:
        raise UserError(f"{ignored[0]} is for the throughput rows, which --only save does not run; drop it, or drop "
                        f"--only save")


def row_keys(rows: str) -> list[str]:
    keys = [k.strip() for k in rows.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROWS]
    if not keys:
        raise UserError(f"--rows={rows!r} names no row; give one or more, comma-separated, of {', '.join(ROWS)}")
    if unknown:
        raise UserError(f"unknown --rows {unknown}; choose from {', '.join(ROWS)}")
    return keys


def resolved_config(overrides: list[str], synthetic: bool):
    base = config_lib.load(overrides + ["--data.path=null"] if synthetic else overrides)
    if synthetic:
        if base.model.vocab_size is None:
            raise UserError("--synthetic needs model.vocab_size (there is no data to take it from); set "
                            "--model.vocab_size")
        return base
    from jaxtrain import data as data_lib
    vocab = data_lib.resolve_vocab_size(base.model.vocab_size, data_lib.load(base.data, base.model.seq_len))
    return dataclasses.replace(base, model=dataclasses.replace(base.model, vocab_size=vocab))


def describe_device(cfg, peak_tflops: float | None) -> tuple[str, int, float | None]:
    """The device in words, the model's params (jax's count, wpe included) and the nominal peak FLOP/s."""
    import jax
    from jaxtrain import metrics, step as step_lib
    abstract = jax.eval_shape(functools.partial(step_lib.fresh_state, cfg, cfg.model.vocab_size))
    n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    kind = jax.devices()[0].device_kind
    peak = peak_tflops * 1e12 if peak_tflops else metrics.peak_flops(cfg, kind)
    if jax.default_backend() == "cpu":
        with open("/proc/cpuinfo") as f:
            kind = f"{cpu_in_words(f.read(), os.cpu_count())}, jax {jax.__version__}"
    return kind, n_params, peak


def cpu_in_words(cpuinfo: str, cores: int) -> str:
    """'<model name> (<cores> cores, <its bf16 matmul units>)', from /proc/cpuinfo's text: torch's oneDNN runs bf16
    matmuls on them, and the bf16 rows' ratio differs with them (benchmarks/NOTES.md, CPU step 12)."""
    from jaxtrain.kernel_choice import bf16_matmul_units, cpuinfo_fields
    units = bf16_matmul_units(cpuinfo) or ["no bf16 matmul units"]
    return f"{cpuinfo_fields(cpuinfo).get('model name', 'CPU')} ({cores} cores, {', '.join(units)})"


def measure(base, keys: list[str], args, measured: Callable[[list[dict]], None]) -> list[dict]:
    """Start each row's process (one after the other, so warm-ups do not share the machine), then the rounds: each
    round gives every live row its turn. With --one-at-a-time a row's process runs all its rounds and ends before
    the next starts, for a GPU whose memory cannot hold every row's activations and caches at once. After each
    group of rows, a line per row and `measured(rows)`: a run cut short keeps the rows it finished."""
    rows = [{"key": key, "name": ROWS[key][0], "precision": ROWS[key][2], "times": [], "cfg": row_config(base, key)}
            for key in keys]
    groups = [[r] for r in rows] if args.one_at_a_time else [rows]
    for group in groups:
        for r in group:
            r["worker"] = workers.Worker(workers.Row(r["name"], ROWS[r["key"]][1], r["cfg"], ROWS[r["key"]][4]),
                                         args.synthetic)
            r.update(r["worker"].warmup)
            print(f"  started {r['name']}: {r['worker'].warmup}", flush=True)
        for _ in range(args.rounds):
            for r in (r for r in group if "error" not in r):
                times = _times(r, args.steps)
                r["times"] += times or []  # [] where it failed
        for r in group:
            r["peak_memory"] = _peak_memory(r) if "error" not in r else None
            r.pop("worker").close()
            print(f"  measured {r['name']}: " + (r["error"] if "error" in r else
                  f"median {statistics.median(r['times']) * 1e3:,.1f} ms of {len(r['times'])} steps"), flush=True)
        measured(rows)
    return rows


def _times(r: dict, steps: int) -> list[float] | None:
    """Row r's times of `steps` more steps. Where its process failed or died instead, the row holds that error and
    no times (a row that did not finish its rounds is not measured), the other rows go on, and the answer is None."""
    answer = r["worker"].times(steps)
    if isinstance(answer, dict):
        r.update(error=f"times: {answer['error']}", times=[])
        return None
    return answer


def _peak_memory(r: dict) -> int | None:
    """Row r's peak memory, or None where its process could not say (the row's times stand: they were measured)."""
    answer = r["worker"].peak_memory()
    if isinstance(answer, dict):
        r["peak_memory_error"] = answer["error"]
        print(f"  {r['name']}: no peak memory ({answer['error']})", flush=True)
        return None
    return answer


def row_config(base, key: str):
    """The config row `key` runs, checked as the trainer checks its own: a row's precision or micro-batch count
    can make a valid base config invalid (k=4 on a batch of 6), a user error to report before any process starts
    rather than a failed row."""
    name, _, precision, accum_steps, _ = ROWS[key]
    cfg = with_precision(base, precision, accum_steps)
    try:
        config_checks.validate(cfg)
    except UserError as e:
        raise UserError(f"{name}: {e}") from None
    return cfg


def table(rows: list[dict], base, n_params: int, peak: float | None) -> str:
    from jaxtrain import metrics
    flops_per_token = metrics.flops_per_token(base, n_params)
    m, k, n = matmul_shape(base)
    for r in rows:
        r["cfg"] = dataclasses.asdict(r.pop("cfg"))
        if r["times"]:
            # One rule for every figure: the work of a step over the median step time (the min-max from the
            # slowest and fastest step), so tokens/s, step ms and MFU agree also for an even count of steps.
            work = 2 * m * k * n if r["key"].startswith("matmul") else base.data.batch_size * base.model.seq_len
            step_s = statistics.median(r["times"])
            r.update(median=work / step_s, low=work / max(r["times"]), high=work / min(r["times"]),
                     step_ms=step_s * 1e3)
    ceiling = {p: max((r["median"] for r in rows if r["key"].startswith("matmul") and r["precision"] == p
                       and "median" in r), default=None) for p in ("bf16", "fp32")}
    jax_main = {r["precision"]: r["median"] for r in rows if r["key"] in ("jax-bf16", "jax-fp32") and "median" in r}
    lines = ["| run | tokens/s median (min-max) | step ms | MFU of the measured matmul | MFU of nominal peak | "
             "first step s | peak memory GB | jaxtrain / this |", "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if not r["key"].startswith("matmul")):
        if "median" not in r:
            lines.append(f"| {r['name']} | failed: {_cell(r['error'])} | | | | | | |")
            continue
        achieved = r["median"] * flops_per_token
        r["mfu_ceiling"] = achieved / ceiling[r["precision"]] if ceiling[r["precision"]] else None
        r["mfu_peak"] = achieved / peak if peak else None
        ratio = jax_main.get(r["precision"], 0) / r["median"] if r["precision"] in jax_main else None
        lines.append(f"| {r['name']} | {r['median']:,.0f} ({r['low']:,.0f}-{r['high']:,.0f}) | {r['step_ms']:,.1f} | "
                     f"{_pct(r['mfu_ceiling'])} | {_pct(r['mfu_peak'])} | {r['first_step_s']:.1f} | "
                     f"{_gb(r['peak_memory'])} | {f'{ratio:.2f}' if ratio else 'n/a'} |")
    lines += ["", f"matmul ceiling, ({m} x {k}) @ ({k} x {n}), the MLP's c_fc on one micro-batch:", "",
              "| framework | TFLOP/s median (min-max) | of nominal peak |", "|---|---|---|"]
    for r in (r for r in rows if r["key"].startswith("matmul")):
        lines.append(f"| {r['name']} | " + (f"failed: {_cell(r['error'])} | |" if "median" not in r else
                     f"{r['median'] / 1e12:.2f} ({r['low'] / 1e12:.2f}-{r['high'] / 1e12:.2f}) | "
                     f"{_pct(r['median'] / peak if peak else None)} |"))
    return "\n".join(lines) + "\n\n" + summary(rows)


def summary(rows: list[dict]) -> str:
    """The issue's goals, as ratios of this run's medians."""
    median = {r["key"]: r["median"] for r in rows if "median" in r}
    out = []
    best_torch = max((median[k] for k in ("torch-bf16", "compile-bf16") if k in median), default=None)
    if "jax-bf16" in median and best_torch:
        out.append(f"jaxtrain bf16 / best torch bf16: {median['jax-bf16'] / best_torch:.2f} (goal >= 0.7)")
    if "jax-fp32" in median and "torch-fp32" in median:
        out.append(f"jaxtrain fp32 / torchref eager fp32: {median['jax-fp32'] / median['torch-fp32']:.2f} "
                   f"(goal >= 0.8)")
    if "jax-bf16-k1" in median and "jax-bf16-k4" in median:
        out.append(f"accumulation k=4 costs {1 - median['jax-bf16-k4'] / median['jax-bf16-k1']:.1%} of k=1's "
                   f"tokens/s (goal <= 5%)")
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    """`text` as one cell of a Markdown table: a '|' in it (an error's text) would end the cell."""
    return text.replace("|", "\\|")


def _gb(n_bytes: int | None) -> str:
    return f"{n_bytes / 1e9:.2f}" if n_bytes is not None else "n/a"


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "n/a"


def save_cost(base, args) -> dict:
    """The cost of a checkpoint save (benchmarks/save_cost.py), on the base config with a fresh state."""
    from benchmarks.save_cost import save_costs
    from benchmarks.steps import windows
    from jaxtrain import step as step_lib
    data = workers.tokens(base, args.synthetic)
    state = step_lib.fresh_state(base, base.model.vocab_size)
    return save_costs(base, step_lib.jit_train_step(base, base.run.seed), state, windows(base, data),
                      pairs=max(args.rounds * args.steps // 2, 2))


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
