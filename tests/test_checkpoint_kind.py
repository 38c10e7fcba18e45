"""jaxtrain/checkpoint_kind.py on folders as the tools write them: a jaxtrain run saved by the Checkpointer (Orbax),
torch-format folders written by the converter, a torchref-style run of them, a Hugging Face folder from to-hf and
its from-hf conversion; each is told for what it is, and a tool given one of the wrong kind (--init.from of both
backends, from-torch, jaxtrain.sample, a run folder) names it and the command that takes it."""

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxtrain import (checkpoint, checkpoint_kind, checkpoint_model, config, convert, data, prepare, run, sample,
                      step, torch_format)
from jaxtrain.errors import UserError
from test_run import small_args
from torchref import checkpoint as torchref_checkpoint
from torchref import model as torchref_model
from torchref import run as torchref_run

V = 256
STEPS = (9, 10, 20)


def tiny_cfg(out_dir, *extra):
    return config.load(["--config", "configs/tiny.yaml", "--model.n_layer=1", "--model.d_model=32",
                        "--model.n_head=2", f"--model.vocab_size={V}", "--checkpoint.async_save=false",
                        f"--run.out_dir={out_dir}", *extra])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: path}: a jaxtrain run with steps 9, 10 and 20 (the newest is neither the first nor the last in name
    order), its newest step, a torch-format export of that state, and a torchref-style run of exports at the same
    steps, with a save of step 30 a kill cut short (named as a jaxtrain run took it to resume from); a Hugging Face
    folder that to-hf wrote of the export, and what from-hf makes of it."""
    root = tmp_path_factory.mktemp("kinds")
    cfg = tiny_cfg(root / "jaxtrain-run", "--checkpoint.max_to_keep=3")
    fresh = step.fresh_state(cfg, V)
    saver = checkpoint.Checkpointer(cfg)
    for at in STEPS:
        saver.save(fresh._replace(opt_state=fresh.opt_state._replace(gradient_step=jnp.int32(at))), data_seed=0)
    saver.close()
    torch_format.export(fresh, cfg, str(root / "torch"))
    for at in STEPS:
        shutil.copytree(root / "torch", root / "torchref-run" / "checkpoints" / str(at))
    shutil.copytree(root / "torch", root / "torchref-run" / "checkpoints" / ".tmp-30")  # a save a kill cut short
    convert.to_hf(str(root / "torch"), str(root / "hf"))
    convert.from_hf(str(root / "hf"), str(root / "from-hf"))
    return {"jaxtrain run": str(root / "jaxtrain-run"), "jaxtrain step": str(root / "jaxtrain-run/checkpoints/20"),
            "torch": str(root / "torch"), "torchref run": str(root / "torchref-run"), "hf": str(root / "hf"),
            "from-hf": str(root / "from-hf"), "other": str(root)}


@pytest.mark.parametrize("name,expected", [("jaxtrain run", "jaxtrain run"), ("jaxtrain step", "jaxtrain step"),
                                           ("torch", "torch"), ("torchref run", "torchref run"), ("hf", "hf"),
                                           ("from-hf", "torch"), ("other", None)])
def test_each_folder_is_told_for_what_it_is(folders, name, expected):
    assert checkpoint_kind.kind(folders[name]) == expected
    assert checkpoint_kind.kind(os.path.join(folders[name], "no-such-folder")) is None


def test_newest_step_is_the_highest_number(folders):
    assert checkpoint_kind.newest_step(folders["jaxtrain run"]) == f"{folders['jaxtrain run']}/checkpoints/20"
    assert checkpoint_kind.newest_step(folders["torchref run"]) == f"{folders['torchref run']}/checkpoints/20"
    assert checkpoint_kind.newest_step(folders["torch"]) is None


def test_a_run_folder_holds_its_own_backends_steps_only(folders):
    jaxtrain_steps, torchref_steps = (os.path.join(folders[name], "checkpoints") for name in ("jaxtrain run",
                                                                                              "torchref run"))
    checkpoint_kind.check_own_steps(jaxtrain_steps, "jaxtrain")
    checkpoint_kind.check_own_steps(torchref_steps, "torchref")
    with pytest.raises(UserError) as e:
        checkpoint_kind.check_own_steps(jaxtrain_steps, "torchref")
    assert str(e.value).startswith(f"{jaxtrain_steps}/20 is a jaxtrain checkpoint (an Orbax step folder), which "
                                   f"torchref starts from once converted: python -m jaxtrain.convert to-torch "
                                   f"{jaxtrain_steps}/20 DST, then --init.from=DST; move it out of {jaxtrain_steps}")
    with pytest.raises(UserError) as e:
        checkpoint_kind.check_own_steps(torchref_steps, "jaxtrain")
    assert str(e.value).startswith(f"{torchref_steps}/20 is a torch-format checkpoint, which a jaxtrain run starts "
                                   f"from with --init.from={torchref_steps}/20; move it out of {torchref_steps}")


def test_jaxtrain_refuses_to_resume_a_torchref_run_and_touches_nothing(folders):
    before = sorted(os.listdir(os.path.join(folders["torchref run"], "checkpoints")))
    with pytest.raises(UserError, match=r"checkpoints/20 is a torch-format checkpoint, which a jaxtrain run starts"):
        checkpoint.Checkpointer(tiny_cfg(folders["torchref run"]))
    assert sorted(os.listdir(os.path.join(folders["torchref run"], "checkpoints"))) == before


@pytest.mark.parametrize("name,says", [
    ("jaxtrain step", "is a jaxtrain checkpoint (an Orbax step folder), not a torch-format one: jaxtrain.run resumes "
                      "it with --run.out_dir={jaxtrain run}; to start another run from it, convert it first: "
                      "python -m jaxtrain.convert to-torch {jaxtrain step} DST, then --init.from=DST"),
    ("jaxtrain run", "is a jaxtrain run folder (Orbax checkpoints), not a torch-format checkpoint: jaxtrain.run "
                     "resumes it with --run.out_dir={jaxtrain run}; to start another run from it, convert it first: "
                     "python -m jaxtrain.convert to-torch {jaxtrain step} DST, then --init.from=DST"),
    ("torchref run", "is a torchref run folder, not a checkpoint; point init.from at one of its checkpoints, e.g. "
                     "{torchref run}/checkpoints/20"),
    ("hf", "is a Hugging Face GPT-2 folder (its Conv1D weights are laid out (in, out)), not a torch-format "
           "checkpoint; convert it first: python -m jaxtrain.convert from-hf {hf} DST, then --init.from=DST"),
    ("other", "holds no checkpoint (no model.safetensors); point it at a torch-format checkpoint folder")])
def test_a_folder_of_another_kind_given_as_a_torch_source_says_how_to_use_it(folders, name, says):
    with pytest.raises(UserError) as e:
        checkpoint_kind.check_torch_source(folders[name], "init.from")
    assert str(e.value) == f"init.from={folders[name]!r} " + says.format(**folders)


@pytest.mark.parametrize("command,name,says", [
    ("to-torch", "jaxtrain run", "is a jaxtrain run folder; pass one of its step folders, e.g. {jaxtrain step}"),
    ("to-torch", "torch", "is a torch-format checkpoint already: torchref and --init.from take it as it is"),
    ("to-torch", "torchref run", "is a torchref run folder, whose checkpoints are torch-format already, e.g. "
                                 "{torchref run}/checkpoints/20"),
    ("to-torch", "hf", "is a Hugging Face GPT-2 folder; python -m jaxtrain.convert from-hf {hf} DST makes a "
                       "torch-format checkpoint of it"),
    ("to-torch", "other", "is not a jaxtrain checkpoint step folder; pass one like out/tiny/checkpoints/400 (a "
                          "folder named by its step, holding `state` and `meta`)"),
    ("to-hf", "jaxtrain run", "is a jaxtrain run folder; pass one of its step folders, e.g. {jaxtrain step}"),
    ("to-hf", "torchref run", "is a torchref run folder; pass one of its checkpoints, e.g. "
                              "{torchref run}/checkpoints/20"),
    ("to-hf", "hf", "is a Hugging Face GPT-2 folder already")])
def test_a_folder_of_another_kind_given_to_export_says_what_to_pass(folders, tmp_path, command, name, says):
    """convert to-torch / to-hf SRC: a folder that is no jaxtrain step is named, and nothing is written (before,
    each was "not a jaxtrain checkpoint step folder")."""
    export = convert.to_torch if command == "to-torch" else convert.to_hf
    with pytest.raises(UserError) as e:
        export(folders[name], str(tmp_path / "dst"))
    assert str(e.value) == f"{command} SRC {folders[name]} " + says.format(**folders)
    assert not (tmp_path / "dst").exists()


def test_a_step_folder_must_keep_its_step_number_as_its_name(folders, tmp_path):
    renamed, missing = tmp_path / "latest", tmp_path / "nowhere"
    shutil.copytree(folders["jaxtrain step"], renamed)
    with pytest.raises(UserError) as e:
        convert.to_torch(str(renamed), str(tmp_path / "dst"))
    assert str(e.value) == (f"to-torch SRC {renamed} is a jaxtrain step folder renamed 'latest'; Orbax finds a step "
                            f"by its folder's name: give it back its step number (as in <run>/checkpoints/400)")
    with pytest.raises(UserError, match=f"^to-torch SRC {missing} does not exist; pass one like out/tiny/check"):
        convert.to_torch(str(missing), str(tmp_path / "dst"))


def test_a_step_its_run_no_longer_holds_or_the_runs_checkpoints_folder_names_the_steps_it_holds(folders, tmp_path):
    """to-torch of a step rotated out by checkpoint.max_to_keep said only "does not exist; pass one like
    out/tiny/checkpoints/400", and of <run>/checkpoints itself "not a jaxtrain checkpoint step folder"."""
    steps = tmp_path / "run" / "checkpoints"
    for number in (20, 100):  # listed in step order, not as strings ("100" < "20")
        shutil.copytree(folders["jaxtrain step"], steps / str(number))
    kept = "its run holds steps 20, 100 (a step is kept once saved, until checkpoint.max_to_keep rotates it out)"
    for given, says in [(f"{steps}/40", f"does not exist: {kept}; pass one of those"),
                        (f"{steps}/", f"is a run's checkpoints folder, holding steps 20, 100; pass one of those, "
                                      f"e.g. {steps}/100")]:
        with pytest.raises(UserError) as e:
            convert.to_torch(given, str(tmp_path / "dst"))
        assert str(e.value) == f"to-torch SRC {given} {says}"
    assert not (tmp_path / "dst").exists()
    for number in range(1, 10):  # more than eight: the first and last three, and how many
        (steps / str(number)).mkdir()
    with pytest.raises(UserError, match=r"its run holds steps 1, 2, 3, \.\.\., 9, 20, 100 \(11 steps\) \(a step"):
        convert.to_torch(f"{steps}/40", str(tmp_path / "dst"))


