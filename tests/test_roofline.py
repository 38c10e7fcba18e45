"""benchmarks/roofline.py: the HLO parser and the roofline arithmetic on a checked-in GPU module, without a GPU.

tests/data/roofline_tiny_h100.hlo.txt is the train step of configs/tiny.yaml at 1 layer, d_model 64, 2 heads,
seq_len 32, vocabulary 256, no biases, batch 4 in 2 micro-batches, compiled for an H100 without a GPU, cuBLAS for
every gemm:
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m benchmarks.roofline --config configs/tiny.yaml \
        --model.n_layer=1 --model.d_model=64 --model.n_head=2 --model.seq_len=32 --model.vocab_size=256 \
        --model.bias=false --data.batch_size=4 --optim.grad_accum_steps=2 --hlo OUT
then trimmed to < 200 KB: the module's debug tables (file names, stack frames) dropped, metadata kept as op_name on
fusions and custom calls only, layouts and /*index=*/ comments removed (the parser reads dtypes and dims only).
"""

import os
import subprocess
import sys

import pytest

from design_formulas import FP64
from benchmarks import roofline
from jaxtrain import target_devices
from jaxtrain.errors import UserError

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "roofline_tiny_h100.hlo.txt")
PEAK, BANDWIDTH = 989e12, 3.35e12
TOKENS, D, V, HEADS, T = 2 * 32, 64, 256, 2, 32  # per micro-batch: 2 sequences of 32


@pytest.fixture(scope="module")
def kernels():
    with open(FIXTURE) as f:
        return {k["name"]: k for k in roofline.roofline(f.read(), PEAK, BANDWIDTH)}


def test_cublas_gemm_flops_and_bytes(kernels):
    """custom-call.15, the c_attn gemm: (64 tokens x 64) @ (64 x 192) in bf16 to f32, in the micro-batch loop."""
    qkv = kernels["custom-call.15"]
    assert qkv["category"] == "matmul" and qkv["launches"] == 2  # the while body's known_trip_count: 2
    assert qkv["flops"] == 2 * TOKENS * (3 * D) * D
    assert qkv["bytes"] == TOKENS * D * 2 + D * 3 * D * 2 + TOKENS * 3 * D * 4  # s8[4194304] workspace not counted
    assert qkv["ms"] == pytest.approx(max(qkv["flops"] / PEAK, qkv["bytes"] / BANDWIDTH) * 1e3, rel=FP64)


def test_fusion_bytes_count_gathers_slices_and_in_place_updates(kernels):
    """loop_add_fusion.1 (token + position embedding): wte f32[256,64] read through a gather of 64 rows, wpe
    f32[32,64] through a gather of its 32 rows, the s32[2,2,32] window through a dynamic-slice of one micro-batch,
    the s32[] index whole; writes f32[2,32,64]. loop_slice_fusion reads f32[64,192] whole (it converts it before
    slicing) and writes three bf16[2,32,64]. loop_dynamic_update_slice_fusion writes one f32 into its f32[2]
    buffer in place: the buffer counts 0, the update 4 bytes, its two scalar operands 4 each."""
    embed = kernels["loop_add_fusion.1"]
    assert embed["bytes"] == 64 * 64 * 4 + 32 * 64 * 4 + 1 * 2 * 32 * 4 + 4 + 2 * 32 * 64 * 4
    assert embed["launches"] == 2 and embed["flops"] == 0 and embed["memory_bound"]
    assert kernels["loop_slice_fusion"]["bytes"] == 64 * 192 * 4 + 3 * 2 * 32 * 64 * 2
    assert kernels["loop_dynamic_update_slice_fusion"]["bytes"] == 4 + 4 + 4
    assert "gather" in embed["fuses"] and embed["op_name"].endswith("jvp()/add")


PICK = """HloModule m

%fused_pick (p0: bf16[100,50], p1: s32[10,2]) -> f32[10,1] {
  %p0 = bf16[100,50]{1,0} parameter(0)
  %c = f32[100,50]{1,0} convert(%p0)
  %b = f32[100,50]{1,0} bitcast(%c)
  %p1 = s32[10,2]{1,0} parameter(1)
  ROOT %g = f32[10,1]{1,0} gather(%b, %p1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0,1}, index_vector_dim=1, slice_sizes={1,1}
}

ENTRY %main (a: bf16[100,50], i: s32[10,2]) -> f32[10,1] {
  %a = bf16[100,50]{1,0} parameter(0)
  %i = s32[10,2]{1,0} parameter(1)
  ROOT %f = f32[10,1]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_pick
}
"""


