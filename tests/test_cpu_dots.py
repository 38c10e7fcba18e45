"""model.cpu_dots: which machines run the bf16 step's dots as XLA:CPU's oneDNN dots (kernel_choice.onednn_dots), the
compile options that ask XLA for them (step.compiler_options), and the step traced for them: every dot writes its
bf16 result. Where this jaxlib hands oneDNN bf16 dots whole (>= 0.11), the compiled step too, and a short run
against the same run on XLA's default dots."""

import collections
import io
import json
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import compiled_hlo
from jaxtrain import config, kernel_choice, run, step
from jaxtrain.errors import UserError

V = 64
ONEDNN = {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
          "xla_allow_excess_precision": False}  # by hand: XLA's names for oneDNN's dots, and every rounding kept
JAXLIB_TAKES_BF16 = tuple(int(part) for part in jaxlib.__version__.split(".")[:2]) >= (0, 11)


def tiny(*overrides) -> config.Config:
    return config.load(["--data.batch_size=8", "--model.n_layer=2", "--model.d_model=32", "--model.n_head=2",
                        "--model.seq_len=16", f"--model.vocab_size={V}", "--optim.grad_accum_steps=2",
                        "--train.precision=bf16", *overrides])


@pytest.fixture
def machine(monkeypatch):
    """Sets the machine onednn_dots sees: whether its CPU has bf16 matmul units (AMX, AVX-512 bf16), and the jaxlib
    version."""
    def set_machine(bf16_units: bool, jaxlib_version: str):
        monkeypatch.setattr(kernel_choice, "_cpu_has_bf16_matmul_units", lambda: bf16_units)
        monkeypatch.setattr(jaxlib, "__version__", jaxlib_version)
    return set_machine


@pytest.mark.parametrize("cpu_dots,precision,platform,bf16_units,jaxlib_version,want", [
    ("auto", "bf16", "cpu", True, "0.11.0", True), ("auto", "bf16", "cpu", True, "0.12.0.1", True),
    ("auto", "bf16", "cpu", True, "1.0.0", True), ("auto", "bf16", "cpu", True, "0.10.2", False),
    ("auto", "bf16", "cpu", False, "0.12.0.1", False), ("auto", "fp32", "cpu", True, "0.12.0.1", True),
    ("auto", "fp32", "cpu", True, "0.10.2", False), ("auto", "fp32", "cpu", False, "0.12.0.1", False),
    ("auto", "fp16", "cpu", True, "0.12.0.1", False), ("auto", "bf16", "gpu", True, "0.12.0.1", False),
    ("xla", "bf16", "cpu", True, "0.12.0.1", False), ("onednn", "bf16", "cpu", False, "0.11.0", True),
    ("onednn", "fp32", "cpu", False, "0.12.0.1", True)])
def test_onednn_dots_where_the_cpu_has_bf16_units(cpu_dots, precision, platform, bf16_units, jaxlib_version, want,
                                                  machine):
    """auto picks oneDNN's dots for a bf16 or fp32 step on a CPU with bf16 matmul units under a jaxlib from 0.11,
    and nowhere else; onednn wherever it can run; xla never: the cases written out by hand."""
    machine(bf16_units, jaxlib_version)
    with compiled_hlo.traced_for(platform):
        assert kernel_choice.onednn_dots(tiny(f"--model.cpu_dots={cpu_dots}").model, precision) == want


@pytest.mark.parametrize("flags,want", [
    ("fpu avx2 avx512f avx512_bf16 avx512_vnni", True),  # an AMD EPYC (Zen 4), as this project's /proc/cpuinfo
    ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", True), ("fpu amx_bf16", True),  # Intel Xeons with AMX
    ("fpu avx2 avx512f avx512_vnni", False), ("fpu avx2 amx_tile", False), ("", False)])