def test_a_torch_source_that_is_no_folder_says_so(folders):
    checkpoint_kind.check_torch_source(folders["torch"], "init.from")
    missing, a_file = f"{folders['other']}/nowhere", f"{folders['torch']}/model.safetensors"
    with pytest.raises(UserError, match=f"^init.from='{re.escape(missing)}' does not exist; point it at a torch"):
        checkpoint_kind.check_torch_source(missing, "init.from")
    with pytest.raises(UserError, match=f"^init.from='{re.escape(a_file)}' is a file; point it at a torch"):
        checkpoint_kind.check_torch_source(a_file, "init.from")


def _error_line(capsys) -> str:
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    return line


def test_jaxtrain_init_from_of_another_kind_is_named_before_it_is_read(folders, tmp_path, cache_dir):
    for name in ("jaxtrain step", "hf"):
        cfg = config.load(small_args(tmp_path / name, cache_dir, f"--init.from={folders[name]}"))
        with pytest.raises(UserError, match=f"^init.from={re.escape(repr(folders[name]))} is a "):
            run.Trainer(cfg)


@pytest.mark.parametrize("name,says", [
    ("jaxtrain step", "is a jaxtrain checkpoint (an Orbax step folder), not a torch-format one: jaxtrain.run "
                      "resumes it with --run.out_dir={jaxtrain run};"),
    ("hf", "is a Hugging Face GPT-2 folder (its Conv1D weights are laid out (in, out)), not a torch-format "
           "checkpoint; convert it first: python -m jaxtrain.convert from-hf {hf} DST"),
    ("from-hf", "holds weights only (no optimizer.safetensors and trainer_state.json), not a training state to "
                "resume; start a run from it with --init.from={from-hf} instead")])
