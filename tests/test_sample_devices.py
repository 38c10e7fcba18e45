"""Sampling on several devices: the end-of-run sample drawn from the params where the run holds them (each weight
split over its mesh), `jaxtrain.sample` on the machine's devices (--devices), each weight split as the run split it,
and the text the same as on one device; texts that need more memory than a device has refused in one line."""

import json
import os
import re
import subprocess
import sys
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from test_run import small_args
from read_counts import COUNTING
from jaxtrain import config, dryrun, model_source, run, sample
from jaxtrain.errors import UserError

PROMPT = "def "

# Trains the small model on this process's 4 devices (the run's mesh), recording the mesh of the params each sample
# is drawn from; then `jaxtrain.sample` on all of them, by default and on 1; then the bytes of weights a device holds
# in the compiled generator, there and on one device; then the refusals of weights too big to place or read on all 4
# (XLA's RESOURCE_EXHAUSTED). One JSON line each.
SCRIPT = """
import contextlib, io, json, sys
import jax, numpy as np, orbax.checkpoint as ocp
from jaxtrain import config, model, model_source, run, sample
from jaxtrain.errors import UserError
out_dir, *args = sys.argv[1:]
meshes, drawn = [], sample.drawer
""" + COUNTING + """

def recording(params, *rest, **options):
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)  # None: host arrays (gathered)
    meshes.append(dict(sharding.mesh.shape) if isinstance(sharding, jax.sharding.NamedSharding) else None)
    return drawn(params, *rest, **options)


sample.drawer = recording
out = io.StringIO()
with contextlib.redirect_stdout(out):
    run.train(config.load(args))
print(json.dumps({"mesh": meshes[-1], "out": out.getvalue()}))
for argv in [["--devices=4"], [], ["--devices=1"]]:
    out, err = io.StringIO(), io.StringIO()
    placements.clear()
    reads.clear()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sample.main(["--run", out_dir, "--prompt", "def ", "--max_new_tokens=40", *argv])
    print(json.dumps({"mesh": meshes[-1], "out": out.getvalue(), "err": err.getvalue(), "placed": placements,
                      "read": reads}))
for devices in (jax.devices(), jax.devices()[:1]):
    loaded = model_source.from_run(out_dir, None, None, "sample", devices)
    graphdef = model.graphdef(loaded.model_cfg, vocab_size=loaded.model_cfg.vocab_size, precision="fp32")
    prompts, whole = sample._whole_on_each_device(loaded.params, np.zeros((1, 4), np.int32))
    generate = sample.generator(graphdef, loaded.model_cfg, "fp32", sample.Sampling(max_new_tokens=8), None, whole)
    print(json.dumps({"bytes": generate.lower(loaded.params, prompts).compile().memory_analysis()
                     .argument_size_in_bytes}))


def out_of_memory(*args, **kwargs):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")


jax.device_put = ocp.PyTreeCheckpointHandler.restore = out_of_memory
refusals = []
for refused in (lambda: model_source.placed(loaded, jax.devices()),
                lambda: model_source.from_run(out_dir, None, None, "sample", jax.devices())):
    try:
        refused()
    except UserError as e:
        refusals.append(str(e))
print(json.dumps({"refusals": refusals}))
"""


