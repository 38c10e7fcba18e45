"""What ptxas makes of the hand-written Hopper gemm kernels, without a GPU: each kernel (model.gelu_grad=pallas's,
model.head_lse=pallas's, model.qkv_grad=pallas's and model.gelu_fwd=pallas's) at GPT-2 124M's shapes and at each
tile setting its benchmark times, compiled ahead of time for an H100 through jax's CUDA plugin, which runs ptxas;
Mosaic GPU prints ptxas's report where MOSAIC_GPU_DUMP_PTXAS is set. One table: spill stores and loads, stack frame,
ptxas's notes.

    python -m benchmarks.kernel_registers [--rows 16384] [--d 768] [--vocab 50304] [--gelu-tiles T] [--head-tiles T]
                                          [--qkv-tiles T] [--fc-tiles T]

Why: a consumer warpgroup holds its m x n fp32 accumulator in registers (m n / 128 a thread: 128 at 128 x 128,
192 at head_lse's 128 x 192) beside the epilogue's copies, of the 232 a thread that the pipeline's setmaxnreg gives
it; a setting that spills runs slower than its bytes and FLOPs say, which the GPU benchmarks would show only as
time. ptxas's "Used" count is no guide here: it is the launch bound of three warpgroups (65,536 / 384, rounded down
to 8: 168) for every setting, spilling or not. Notes: C7519, a warpgroup.arrive ptxas adds so that GMMA may use
registers (jax's own Hopper matmul example has it too); C7511, wgmma serialized for want of registers (with spills,
at 128 x 256 and 256 x 128: 256 accumulator registers a thread); C7504, setmaxnreg ignored "to maintain compatibility
across compilation units" (jax 0.12's Mosaic GPU compiles through nvJitLink where jax[cuda12]'s nvidia-nvjitlink is
installed: jax's own Hopper matmul example gets it too, and without the library it is gone), and with it the 232
registers a consumer thread was given: head_lse's 128 x 192 then spills; C7509, wgmma serialized for extern calls
(the head's, beside C7504). Each setting compiles in a process of its own (ptxas's report goes to the process's
stdout). Exit 1 naming the settings that spill, that draw a performance-loss note of their own (C7509, C7511), that
Mosaic GPU refuses (shared memory) or that print no report, and naming C7504 once where the compile drew it.
"""

import argparse
import os
import re
import subprocess
import sys

from benchmarks import gelu_fwd as fc_bench, gelu_gemm as gelu_bench, head_lse as head_bench, qkv_grad as qkv_bench
from benchmarks.gelu_gemm import parse_tiles
from benchmarks.roofline import require_compiler
from jaxtrain.cmdline import positive_int
from jaxtrain.config_checks import HOPPER_GEMM_TILE
from jaxtrain.errors import OneLineParser, exit_on_user_error

TARGET = "h100"
KERNEL_BENCHMARKS = (("gelu", gelu_bench), ("head", head_bench), ("qkv", qkv_bench), ("fc", fc_bench))
DEFAULT_TILES = {name: bench.parser().get_default("tiles") for name, bench in KERNEL_BENCHMARKS}
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
NOTE = re.compile(r"ptxas info\s*: \((C\d+)\)")
# ptxas's "Potential Performance Loss" notes of a setting: wgmma serialized for extern calls or for want of registers
LOSS_NOTES = {"C7509", "C7511"}
# and of the whole compile, every setting alike: setmaxnreg ignored, the consumers kept to the launch bound's 168
# registers (jax 0.12's Mosaic GPU, which compiles through nvJitLink where it is installed)
IGNORED_SETMAXNREG = "C7504"


def ptxas_figures(report: str) -> dict | None:
    """ptxas's figures for the one kernel function in `report` (its -v output); None where it has none."""
    spills = SPILLS.search(report)
    if not spills:
        return None
    stack, stores, loads = map(int, spills.groups())
    return {"stack": stack, "spill_stores": stores, "spill_loads": loads, "notes": sorted(set(NOTE.findall(report)))}


def compile_one(kernel: str, tiles_text: str, rows: int, d: int, vocab: int) -> None:
    """One kernel at one setting compiled ahead of time for an H100 (in this process: its stdout gets the report)."""
    require_compiler(TARGET)
    import jax
    import jax.numpy as jnp
    from jaxtrain import autocast, gelu_gemm, head_lse, qkv_grad, target_devices
    (tiles,) = parse_tiles(tiles_text)
    sharding = jax.sharding.SingleDeviceSharding(target_devices.devices(TARGET, 1)[0])
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
    if kernel == "gelu":
        call, args = lambda g, w_t, pre: gelu_gemm.gelu_grad_matmul(g, w_t, pre, tiles), (
            bf16(rows, d), bf16(d, 4 * d), bf16(rows, 4 * d))
    elif kernel == "head":
        call, args = lambda x, w: head_lse.logits_and_lse(x, w, tiles), (bf16(rows, d), bf16(d, vocab))
    elif kernel == "qkv":
        call, args = lambda *a: qkv_grad.summed_matmul(list(a[:3]), list(a[3:]), tiles), (
            *[bf16(rows, d)] * 3, *[bf16(d, d)] * 3)
    else:  # as the step calls it: c_fc's input with a tile of ones columns, the bias, c_proj's ones columns
        call, args = lambda x, w, b: gelu_gemm.linear_gelu_matmul(x, w, b, HOPPER_GEMM_TILE, tiles), (
            bf16(rows, d + HOPPER_GEMM_TILE), bf16(d, 4 * d), bf16(4 * d))
    with autocast.compiling_for("gpu"):
        jax.jit(call).lower(*args).compile()