def test_from_torch_names_what_its_source_is(folders, tmp_path, capsys, name, says):
    with pytest.raises(SystemExit) as e:
        convert.main(["from-torch", folders[name], str(tmp_path / "dst")])
    assert e.value.code == 2 and says.format(**folders) in _error_line(capsys)
    assert not (tmp_path / "dst").exists()


def test_from_torch_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        convert.main(["from-torch", str(tmp_path / "nowhere"), str(tmp_path / "dst")])
    assert e.value.code == 2 and _error_line(capsys) == (f"error: SRC='{tmp_path}/nowhere' does not exist; point it "
                                                         f"at a torch-format checkpoint folder (one holding "
                                                         f"model.safetensors)")


@pytest.mark.parametrize("name,says", [
    ("torchref run", "is a torchref run folder (torch-format checkpoints); convert its checkpoint into a jaxtrain run "
                     "first: python -m jaxtrain.convert from-torch {torchref run}/checkpoints/20 DST, then --run DST"),
    ("torch", "is a torch-format checkpoint; convert it into a jaxtrain run first: python -m jaxtrain.convert "
              "from-torch {torch} DST, then --run DST"),
    ("jaxtrain step", "is a checkpoint step folder, not a run folder; pass --run {jaxtrain run} --step 20"),
    ("from-hf", "is a torch-format folder of weights alone, not a run; start a run from them: python -m "
                "jaxtrain.run --config CONFIG --init.from={from-hf}, then --run that run's folder"),
    ("hf", "is a Hugging Face GPT-2 folder, not a run; convert it (python -m jaxtrain.convert from-hf {hf} DST) and "
           "start a run from it (python -m jaxtrain.run --config CONFIG --init.from=DST), then --run that run's "
           "folder")])