def test_the_cpus_bf16_units_are_read_from_its_first_processors_flags(flags, want, monkeypatch):
    """Where /proc/cpuinfo's first processor lists amx_bf16 or avx512_bf16, the CPU has bf16 matmul units (what
    auto's oneDNN dots need); a second processor's flags are not read, and no /proc/cpuinfo means none."""
    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu avx512_bf16 amx_bf16\n"
    monkeypatch.setattr(kernel_choice, "open", lambda path: io.StringIO(cpuinfo), raising=False)
    assert kernel_choice._cpu_has_bf16_matmul_units.__wrapped__() == want

    def missing(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(kernel_choice, "open", missing, raising=False)
    assert kernel_choice._cpu_has_bf16_matmul_units.__wrapped__() is False


@pytest.mark.parametrize("precision,platform,jaxlib_version", [
    ("fp16", "cpu", "0.12.0.1"), ("bf16", "gpu", "0.12.0.1"), ("bf16", "cpu", "0.10.2"), ("fp32", "cpu", "0.10.2")])
def test_onednn_dots_where_they_cannot_run_are_a_user_error(precision, platform, jaxlib_version, machine):
    """Under fp16, off a CPU, or on a jaxlib that converts bf16 dots to fp32 around oneDNN: refused, naming what it
    needs and what was found."""
    machine(True, jaxlib_version)
    with compiled_hlo.traced_for(platform), pytest.raises(UserError) as refused:
        kernel_choice.onednn_dots(tiny("--model.cpu_dots=onednn").model, precision)
    assert str(refused.value) == (
        f"model.cpu_dots=onednn needs train.precision=bf16 or fp32 on a CPU and jaxlib >= 0.11 (Python >= 3.12), "
        f"whose XLA hands oneDNN bf16 dots as they are (got {precision} on {platform}, jaxlib {jaxlib_version}); "
        f"use model.cpu_dots=auto")


def test_the_step_compiles_with_onednns_dots_where_they_are_picked_never_over_xla_flags(machine, monkeypatch):
    """The step's compile options on a CPU with bf16 matmul units under jaxlib 0.12: oneDNN's dots and (under bf16)
    every rounding kept for cpu_dots=auto; nothing for xla; and a flag the user's XLA_FLAGS set is left to them."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    machine(True, "0.12.0.1")
    assert step.compiler_options(tiny()) == ONEDNN
    assert step.compiler_options(tiny("--model.cpu_dots=xla")) == {}
    assert step.compiler_options(tiny("--train.precision=fp32")) == {
        k: v for k, v in ONEDNN.items() if k != "xla_allow_excess_precision"}  # fp32 writes no rounding
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_onednn=false")
    assert step.compiler_options(tiny()) == {k: v for k, v in ONEDNN.items() if k != "xla_cpu_use_onednn"}


def _warnings_of_a_onednn_compile(note_first: config.Config | None) -> list[str]:
    """The warnings of one compile of a bf16 dot as oneDNN's, every jit compile offered to jax's persistent cache;
    step.uncached_dots_note(note_first) called just before it, where given. Filters restored after."""
    a = jnp.ones((64, 64), jnp.bfloat16)
    previous = jax.config.jax_persistent_cache_min_compile_time_secs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        try:
            if note_first is not None:
                step.uncached_dots_note(note_first)
            jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.bfloat16)).lower(a).compile(ONEDNN)
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)
    return [str(w.message) for w in caught]


def test_a_persistent_cache_gets_one_note_in_place_of_jaxs_warning_at_each_compile(machine):
    """jax's persistent compilation cache on (this suite's: conftest.py), oneDNN's dots picked: XLA cannot store the
    step, jax warns at each compile; uncached_dots_note says it once, with what caches it, and silences the warning.
    No note for XLA's dots, nor without the cache."""
    assert jax.config.jax_compilation_cache_dir
    machine(True, "0.12.0.1")
    unsilenced = _warnings_of_a_onednn_compile(None)
    assert any("ToProto is not implemented for thunk kind: onednn-fusion" in w for w in unsilenced), unsilenced
    assert _warnings_of_a_onednn_compile(tiny()) == []
    assert step.uncached_dots_note(tiny()) == (
        "note: XLA cannot store a step whose dots are oneDNN's (model.cpu_dots=auto) in jax's persistent compilation "
        f"cache ({jax.config.jax_compilation_cache_dir}): it compiles each run; --model.cpu_dots=xla caches it, on "
        "XLA's default dots instead")
    assert step.uncached_dots_note(tiny("--model.cpu_dots=xla")) is None
    cache = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert step.uncached_dots_note(tiny()) is None
    finally:
        jax.config.update("jax_compilation_cache_dir", cache)


def test_every_step_jitted_for_onednns_dots_under_the_cache_says_so_once(machine, capsys):
    """The note comes from where the steps are jitted (step._jit_as_the_step), so that a run, a dry run and a
    benchmark all say it: once a process for the train and eval steps together, and not for XLA's dots."""
    machine(True, "0.12.0.1")
    step._print_once.cache_clear()
    step.jit_train_step(tiny(), 0), step.jit_eval_step(tiny())
    assert capsys.readouterr().err.count("note: XLA cannot store a step whose dots are oneDNN's") == 1
    step._print_once.cache_clear()
    step.jit_train_step(tiny("--model.cpu_dots=xla"), 0), step.jit_eval_step(tiny("--model.cpu_dots=xla"))
    assert capsys.readouterr().err == ""