def row(kernel: str, tiles_text: str, rows: int, d: int, vocab: int) -> tuple[str, bool, list[str]]:
    """A table row for one setting, from a child process's ptxas report; whether the setting failed; ptxas's notes."""
    child = subprocess.run([sys.executable, "-m", "benchmarks.kernel_registers", "--one", kernel, tiles_text,
                            f"--rows={rows}", f"--d={d}", f"--vocab={vocab}"], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "MOSAIC_GPU_DUMP_PTXAS": "1"})
    name = f"| {kernel} | {tiles_text} |"
    figures = ptxas_figures(child.stdout)
    if child.returncode != 0 or figures is None:
        why = (child.stderr.strip().splitlines() or ["no ptxas report"])[-1][:160]
        return f"{name} {'refused' if child.returncode else 'no ptxas report'}: {why} | | |", True, []
    return (f"{name} {figures['spill_stores']} / {figures['spill_loads']} | {figures['stack']} | "
            f"{', '.join(figures['notes']) or '-'} |"), costs_speed(figures), figures["notes"]


def costs_speed(figures: dict) -> bool:
    """Whether ptxas's figures for a kernel say its setting runs slower than its bytes and FLOPs: spills or a
    setting's loss note (not setmaxnreg ignored: the compile's, every setting's alike)."""
    return figures["spill_stores"] + figures["spill_loads"] > 0 or bool(LOSS_NOTES & set(figures["notes"]))


def table(rows: int, d: int, vocab: int, settings: dict[str, str]) -> tuple[str, list[str]]:
    """The table, and what failed: each setting that spills, draws a setting's loss note, is refused or prints no
    report, and the compile itself where it ignored setmaxnreg."""
    lines = [f"ptxas (sm_90a) on jaxtrain's Hopper gemm kernels, compiled ahead of time for an {TARGET}: c_proj's dx "
             f"gemm with GELU's backward (gelu: ({rows}, {d}) @ ({d}, {4 * d})), the head with the logsumexp "
             f"(head: ({rows}, {d}) @ ({d}, {vocab})), c_attn's dx (qkv: three ({rows}, {d}) @ ({d}, {d}) summed), "
             f"c_fc with the bias and GELU (fc: ({rows}, {d}) @ ({d}, {4 * d})); tiles m x n x stages x snake [x k]",
             "",
             "| kernel | tiles | spill stores / loads, bytes | stack frame, bytes | ptxas notes |",
             "|---|---|---|---|---|"]
    failed, ignored = [], False
    for kernel, tiles in settings.items():
        for tiles_text in tiles.split(","):
            line, bad, notes = row(kernel, tiles_text, rows, d, vocab)
            lines.append(line)
            ignored |= IGNORED_SETMAXNREG in notes
            if bad:
                failed.append(f"{kernel} {tiles_text}")
    if ignored:
        lines += ["", f"{IGNORED_SETMAXNREG}: this jax's compile has ptxas ignore setmaxnreg (jax 0.12's Mosaic GPU "
                  "through nvJitLink: benchmarks/NOTES.md), so each consumer thread keeps the launch bound's 168 "
                  "registers, not the 232 the tiles were sized for"]
        failed.append(f"setmaxnreg ignored ({IGNORED_SETMAXNREG})")
    return "\n".join(lines), failed


def main(argv: list[str]) -> None:
    ap = OneLineParser(prog="python -m benchmarks.kernel_registers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=positive_int, default=16384, help="tokens of a micro-batch on one GPU")
    ap.add_argument("--d", type=positive_int, default=768, help="the model's width")
    ap.add_argument("--vocab", type=positive_int, default=50304, help="the padded vocabulary (the head's n)")
    for kernel, tiles in DEFAULT_TILES.items():
        ap.add_argument(f"--{kernel}-tiles", default=tiles, help=f"the {kernel} kernel's settings, comma-separated "
                        "m x n x stages x snake (as its benchmark's --tiles); empty: none")
    ap.add_argument("--one", nargs=2, metavar=("KERNEL", "TILES"), help=argparse.SUPPRESS)  # a child's compile
    args = ap.parse_args(argv)
    if args.one:
        compile_one(*args.one, args.rows, args.d, args.vocab)
        return
    require_compiler(TARGET)
    settings = {k: getattr(args, f"{k}_tiles") for k in DEFAULT_TILES if getattr(args, f"{k}_tiles")}
    for tiles in settings.values():
        parse_tiles(tiles)  # a malformed setting: one line and exit 2, before any compile
    text, failed = table(args.rows, args.d, args.vocab, settings)
    print(text)
    if failed:
        raise SystemExit(f"failed: {'; '.join(failed)} (spills, a performance-loss note, refused, or no ptxas "
                         f"report)")


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