def test_a_gather_through_a_convert_reads_only_what_it_gathers():
    """The loss's pick of each token's target logit: a gather of 10 elements from bf16 logits converted to f32
    first (XLA fuses the convert into the gather's operand) reads 10 bf16 values, 20 bytes, not the 100 x 50
    logits; plus the s32[10,2] indices and the f32[10,1] result. If the converted logits also fed a reduce, the
    fusion would read them whole."""
    (pick,) = roofline.roofline(PICK, PEAK, BANDWIDTH)
    assert pick["bytes"] == 10 * 2 + 10 * 2 * 4 + 10 * 4
    whole = PICK.replace("  ROOT %g = f32[10,1]", "  %r = f32[] reduce(%c, %p1)\n  ROOT %g = f32[10,1]")
    (pick_and_reduce,) = roofline.roofline(whole, PEAK, BANDWIDTH)
    assert pick_and_reduce["bytes"] == 100 * 50 * 2 + 10 * 2 * 4 + 10 * 4


HALF = """HloModule m

%fused_half (p0: bf16[8,6], p1: f32[8]) -> bf16[8,6] {
  %p0 = bf16[8,6]{1,0} parameter(0)
  %s = bf16[4,6]{1,0} slice(%p0), slice={[4:8], [0:6]}
  %c = f32[4,6]{1,0} convert(%s)
  %p1 = f32[8]{0} parameter(1)
  %t = f32[4]{0} slice(%p1), slice={[4:8]}
  %tb = f32[4,6]{1,0} broadcast(%t), dimensions={0}
  %d = f32[4,6]{1,0} subtract(%c, %tb)
  %b = bf16[4,6]{1,0} convert(%d)
  %i = s32[] constant(4)
  %z = s32[] constant(0)
  ROOT %u = bf16[8,6]{1,0} dynamic-update-slice(%p0, %b, %i, %z)
}

ENTRY %main (a: bf16[8,6], l: f32[8]) -> bf16[8,6] {
  %a = bf16[8,6]{1,0} parameter(0)
  %l = f32[8]{0} parameter(1)
  ROOT %f = bf16[8,6]{1,0} fusion(%a, %l), kind=kLoop, calls=%fused_half
}
"""


def test_an_update_in_place_reads_the_part_of_its_buffer_it_reads():
    """head_lse's gradient over the logits: the second half of a bf16[8,6] buffer, read through a slice, rewritten
    in place from itself and 4 of 8 f32 values: 24 elements read (48 bytes), 4 x 4 bytes, 48 bytes written; not
    the whole buffer read, nor none of it."""
    (half,) = roofline.roofline(HALF, PEAK, BANDWIDTH)
    assert half["bytes"] == 4 * 6 * 2 + 4 * 4 + 4 * 6 * 2


