"""benchmarks/kernel_registers.py: ptxas's report of the Hopper gemm kernels, compiled ahead of time without a GPU;
its parser on a report as ptxas writes it, and, where jax's CUDA plugin is installed, the four kernels' default
tile settings free of spills against a setting whose accumulator cannot fit (256 fp32 registers a thread of 232)."""

import subprocess
import sys

import jax
import pytest

from benchmarks import kernel_registers
from jaxtrain import target_devices

# ptxas's report of c_proj's dx kernel at 128 x 256 tiles (jax 0.10.2's CUDA plugin), lines as it wrote them
SPILLING = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 863 by compiler to allow use of "
            "registers in GMMA in function 'anonymous_mosaic_gpu_kernel'\n"
            "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "insufficient register resources for the wgmma pipeline in the function 'anonymous_mosaic_gpu_kernel'\n"
            "ptxas info    : 0 bytes gmem\n"
            "ptxas info    : Compiling entry function 'anonymous_mosaic_gpu_kernel' for 'sm_90a'\n"
            "ptxas info    : Function properties for anonymous_mosaic_gpu_kernel\n"
            "    720 bytes stack frame, 1232 bytes spill stores, 1232 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem\n"
            "ptxas info    : Compile time = 336.366 ms\n")

needs_plugin = pytest.mark.skipif(not target_devices.compiler_installed("h100"),
                                  reason="needs jax's CUDA plugin (no GPU)")


def test_the_report_is_read_as_ptxas_writes_it():
    assert kernel_registers.ptxas_figures(SPILLING) == {"stack": 720, "spill_stores": 1232, "spill_loads": 1232,
                                                        "notes": ["C7511", "C7519"]}
    assert kernel_registers.ptxas_figures("compiled, but ptxas said nothing") is None


# jax 0.12.0.1's compile of jax's own Hopper matmul example (where nvJitLink is installed): no spill, setmaxnreg
# ignored; the same report without that note, as jax 0.10.2's; and with wgmma serialized for extern calls instead
IGNORED_SETMAXNREG = (
    "ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility across "
    "compilation units.\n"
    "ptxas info    : (C7519) warpgroup.arrive is injected in around line 738 by compiler to allow use of registers "
    "in GMMA in function 'anonymous_mosaic_gpu_kernel'\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
CLEAN = IGNORED_SETMAXNREG.split("\n", 1)[1]
SERIALIZED = ("ptxas info    : (C7509) Potential Performance Loss: wgmma.mma_async instructions are serialized "
              "due to the presence of Extern calls in the function 'anonymous_mosaic_gpu_kernel'\n" + CLEAN)


@pytest.mark.parametrize("report,slower", [(SPILLING, True), (SERIALIZED, True), (CLEAN, False),
                                           (IGNORED_SETMAXNREG, False)])
def test_spills_and_a_settings_loss_notes_fail_it_and_the_compiles_note_does_not(report, slower):
    assert kernel_registers.costs_speed(kernel_registers.ptxas_figures(report)) == slower


def test_setmaxnreg_ignored_is_named_once_for_the_compile(monkeypatch):
    """Two clean settings from a compile that ignored setmaxnreg: neither fails on its own, the compile does, once,
    and the table says why under it."""
    report = kernel_registers.ptxas_figures(IGNORED_SETMAXNREG)
    monkeypatch.setattr(kernel_registers, "row", lambda kernel, tiles, *_: (
        f"| {kernel} | {tiles} | 0 / 0 | 0 | C7504, C7519 |", kernel_registers.costs_speed(report), report["notes"]))
    text, failed = kernel_registers.table(16384, 768, 50304, {"qkv": "128x128x2x8x32,64x128x2x8x32"})
    assert failed == ["setmaxnreg ignored (C7504)"]
    assert text.splitlines()[-1].startswith("C7504: this jax's compile has ptxas ignore setmaxnreg")


def run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.kernel_registers", *flags], capture_output=True,
                          text=True, timeout=900)


def _rows(proc) -> dict:
    """(kernel, tiles) -> (spill stores / loads, ptxas notes) of the command's table."""
    lines = [line.split("|") for line in proc.stdout.splitlines()
             if line.startswith(("| gelu", "| head", "| qkv", "| fc"))]
    return {(cells[1].strip(), cells[2].strip()): (cells[3].strip(), cells[5].strip()) for cells in lines}


@needs_plugin
def test_the_default_tiles_do_not_spill():
    rows = _rows(run("--gelu-tiles=128x128x4x8", "--head-tiles=128x192x2x8", "--qkv-tiles=128x128x2x8x32",
                     "--fc-tiles=128x128x4x8"))
    if any("C7504" in notes for _, notes in rows.values()):
        pytest.skip("this jax's Mosaic GPU compile has ptxas ignore setmaxnreg (C7504: jax 0.12 through nvJitLink, "
                    "benchmarks/NOTES.md): no kernel gets the registers its tiles were sized for")
    defaults = [("gelu", "128x128x4x8"), ("head", "128x192x2x8"), ("qkv", "128x128x2x8x32"), ("fc", "128x128x4x8")]
    assert [rows[setting][0] for setting in defaults] == ["0 / 0"] * 4


@needs_plugin
def test_an_oversized_accumulator_spills_and_fails():
    """128 x 256: 256 fp32 accumulator registers a consumer thread, beyond the 232 it gets (168 where setmaxnreg is
    ignored)."""
    proc = run("--gelu-tiles=128x256x2x8", "--head-tiles=", "--qkv-tiles=", "--fc-tiles=")
    stores, loads = map(int, _rows(proc)[("gelu", "128x256x2x8")][0].split(" / "))
    assert stores > 0 and loads > 0
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("failed: gelu 128x256x2x8")


def test_without_the_cuda_plugin_exits_2_naming_the_fix():
    if target_devices.compiler_installed("h100"):
        pytest.skip("jax's CUDA plugin is installed here: the error path needs an environment without it")
    proc = run("--head-tiles=")
    assert proc.returncode == 2 and f'pip install "jax[cuda12]=={jax.__version__}"' in proc.stderr