def _lowered_dots(cfg: config.Config, train: bool) -> collections.Counter:
    """The (lhs, rhs, result) element types of the dots of cfg's train step (or eval step), as jit lowers it."""
    abstract, window = jax.eval_shape(lambda: step.fresh_state(cfg, V)), jax.ShapeDtypeStruct((2, 4, 16), jnp.int32)
    jitted = step.jit_train_step(cfg, 0) if train else step.jit_eval_step(cfg)
    lowered = jitted.lower(abstract if train else abstract.params, window, window)
    return collections.Counter(compiled_hlo.dot_types(lowered.as_text()))


@pytest.mark.parametrize("train", [True, False])
def test_the_step_traced_for_onednn_writes_every_dot_in_bf16(train, machine):
    """Traced for oneDNN's dots (the step's own jit: step.traced_for_dots), every dot of the train and eval steps
    writes its bf16 result from bf16 operands, the weights' gradients and the attention's too (an fp32 result XLA
    hands oneDNN on fp32 copies, off the CPU's bf16 units); traced for XLA's default dots, every one writes fp32
    and is rounded after it."""
    machine(True, "0.12.0.1")
    assert set(_lowered_dots(tiny(), train)) == {("bf16", "bf16", "bf16")}
    assert set(_lowered_dots(tiny("--model.cpu_dots=xla"), train)) == {("bf16", "bf16", "f32")}


needs_jaxlib_0_11 = pytest.mark.skipif(not JAXLIB_TAKES_BF16, reason=(
    f"needs jaxlib >= 0.11 (Python >= 3.12), whose XLA:CPU hands oneDNN bf16 dots whole; this is {jaxlib.__version__}"))


@needs_jaxlib_0_11
@pytest.mark.parametrize("precision,dtype", [("bf16", "bf16"), ("fp32", "f32")])
def test_the_compiled_step_runs_its_dots_in_onednn(precision, dtype):
    """The step compiled with cpu_dots=onednn: every dot in a oneDNN fusion, under bf16 on bf16 operands with a
    bf16 result (jaxlib 0.10.2 put converts to fp32 around them); with xla, no oneDNN fusion. XLA keeps oneDNN's
    smallest dots (a few million multiply-adds: tiny()'s) on fp32 copies, so this model is a little larger: 512
    tokens a micro-batch, d_model 128."""
    for cpu_dots, onednn in (("onednn", True), ("xla", False)):
        cfg = config.load(["--data.batch_size=8", "--model.n_layer=1", "--model.d_model=128", "--model.n_head=2",
                           "--model.seq_len=128", "--model.vocab_size=256", "--optim.grad_accum_steps=2",
                           f"--train.precision={precision}", f"--model.cpu_dots={cpu_dots}"])
        abstract = jax.eval_shape(lambda: step.fresh_state(cfg, 256))
        window = jax.ShapeDtypeStruct((2, 4, 128), jnp.int32)
        hlo = step.jit_train_step(cfg, 0).lower(abstract, window, window).compile().as_text()
        dots = [shapes for opcode, _, shapes in compiled_hlo.instructions(hlo) if opcode == "dot"]
        # 6 Linear dots a micro-step's layer, 3 the head's (the HLO's metadata names this test: "%onednn_fusion")
        assert len(dots) >= 20 and ("%onednn_fusion" in hlo) == onednn
        if onednn:
            assert all(shape.startswith(f"{dtype}[") for shapes in dots for shape in shapes), dots


@needs_jaxlib_0_11
@pytest.mark.parametrize("precision,bound", [("bf16", 5e-3), ("fp32", 2e-5)])
def test_a_run_on_onednns_dots_follows_the_run_on_xlas(precision, bound, tmp_path):
    """The tiny config's first 30 steps under cpu_dots=onednn and =xla: the same math summed in another order, so
    the losses part only as the roundings compound. Measured on a 2-core AMX Xeon (jax 0.12.0.1), the largest gap
    over the 30 losses (of about 4.2 to 2.9): bf16 1.4e-4, the bound 35x that; fp32 4.8e-7, the bound 40x; on a
    2-core AMD EPYC (Zen 4, AVX-512 bf16; losses 5.3 to 3.2): bf16 9.4e-5, fp32 4.8e-7. A bias dropped from the
    gemm, or a rounding, would move them by more."""
    losses = {}
    for cpu_dots in ("onednn", "xla"):
        out = tmp_path / cpu_dots
        run.main(["--config", "configs/tiny.yaml", "--train.steps=30", "--optim.warmup_steps=5",
                  "--train.eval_every=0", "--log.sample_tokens=0", f"--run.out_dir={out}",
                  f"--model.cpu_dots={cpu_dots}", f"--train.precision={precision}"])
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[cpu_dots] = np.array([line["loss"] for line in lines if "loss" in line])
    assert len(losses["onednn"]) == 30
    gap = np.max(np.abs(losses["onednn"] - losses["xla"]))
    assert gap < bound, gap