def test_attention_flops(kernels):
    """cuDNN's causal attention: 4*B*H*T*L*D/2 forward (B 2 sequences, 2 heads of 32, T = L = 32), 2.5x backward."""
    forward = 4 * 2 * HEADS * T * T * (D // HEADS) / 2
    assert kernels["dot_product_attention_fwd.0"]["flops"] == forward
    assert kernels["dot_product_attention_bwd.0"]["flops"] == 2.5 * forward
    assert kernels["dot_product_attention_fwd.0"]["category"] == "attention"


def test_a_hopper_gemm_kernel_counts_its_gemm_flops():
    """jaxtrain's Mosaic GPU gemms (hopper_gemm's name scope in the custom call's op_name): 2 m k n from the first
    two operands, (m, k) and (k, n), whatever the epilogue reads or writes besides; another Mosaic GPU call none."""
    param = lambda name, shape: roofline.Inst(name, shape, "parameter", [], "", False, None)
    comp = {"a": param("a", "bf16[256,64]"), "b": param("b", "bf16[64,512]"), "pre": param("pre", "bf16[256,512]")}
    attrs = 'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/transpose(jvp())/hopper_gemm/mpmd_map"}'
    call = roofline.Inst("cc", "bf16[256,512]", "custom-call", ["a", "b", "pre"], attrs, False, None)
    moved, flops = roofline.kernel_cost({"main": comp}, "main", call)
    assert flops == 2 * 256 * 64 * 512 and moved == (256 * 64 + 64 * 512 + 2 * 256 * 512) * 2
    other = call._replace(attrs=attrs.replace("/hopper_gemm/", "/norm/"))
    assert roofline.kernel_cost({"main": comp}, "main", other)[1] == 0
    # a wider than k (gelu_gemm's forward kernel reads the first k of c_fc's input and its 64 ones columns): k is b's
    wide = {**comp, "a": param("a", "bf16[256,128]")}
    assert roofline.kernel_cost({"main": wide}, "main", call)[1] == 2 * 256 * 64 * 512
    # a kernel of three pairs (qkv_grad's: a_1..a_3 (256, 64), then b_1..b_3 (64, 512)): each pair's 2 m k n
    pairs = {**comp, **{f"a{i}": param(f"a{i}", "bf16[256,64]") for i in (2, 3)},
             **{f"b{i}": param(f"b{i}", "bf16[64,512]") for i in (2, 3)}}
    three = call._replace(operands=["a", "a2", "a3", "b", "b2", "b3"],
                          attrs=attrs.replace("/hopper_gemm/", "/hopper_gemm_pairs3/"))
    assert roofline.kernel_cost({"main": pairs}, "main", three)[1] == 3 * 2 * 256 * 64 * 512


# jax 0.11.2's XLA wraps qkv_grad's kernel with the slices of its weight operand (a "dynamic-slice-fusion": the
# kernel reads the three w_i^T blocks where they lie), as in GPT-2 124M's step compiled for an H100 with that jax
SLICED_KERNEL = """HloModule m

%dynamic-slice-fusion (p0: bf16[192,64], p1: bf16[256,64], p2: bf16[256,64], p3: bf16[256,64]) -> bf16[256,64] {
  %p1 = bf16[256,64]{1,0} parameter(1)
  %p2 = bf16[256,64]{1,0} parameter(2)
  %p3 = bf16[256,64]{1,0} parameter(3)
  %p0 = bf16[192,64]{1,0} parameter(0)
  %s0 = bf16[64,64]{1,0} slice(%p0), slice={[0:64], [0:64]}
  %s1 = bf16[64,64]{1,0} slice(%p0), slice={[64:128], [0:64]}
  %s2 = bf16[64,64]{1,0} slice(%p0), slice={[128:192], [0:64]}
  ROOT %k = bf16[256,64]{1,0} custom-call(%p1, %p2, %p3, %s0, %s1, %s2), custom_call_target="mosaic_gpu_v2", \
metadata={op_name="jit(train_step)/transpose(jvp())/hopper_gemm_pairs3/anonymous/mpmd_map"}
}

ENTRY %main (w: bf16[192,64], g1: bf16[256,64], g2: bf16[256,64], g3: bf16[256,64]) -> bf16[256,64] {
  %w = bf16[192,64]{1,0} parameter(0)
  %g1 = bf16[256,64]{1,0} parameter(1)
  %g2 = bf16[256,64]{1,0} parameter(2)
  %g3 = bf16[256,64]{1,0} parameter(3)
  ROOT %f = bf16[256,64]{1,0} fusion(%w, %g1, %g2, %g3), kind=kCustom, calls=%dynamic-slice-fusion
}
"""


def test_a_kernel_fused_with_its_operands_slices_counts_its_gemm_flops():
    """The kernel inside the fusion: three pairs' 2 m k n (m 256, k 64, n 64), and the bytes of what it reads and
    writes (three (256, 64) gradients, the (192, 64) weight through its slices, the (256, 64) result)."""
    (kernel,) = roofline.roofline(SLICED_KERNEL, PEAK, BANDWIDTH)
    assert kernel["flops"] == 3 * 2 * 256 * 64 * 64
    assert kernel["bytes"] == (3 * 256 * 64 + 192 * 64 + 256 * 64) * 2


def test_category_sums(kernels):
    """The matmul row: 15 cuBLAS calls per micro-batch (5 weight gemms forward: c_attn, c_proj, c_fc, mlp.c_proj,
    the tied head; 2 each backward) x 2 micro-batches; their FLOPs 3x the forward's."""
    rows = list(kernels.values())
    text, sums = roofline.category_table(rows)
    forward = 2 * TOKENS * D * (3 * D + D + 4 * D + 4 * D + V)
    assert sums["matmul"]["launches"] == 30
    assert sums["matmul"]["tflop"] * 1e12 == pytest.approx(2 * 3 * forward, rel=FP64)
    attention_flops = 2 * 3.5 * 4 * 2 * HEADS * T * T * (D // HEADS) / 2
    assert sums["attention"]["tflop"] * 1e12 == pytest.approx(attention_flops, rel=FP64)
    assert sums["total"]["launches"] == sum(k["launches"] for k in rows)
    assert sums["total"]["ms"] == pytest.approx(sum(s["ms"] for c, s in sums.items() if c != "total"), rel=FP64)
    assert sums["total"]["gb"] == pytest.approx(sum(k["launches"] * k["bytes"] for k in rows) / 1e9, rel=FP64)
    assert text.splitlines()[0].startswith("| category | kernel launches per step | GB moved | TFLOP | roofline ms")
    assert f"| **total** | {sums['total']['launches']:,} |" in text


def test_top_table_groups_and_orders_memory_bound_kernels(kernels):
    text, best = roofline.top_table(list(kernels.values()), 5)
    assert len(best) == 5 and all(g["memory_bound"] for g in best)
    assert [g["ms_per_step"] for g in best] == sorted((g["ms_per_step"] for g in best), reverse=True)
    assert len(text.splitlines()) == 2 + 5


def test_without_the_cuda_plugin_exits_2_naming_the_fix():
    if target_devices.compiler_installed("h100"):
        pytest.skip("jax's CUDA plugin is installed here: the error path needs an environment without it")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.roofline", "--config", "configs/tiny.yaml",
                           "--model.vocab_size=256"], capture_output=True, text=True, timeout=300)
    import jax
    assert proc.returncode == 2, proc.stderr
    assert f'pip install "jax[cuda12]=={jax.__version__}"' in proc.stderr and "CUDA plugin" in proc.stderr