def test_sample_names_a_run_of_another_kind(folders, capsys, name, says):
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", folders[name]])
    assert e.value.code == 2 and _error_line(capsys) == f"error: --run {folders[name]} " + says.format(**folders)


@pytest.mark.parametrize("name,says", [
    ("from-hf", "is a torch-format checkpoint (nanoGPT's layout, as from-hf writes it) already: --init.from takes "
                "it as it is, and to-hf makes a Hugging Face folder of it"),
    ("jaxtrain step", "is a jaxtrain checkpoint; python -m jaxtrain.convert to-hf {jaxtrain step} DST makes a "
                      "Hugging Face folder of it"),
    ("jaxtrain run", "is a jaxtrain run folder; python -m jaxtrain.convert to-hf {jaxtrain step} DST makes a "
                     "Hugging Face folder of its newest checkpoint"),
    ("torchref run", "is a torchref run folder, whose checkpoints are torch-format already, e.g. "
                     "{torchref run}/checkpoints/20"),
    ("other", "holds no Hugging Face GPT-2 model; point it at a folder that GPT2LMHeadModel.save_pretrained wrote "
              "(config.json, model.safetensors)")])
def test_from_hf_names_what_its_source_is(folders, tmp_path, capsys, name, says):
    """from-hf SRC of another kind is named and nothing is written: before, from-hf's own output (nanoGPT's layout,
    config.json beside it) was converted again, its Conv1D weights transposed a second time."""
    with pytest.raises(SystemExit) as e:
        convert.main(["from-hf", folders[name], str(tmp_path / "dst")])
    assert e.value.code == 2 and _error_line(capsys) == f"error: from-hf SRC {folders[name]} " + says.format(**folders)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("name", ["torch", "from-hf"])
@pytest.mark.parametrize("key, written, given", [("n_head", 2, 4), ("gelu_approximate", "none", "tanh")])
def test_init_from_trained_with_another_head_count_or_gelu_is_refused_in_both_backends(folders, tmp_path, cache_dir,
                                                                                       name, key, written, given):
    """The folders were written with model.n_head=2 and the exact GELU (tiny_cfg); 4 heads fit the same tensors,
    d_model 32, and so does the tanh GELU, and either would compute another model. trainer_state.json's config says
    it for the export, config.json for from-hf (n_head, activation_function="gelu")."""
    _refused_in_both_backends(folders[name], key, written, given, tmp_path, cache_dir)