def test_on_four_devices_the_sample_is_drawn_where_the_weights_are_and_reads_as_on_one(tmp_path, cache_dir):
    """A run on 4 (fake CPU) devices, data 2 x fsdp 2: its end-of-run sample is drawn from the params on the run's
    mesh (never gathered onto one device), and `jaxtrain.sample` of its checkpoint prints the same text on all 4
    devices (--devices 4: the run's layout), by default on the 2 that split each weight (fsdp 2: the other 2 would
    draw it again; the checkpoint read onto those 2 alone), and on 1: the same logits to fp32 rounding, the same
    keys. A device of the compiled generator holds half the weights' bytes (each weight split over fsdp 2; the small
    model's dimensions all even), one device all of them, counted here from the model's shapes written out."""
    out_dir = tmp_path / "run"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out_dir), *small_args(
        out_dir, cache_dir, "--mesh.fsdp=2", "--log.sample_tokens=40", f"--log.sample_prompt={PROMPT}")],
        env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    end_of_run, on_four, on_two, on_one, *held, refused = [json.loads(line) for line in proc.stdout.splitlines()
                                                            if line.startswith("{")]
    assert end_of_run["mesh"] == on_four["mesh"] == {"data": 2, "fsdp": 2}, end_of_run
    assert (on_two["mesh"], on_one["mesh"]) == ({"data": 1, "fsdp": 2}, {"data": 1, "fsdp": 1})
    assert [(on["read"], on["placed"]) for on in (on_four, on_two, on_one)] == [([4], [4]), ([2], [2]), ([1], [1])]
    text = end_of_run["out"].split("step 8: eval loss ")[1].split("\n", 1)[1]  # after the last step's eval line
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 1, end_of_run
    assert on_four["out"] == on_two["out"] == on_one["out"] == text, (on_four, on_two, on_one, text)
    assert on_four["err"].endswith(", seed 0, on 4 cpu devices (data 2 x fsdp 2)\n"), on_four
    assert on_two["err"].endswith(", seed 0, on 2 cpu devices (data 1 x fsdp 2)\n"), on_two
    assert on_one["err"].endswith(", seed 0\n"), on_one
    weights = 4 * gpt_params(n_layer=2, d=32, vocab=256, seq_len=32)  # fp32
    assert [h["bytes"] for h in held] == [weights // 2 + 16, weights + 16], held  # + the (1, 4) int32 prompts
    once = "one device (--devices 1: the host then holds the weights once), or a machine with more memory"
    assert refused["refusals"] == [  # data 2: each CPU device holds a copy of its half
        f"placing the weights of {out_dir} (each split over 2 of 4 devices) needs more memory than a device has; "
        f"load them onto {once}",
        f"checkpoint {out_dir}/checkpoints/8 needs more memory than a device has to be read (JaxRuntimeError: "
        f"RESOURCE_EXHAUSTED: Out of memory); read it onto {once}"], refused


@pytest.mark.parametrize("fsdp,devices,count", [(4, 3, 2), (2, 4, 2), (1, 4, 1), (6, 4, 3), (8, 8, 8), (3, 2, 1),
                                                (None, 4, 1)])
def test_by_default_it_samples_on_the_fewest_devices_that_split_each_weight_the_most(fsdp, devices, count):
    """A run of mesh.fsdp `fsdp` (None: a model without a run, whole on each) on `devices`: the largest divisor of
    fsdp up to their count, worked out here by hand (fsdp 4 on 3: 2 split each weight in half, 3 would not split
    it)."""
    run = None
    if fsdp is not None:
        run = config.Config()
        run.mesh.fsdp = fsdp
    machine = list(range(devices))
    assert sample._fewest_splitting(machine)(run) == machine[:count]


def gpt_params(n_layer: int, d: int, vocab: int, seq_len: int) -> int:
    """nanoGPT's GPT with biases, written out: token and position embeddings (the head tied to the first), per
    block two LayerNorms (weight, bias), c_attn (d x 3d), attn.c_proj (d x d), c_fc (d x 4d), mlp.c_proj (4d x d)
    with their biases, and ln_f."""
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + seq_len * d + n_layer * block + 2 * d


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, cache_dir):
    """The small model (2 layers, d_model 32, seq_len 32, bytes) trained 4 steps: its run folder."""
    out_dir = str(tmp_path_factory.mktemp("small"))
    run.train(config.load(small_args(out_dir, cache_dir, "--train.steps=4")))
    return out_dir


@pytest.mark.parametrize("texts,host,fix", [
    (1024, 2**20, r"lower --num_samples \(each text holds its own KV cache\)"),
    (1, 2**16, "one text is the least: sample on a machine with more memory")])
def test_texts_too_many_for_the_memory_are_refused_in_one_line(small_run, monkeypatch, capsys, texts, host, fix):
    """On a host of 1 MiB, 1,024 texts at once are refused before any is drawn, naming --num_samples; what they
    need is at least their KV caches (1,024 texts x 2 layers x keys and values x 32 positions x 32 wide x 4 bytes:
    16 MiB). One text, on a host of 64 KiB (the weights alone are 140 KB), names no lever it does not have."""
    monkeypatch.setattr(dryrun, "device_memory", lambda device: host)
    with pytest.raises(SystemExit) as exited:
        sample.main(["--run", small_run, "--num_samples", str(texts), "--max_new_tokens=8"])
    out, err = capsys.readouterr()
    said = re.fullmatch(rf"error: drawing {texts} texts? at a time needs (\d+\.\d+) GiB a device and this host "
                        rf"has 0\.00 GiB; {fix}\n", err)
    assert exited.value.code == 2 and said and not out, err
    kv_caches = texts * 2 * 2 * 32 * 32 * 4
    assert float(said[1]) >= round(kv_caches / 2**30, 2), err


@pytest.mark.parametrize("error,refused", [("RESOURCE_EXHAUSTED: Out of memory while trying to allocate", True),
                                           ("INTERNAL: an XLA bug", False)])
def test_out_of_memory_at_a_call_is_the_refusal_and_nothing_else_is(error, refused):
    def refusal(needs):
        return UserError(f"drawing 2 texts at a time {needs}")
    with pytest.raises(UserError if refused else jax.errors.JaxRuntimeError) as caught:
        with dryrun.out_of_memory(refusal):
            raise jax.errors.JaxRuntimeError(error)
    said = "drawing 2 texts at a time needs more memory than a device has" if refused else error
    assert str(caught.value) == said