@pytest.mark.skipif(not target_devices.compiler_installed("h100"), reason="needs jax's CUDA plugin")
def test_one_tiny_compile(tmp_path):
    out = tmp_path / "roofline.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.roofline", "--config", "configs/tiny.yaml",
                           "--model.n_layer=1", "--model.vocab_size=256", "--top", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "| **total** |" in proc.stdout and "memory_analysis peak" in proc.stdout and out.exists()


def test_a_gpu_is_known_by_the_device_kind_its_spec_names():
    """benchmarks.profile's roofline beside the kernels finds the GPU's spec by jax's device_kind (the spec's
    device_description_str), and its bandwidth there, without the nvidia wheels that target_config reads."""
    assert roofline.gpu_target("NVIDIA H100 80GB HBM3") == "h100"
    assert roofline.gpu_target("NVIDIA H200 141GB HBM3e") == "h200"
    assert roofline.gpu_target("NVIDIA H200") == "h200"  # the name some drivers report for the same card
    assert roofline.gpu_target("NVIDIA H100 PCIe") is None and roofline.gpu_target("cpu") is None
    assert roofline.gpu_target("NVIDIA H200 NVL") is None  # another card (PCIe, lower clocks): not the SXM's spec
    assert roofline.memory_bandwidth("h200") == 4_800_000_000_000
    assert roofline.memory_bandwidth("h100") == 3_352_320_000_000  # the spec's memory_bandwidth, bytes/s


def test_on_a_gpu_the_estimate_takes_that_gpus_bandwidth_not_the_targets():
    """On a machine with a GPU the step compiles for it, and the estimate takes its spec: --target's (default
    h100) was taken, so an H200's memory-bound kernels were estimated at 3.35 TB/s, not 4.8. A GPU no spec names
    is refused, not estimated at another's bandwidth."""
    assert roofline.local_target("NVIDIA H200") == "h200"
    assert roofline.local_target("NVIDIA H100 80GB HBM3") == "h100"
    with pytest.raises(UserError, match="^this machine's GPU, NVIDIA L40, has none of the XLA device specs .* "
                                        "with --target$"):
        roofline.local_target("NVIDIA L40")