@pytest.mark.parametrize("activation", ["gelu_new", None])
def test_init_from_of_gpt2s_tanh_gelu_without_the_flag_is_refused_in_both_backends(folders, tmp_path, cache_dir,
                                                                                   activation):
    """A from-hf folder of GPT-2's own GELU (config.json's gelu_new, or no activation_function: transformers reads
    that as gelu_new), started from by a run left at model.gelu_approximate=none: the case a user meets."""
    folder = tmp_path / "gpt2-gelu"
    shutil.copytree(folders["from-hf"], folder)
    written = json.loads((folder / "config.json").read_text())
    written = {k: v for k, v in written.items() if k != "activation_function"}
    (folder / "config.json").write_text(json.dumps(
        {**written, **({"activation_function": activation} if activation else {})}))
    _refused_in_both_backends(str(folder), "gelu_approximate", "tanh", "none", tmp_path, cache_dir)


def _refused_in_both_backends(folder: str, key: str, written, given, tmp_path, cache_dir) -> None:
    """A run of model.{key}={given} starting from `folder`, written with {written}, is refused with one message
    naming both and the flag, by jaxtrain's Trainer and by torchref's init_from."""
    says = (f"init.from={folder!r} was trained with model.{key}={written}, and this run has "
            f"model.{key}={given}: its weights would compute another model; set --model.{key}={written}")
    cfg = config.load(small_args(tmp_path / "jaxtrain", cache_dir, f"--model.{key}={given}", f"--init.from={folder}"))
    with pytest.raises(UserError) as e:
        run.Trainer(cfg)
    assert str(e.value) == says
    torch_cfg = tiny_cfg(tmp_path / "torchref", f"--model.{key}={given}", f"--data.cache_dir={cache_dir}")
    with pytest.raises(UserError) as e:
        torchref_checkpoint.init_from(folder, torchref_model.GPT(torch_cfg.model), None,
                                      data.load(torch_cfg.data, 32))
    assert str(e.value) == says


@pytest.mark.parametrize("name", ["torch", "from-hf"])
def test_init_from_with_fewer_embedding_rows_than_the_data_has_ids_is_refused_in_both_backends(folders, tmp_path,
                                                                                                cache_dir, name):
    """The folders hold 256 embedding rows (bytes); GPT-2 BPE data has 50257 token ids. The refusal said to pass
    --model.vocab_size=256, which the run then refused as below the data's vocab_size. Given that size anyway (a
    new run: its refusal waits for a resume's checks), both backends name init.from, the cause, first."""
    (tmp_path / "text.txt").write_text("GPT-2 tokens for a model of bytes, one line after another.\n" * 200)
    prepare.prepare([str(tmp_path / "text.txt")], str(tmp_path / "bpe"), "gpt2")
    says = (f"init.from={folders[name]!r} has 256 embedding rows (model.vocab_size=256), fewer than the 50257 token "
            f"ids of the data (gpt2, {tmp_path / 'bpe'}): it was trained with another tokenizer; fine-tune it on "
            f"data of its own tokenizer (data.path), or start from a checkpoint of this data's")
    for i, extra in enumerate(([], ["--model.vocab_size=256"])):
        args = small_args(tmp_path / f"run{i}", cache_dir, f"--data.path={tmp_path / 'bpe'}",
                          f"--init.from={folders[name]}", *extra)
        for train in (lambda cfg: run.Trainer(cfg), torchref_run.train):
            with pytest.raises(UserError) as e:
                train(config.load(args))
            assert str(e.value) == says


def test_a_wte_that_is_not_two_dimensional_is_one_line(tmp_path):
    """A hand-made model.safetensors whose wte is a scalar: vocab_rows (convert from-torch's vocab size) raised an
    IndexError; it is a UserError now, and init.from's row check leaves it to the loader, which names the tensor."""
    safetensors.numpy.save_file({"transformer.wte.weight": np.zeros((), np.float32)},
                                str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError) as e:
        checkpoint_model.vocab_rows(str(tmp_path))
    assert str(e.value) == (f"{tmp_path}/model.safetensors: 'transformer.wte.weight' has shape (), not (vocab_size, "
                            f"d_model); re-export the checkpoint")
    checkpoint_model.check_vocab_rows(str(tmp_path), None)  # no data needed: nothing to compare the rows with