@pytest.mark.parametrize("texts,devices,fix", [
    (4, 2, "lower --num_samples (each text holds its own KV cache), or compute on one device (--devices 1: the host "
           "then holds the KV caches, and what is not split, once)"),
    (1, 2, "compute on one device (--devices 1: the host then holds the KV caches, and what is not split, once)"),
    (4, 1, "lower --num_samples (each text holds its own KV cache)"),
    (1, 1, "one text is the least: sample on a machine with more memory")])
def test_the_refusal_names_the_levers_there_are(texts, devices, fix):
    """Fewer texts where there are several; on several CPU devices (which share the host's memory), one."""
    cpu_mesh = types.SimpleNamespace(size=devices, devices=np.array(jax.devices("cpu")[:1] * devices))
    refusal = sample._too_big(sample.Sampling(num_samples=texts), cpu_mesh, "needs 2.00 GiB a device and ...")
    said = f"drawing {texts} text{'s' if texts > 1 else ''} at a time needs 2.00 GiB a device and ...; {fix}"
    assert str(refusal) == said


@pytest.mark.parametrize("refused_by", ["allocator", "room left"])
def test_an_end_of_run_sample_the_allocator_refuses_names_the_command_that_draws_it(tmp_path, cache_dir,
                                                                                   monkeypatch, refused_by):
    """XLA's RESOURCE_EXHAUSTED when the end-of-run sample compiles, or devices that report no room left beside the
    trained state (a GPU's bytes_limit less its bytes_in_use; CPU devices report none): one line that says the run
    is saved and gives the `jaxtrain.sample` command drawing that same sample (its prompt quoted for the shell),
    and the run's last checkpoint is there."""
    class Refused:
        def lower(self, *args):
            return self

        def compile(self):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes")
    if refused_by == "allocator":
        monkeypatch.setattr(sample, "generator", lambda *args: Refused())
    else:
        monkeypatch.setattr(dryrun, "room_left", lambda device: 0)
    out_dir = str(tmp_path / "run")
    with pytest.raises(UserError) as refused:
        run.train(config.load(small_args(out_dir, cache_dir, "--log.sample_tokens=7", "--log.sample_prompt=it's",
                                         "--run.seed=3")))
    assert str(refused.value) == (
        f"the end-of-run sample (log.sample_tokens=7) needs more memory than a device has beside the trained state; "
        f"the run is trained and saved: draw it with `python -m jaxtrain.sample --run {out_dir} --prompt="
        f"""'it'"'"'s' --max_new_tokens 7 --seed 3`, or train without it: --log.sample_tokens=0""")
    assert "8" in os.listdir(os.path.join(out_dir, "checkpoints"))  # train.steps=8


def gpu(limit: float, in_use: float | None = None, block: float | None = None) -> types.SimpleNamespace:
    """A device that reports its memory as a GPU does (GiB; None: no bytes_in_use, no largest_free_block_bytes)."""
    stats = {"bytes_limit": int(limit * 2**30)} | ({} if in_use is None else {"bytes_in_use": int(in_use * 2**30)})
    stats |= {} if block is None else {"largest_free_block_bytes": int(block * 2**30)}
    return types.SimpleNamespace(platform="gpu", memory_stats=lambda: stats)


def test_the_room_a_device_has_left_is_its_limit_less_what_it_holds():
    assert dryrun.room_left(gpu(80, 70.5)) == int(80 * 2**30) - int(70.5 * 2**30)
    assert dryrun.room_left(gpu(80, 70, block=4)) == 4 * 2**30  # fragmented: its largest free block
    assert dryrun.room_left(gpu(80, 70, block=12)) == 10 * 2**30
    assert dryrun.room_left(gpu(16)) == 16 * 2**30  # nothing said in use
    assert dryrun.room_left(types.SimpleNamespace(platform="gpu", memory_stats=lambda: None)) is None
    assert dryrun.room_left(types.SimpleNamespace(platform="tpu", memory_stats=lambda: {"bytes_in_use": 1})) is None
    assert dryrun.room_left(jax.devices("cpu")[0]) is None


@pytest.mark.parametrize("rooms,said", [
    ((4.5, 5), None), ((5, 3.5), "needs 4.00 GiB a device beside what it holds and one has 3.50 GiB left"),
    ((), None)])
