"""benchmarks/xla_flags.py: flag parsing, collective group sizes and transfers, the schedule's overlap on hand-made
scheduled modules (expected values worked out by hand below), the module comparison, and one run end to end on fake
CPU devices."""

import os
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from design_formulas import FP64
from benchmarks import xla_flags
from jaxtrain.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two collectives on 8 devices and one in a loop of 3 trips. Each fusion reads and writes f32[1024] (4096 bytes
# each way): at 8.192e6 bytes/s that is 1 ms. An all-gather to f32[1024] over 8 devices sends 4096 * 7/8 = 3584
# bytes per device: at 1.792e6 bytes/s, 2 ms.
SCHEDULED_GPU = """HloModule m, is_scheduled=true

%fused_add (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %add = f32[1024]{0} add(%p0, %p0)
}

%body (bp: (f32[128], s32[])) -> (f32[128], s32[]) {
  %bp = (f32[128]{0}, s32[]) parameter(0)
  %x = f32[128]{0} get-tuple-element(%bp), index=0
  %ags.2 = (f32[128]{0}, f32[1024]{0}) all-gather-start(%x), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  %agd.2 = f32[1024]{0} all-gather-done(%ags.2)
  %i = s32[] get-tuple-element(%bp), index=1
  ROOT %bt = (f32[128]{0}, s32[]) tuple(%x, %i)
}

%cond (cp: (f32[128], s32[])) -> pred[] {
  %cp = (f32[128]{0}, s32[]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[128], b: f32[1024]) -> (f32[1024], f32[1024], f32[1024]) {
  %a = f32[128]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%a), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %f = f32[1024]{0} fusion(%b), kind=kLoop, calls=%fused_add
  %agd = f32[1024]{0} all-gather-done(%ags)
  %ags.1 = (f32[128]{0}, f32[1024]{0}) all-gather-start(%a), replica_groups={{0,1,2,3,4,5,6,7}}
  %agd.1 = f32[1024]{0} all-gather-done(%ags.1)
  %g = f32[1024]{0} fusion(%f), kind=kLoop, calls=%fused_add
  %init = (f32[128]{0}, s32[]) tuple(%a, %a)
  %w = (f32[128]{0}, s32[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (f32[1024]{0}, f32[1024]{0}, f32[1024]{0}) tuple(%agd, %agd.1, %g)
}
"""

# XLA:TPU's shapes: a collective in a fusion named async-collective-start, one in a computation named
# async_collective_fusion, a collective-permute's start and done, and an all-gather on its own in the entry.
SCHEDULED_TPU = """HloModule m, is_scheduled=true

%fused_computation.1 (p: f32[8]) -> f32[64] {
  %p = f32[8]{0} parameter(0)
  ROOT %ag = f32[64]{0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
}

%async_collective_fusion.1 (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%q), replica_groups=[1,8]<=[8], to_apply=%sum
}

ENTRY %main (a: f32[8]) -> (f32[64], f32[8], f32[64]) {
  %a = f32[8]{0} parameter(0)
  %async-collective-start = f32[64]{0} fusion(%a), kind=kCustom, calls=%fused_computation.1
  %fusion.2 = f32[8]{0} fusion(%a), kind=kCustom, calls=%async_collective_fusion.1
  %alone = f32[64]{0} all-gather(%a), replica_groups=[1,8]<=[8], dimensions={0}
  %cps = (f32[8]{0}, f32[8]{0}) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8]{0} collective-permute-done(%cps)
  ROOT %t = (f32[64]{0}, f32[8]{0}, f32[64]{0}) tuple(%async-collective-start, %fusion.2, %alone)
}
"""


def test_parse_flags_types_values_as_xla_does():
    options = xla_flags.parse_flags("--xla_a=true --xla_b=False --xla_c --xla_d=1073741824 --xla_e=rematerialization")
    assert options == {"xla_a": True, "xla_b": False, "xla_c": True, "xla_d": 1073741824, "xla_e": "rematerialization"}


@given(st.text(alphabet=st.characters(blacklist_categories=("Zs", "Cc")), min_size=1).filter(
    lambda s: not s.startswith("--xla_") and s.strip() == s))
def test_parse_flags_refuses_what_is_not_an_xla_flag(word):
    with pytest.raises(UserError, match="is not an XLA flag"):
        xla_flags.parse_flags(word)


def test_group_size_reads_each_replica_group_form():
    assert xla_flags.group_size("replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, x", 8) == 8
    assert xla_flags.group_size("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", 8) == 8
    assert xla_flags.group_size("replica_groups=mesh['axis_0'=8,'axis_1'=8], device_ids=([8,8]T(1,0)) {'axis_0'}",
                                64) == 8
    assert xla_flags.group_size("replica_groups=[2,4]<=[8]", 8) == 4
    assert xla_flags.group_size("replica_groups={{0,1,2},{3,4,5}}", 6) == 3
    assert xla_flags.group_size("replica_groups={}", 16) == 16  # none named: every device


def test_link_bytes_are_a_rings():
    assert xla_flags.link_bytes("all-gather", 800, 8) == 700  # 7 of the 8 shards arrive
    assert xla_flags.link_bytes("reduce-scatter", 100, 8) == 700  # the result is one shard of 8
    assert xla_flags.link_bytes("all-reduce", 800, 8) == 1400  # a reduce-scatter, then an all-gather
    assert xla_flags.link_bytes("all-gather", 800, 1) == 0


def test_gpu_collectives_sets_each_transfer_against_the_compute_under_it():
    """1 ms of fusion under the first all-gather (2 ms of transfer: 1 exposed), nothing under the second (2 ms
    exposed), and the loop's all-gather 3 times with nothing under it (6 ms); compute: the two fusions."""
    got = xla_flags.gpu_collectives(SCHEDULED_GPU, peak=1e15, bandwidth=8.192e6, link=1.792e6, devices=8)
    assert got["collectives"] == 2 + 3
    assert got["transfer_ms"] == pytest.approx(5 * 2.0, rel=FP64)
    assert got["exposed_ms"] == pytest.approx(1.0 + 2.0 + 3 * 2.0, rel=FP64)
    assert got["compute_ms"] == pytest.approx(2.0, rel=FP64) and got["tflop"] == 0


def test_tpu_collectives_counts_those_in_async_collective_fusions():
    assert xla_flags.tpu_collectives(SCHEDULED_TPU) == {"asynchronous": 3, "synchronous": 1}


def test_canonical_ignores_numbering_and_metadata_not_the_program():
    a = ('HloModule jit_f, entry_computation_layout={()->f32[]}\n\nFileNames\n1 "model.py"\n2 "step.py"\n\n'
         'ENTRY %main.7 (param_0.1006: f32[4]) -> f32[4] {\n'
         '  %param_0.1006 = f32[4]{0} parameter(0), metadata={op_name="a"}\n'
         '  ROOT %neg.3 = f32[4]{0} negate(%param_0.1006), metadata={op_name="b" scheduling_name="neg.3"}\n}\n')
    renumbered = (a.replace("jit_f", "jit_f_1").replace("1006", "1031").replace("neg.3", "neg.9").replace('"a"', '"c"')
                  .replace('1 "model.py"\n2 "step.py"', '1 "step.py"\n2 "model.py"'))
    assert xla_flags.canonical(a) == xla_flags.canonical(renumbered)
    assert xla_flags.canonical(a) != xla_flags.canonical(a.replace("negate", "abs"))


def test_end_to_end_on_fake_cpu_devices(tmp_path):
    """A GPU-only flag leaves XLA:CPU's module as it is; a CPU numerics flag (min and max without NaN checks)
    changes it, alone or with the other; an unknown one is refused in one line, exit code 2. --hlo writes each
    row's module, after an earlier run's are gone (its 9th would read as this run's), the folder's other files
    kept."""
    hlo_dir = tmp_path / "hlo"
    hlo_dir.mkdir()
    for name in ("9.hlo.txt", "notes.txt"):
        (hlo_dir / name).write_text("earlier")

    def run(flags):
        return subprocess.run(
            [sys.executable, "-m", "benchmarks.xla_flags", "--config", "configs/tiny.yaml", "--target", "cpu",
             "--devices", "2", "--mesh.fsdp=2", "--model.vocab_size=256", "--model.n_layer=1", f"--flags={flags}",
             "--each", "--all-but-each", f"--hlo={hlo_dir}"],  # one layer: 47 s of CPU here, 77 with tiny's four
            cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    done = run("--xla_gpu_enable_triton_gemm=false --xla_cpu_enable_fast_min_max=true")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(hlo_dir)) == [f"{row}.hlo.txt" for row in range(6)] + ["notes.txt"]
    assert "HloModule" in (hlo_dir / "5.hlo.txt").read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in done.stdout.splitlines()
            if line.startswith(("| --xla", "| all"))}
    assert rows["--xla_gpu_enable_triton_gemm=false"] == "same as default"
    assert rows["--xla_cpu_enable_fast_min_max=true"] == "differs"
    assert rows["all but --xla_cpu_enable_fast_min_max=true"] == "same as default"
    assert rows["all but --xla_gpu_enable_triton_gemm=false"] == "differs"
    assert rows["all 2 flags"] == "differs"
    refused = run("--xla_no_such_flag=1")
    assert refused.returncode == 2 and "No such compile option" in refused.stderr
    assert "Traceback" not in refused.stderr