def test_what_the_sample_needs_beside_what_the_devices_hold(rooms, said):
    """3 GiB of temporaries and 1.5 of outputs, 0.5 of them donated in place: 4 GiB beside the 100 GiB of arguments
    the devices hold already, against the least room of this process's devices; none where none reports it."""
    analysis = types.SimpleNamespace(temp_size_in_bytes=3 * 2**30, output_size_in_bytes=int(1.5 * 2**30),
                                     alias_size_in_bytes=2**29, argument_size_in_bytes=100 * 2**30)
    compiled = types.SimpleNamespace(memory_analysis=lambda: analysis)
    mesh = types.SimpleNamespace(local_devices=[gpu(80, 80 - room) for room in rooms])
    assert dryrun.shortfall_beside(compiled, mesh) == said


@pytest.mark.parametrize("prompt", ["it's", "-x", "a\nb", "tab\there 'q' \\ $HOME", "é\x1b[0m\u2028", " "])
def test_the_prompt_of_that_command_reads_back_in_a_shell(prompt):
    """The end-of-run refusal's command holds the prompt on one line, and bash hands `jaxtrain.sample` the same
    text (a prompt of a new line, log.sample_prompt's default, printed a new line inside the one-line error)."""
    flag = sample._prompt_flag(prompt)
    assert "\n" not in flag and flag.startswith(" --prompt=")
    quoted = flag.removeprefix(" --prompt=")
    assert subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, text=True,
                          check=True).stdout == prompt
    assert sample._prompt_flag("\n") == ""  # sample's default prompt: the flag left out
    assert sample._prompt_flag("\n") == ""  # sample's default: the flag left out


OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4096 bytes."


def test_weights_too_big_to_read_are_refused_as_such_not_as_a_corrupt_checkpoint(small_run, monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED while orbax reads the weights onto the devices: one line that says the device's
    memory is short and where there is more, not that the checkpoint cannot be read with another step to try."""
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(OUT_OF_MEMORY)
    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", out_of_memory)
    with pytest.raises(SystemExit) as exited:
        sample.main(["--run", small_run])
    assert exited.value.code == 2 and capsys.readouterr().err == (
        f"error: checkpoint {small_run}/checkpoints/4 needs more memory than a device has to be read "
        f"(JaxRuntimeError: {OUT_OF_MEMORY}); read it onto a machine with more memory\n")  # (CPU devices share it)


def test_a_stores_resource_exhausted_is_no_device_memory(small_run, monkeypatch, capsys):
    """A bucket's rate limit (HTTP 429) or a full disk reach orbax as tensorstore's RESOURCE_EXHAUSTED, a ValueError:
    the checkpoint cannot be read now, with the steps to try, not a device's memory."""
    def rate_limited(*args, **kwargs):
        raise ValueError("RESOURCE_EXHAUSTED: Error reading \"params\": HTTP response code: 429")
    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", rate_limited)
    with pytest.raises(SystemExit):
        sample.main(["--run", small_run])
    assert capsys.readouterr().err.startswith(f"error: checkpoint {small_run}/checkpoints/4 cannot be read "
                                              f"(ValueError: RESOURCE_EXHAUSTED: Error reading")


def test_weights_too_big_to_place_are_refused_in_one_line(small_run, monkeypatch):
    """The same when weights read on the default device (a folder's) are split over the devices."""
    loaded = model_source.from_run(small_run, None, None, "sample")
    monkeypatch.setattr(model_source.jax, "device_put", lambda *args: (_ for _ in ()).throw(
        jax.errors.JaxRuntimeError(OUT_OF_MEMORY)))
    with pytest.raises(UserError) as refused:
        model_source.placed(loaded, jax.devices()[:1])
    assert str(refused.value) == (f"placing the weights of {small_run} (on one device) needs more memory than a "
                                  f"device has; load them onto a machine with more memory")


@pytest.mark.parametrize("fsdp,devices,layout", [(1, 1, "on one device"), (1, 4, "whole on each of 4 devices"),
                                                  (4, 4, "each split over 4 of 4 devices"),
                                                  (2, 8, "each split over 2 of 8 devices")])
def test_the_refusal_says_how_the_weights_lie(fsdp, devices, layout):
    assert model_source._layout(types.SimpleNamespace(size=devices, shape={"data": devices // fsdp, "fsdp": fsdp})
                                ) == layout


@pytest.mark.parametrize("platform,copies,where", [
    ("cpu", 1, "a machine with more memory"),
    ("cpu", 2, "one device (--devices 1: the host then holds the weights once), or a machine with more memory"),
    ("gpu", 1, "devices with more memory, or the host's (JAX_PLATFORMS=cpu)"),
    ("tpu", 4, "devices with more memory, or the host's (JAX_PLATFORMS=cpu)")])
def test_where_a_model_too_big_fits(platform, copies, where):
    """An accelerator's host has more memory than the accelerator; a CPU's devices already share their host's, and
    one device holds once what several hold a copy each of."""
    assert dryrun.more_memory(types.SimpleNamespace(platform=platform), copies) == where
