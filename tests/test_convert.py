"""The torch-format bridge alone: bit-exact round trips, nanoGPT's names, the moments' layout, every error, weights-only
loads, the convert CLI, and (with torch and torchref) torchref's model reading what jaxtrain exports.

The state comes from three real optimizer steps with accumulation 2 on a 2-layer, d=32, T=16, V=64 model, so every
optimizer leaf (moments, counts) holds a value that a mapping bug would change.
"""

import dataclasses
import functools
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

from jaxtrain import checkpoint, checkpoint_kind, config, convert, data, mesh, model, optim, prepare, same_run, step
from jaxtrain import runfolder, torch_format
from jaxtrain.errors import UserError

V, STEPS = 64, 3
NANOGPT_BLOCK = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"]


def make_cfg_args(tied: bool) -> list[str]:
    return ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=4", "--model.seq_len=16",
            f"--model.vocab_size={V}", f"--model.tie_embeddings={str(tied).lower()}", "--optim.grad_accum_steps=2",
            "--optim.warmup_steps=2", "--train.steps=10", "--train.precision=fp32", "--data.batch_size=4"]


def make_cfg(tied: bool, *overrides) -> config.Config:
    return config.load([*make_cfg_args(tied), *overrides])


@functools.cache
def trained(tied: bool) -> tuple[config.Config, step.TrainState]:
    """The state after STEPS optimizer steps of 2 micro-batches each, on random tokens."""
    cfg = make_cfg(tied)
    graphdef, params = model.init_params(cfg.model, vocab_size=V, precision="fp32", seed=0)
    tx = optim.optimizer(cfg)
    train_step = jax.jit(step.make_train_step(graphdef, tx, optim.lr_schedule(cfg), seed=0, dropout=False))
    state, rng = step.init_state(params, tx), np.random.default_rng(0)
    for _ in range(STEPS):
        tokens_KxBxT1 = rng.integers(0, V, (2, 2, 17), dtype=np.int32)
        state, _ = train_step(state, tokens_KxBxT1[..., :-1], tokens_KxBxT1[..., 1:])
    return cfg, state


def exported(tied: bool, tmp_path) -> tuple[config.Config, step.TrainState, str]:
    cfg, state = trained(tied)
    out = str(tmp_path / "torch")
    torch_format.export(state, cfg, out)
    return cfg, state, out


def assert_same_state(got: step.TrainState, want: step.TrainState, template: step.TrainState) -> None:
    """Every leaf bit-identical to `want`'s, with the template's dtype and sharding; except the grad-norm record,
    a logging value that the torch format does not carry."""
    skipped = []
    leaves = zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), jax.tree.leaves(template))
    for (path, g), w, t in leaves:
        key = jax.tree_util.keystr(path)
        assert g.dtype == t.dtype and g.sharding == t.sharding, key
        if key.endswith(".grad_norm"):
            skipped.append(key)
            continue
        assert np.array_equal(np.asarray(g), np.asarray(w)), key
    assert len(skipped) == 1
    assert jax.tree.structure(got) == jax.tree.structure(want)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_round_trip_is_bit_exact(tied, tmp_path):
    cfg, state, out = exported(tied, tmp_path)
    template = step.fresh_state(cfg, V)
    loaded, kind = torch_format.load(out, template, cfg)
    assert kind == "full"
    assert int(loaded.step) == STEPS and int(loaded.opt_state.mini_step) == 0
    assert_same_state(loaded, state, template)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_files_hold_exactly_nanogpts_names(tied, tmp_path):
    cfg, _, out = exported(tied, tmp_path)
    names = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
    names |= {f"transformer.h.{i}.{n}" for i in range(2) for n in NANOGPT_BLOCK}
    names |= set() if tied else {"lm_head.weight"}
    weights, moments = (load_file(os.path.join(out, f)) for f in ("model.safetensors", "optimizer.safetensors"))
    assert set(weights) == names
    assert set(moments) == {f"{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq")}
    assert all(x.dtype == np.float32 for x in [*weights.values(), *moments.values()])
    with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)
    assert state["format"] == "jaxtrain-torch/1" and state["step"] == STEPS and state["tied_embeddings"] == tied
    tokens = STEPS * cfg.data.batch_size * cfg.model.seq_len  # every step trained on full windows
    assert state["data"] == {"seed": 0, "next_step": STEPS, "tokens": tokens}
    assert state["config"] == yaml.safe_load(config.dump(cfg)) and state["config_hash"] == same_run.config_hash(cfg)
    assert state["lr_scheduler"]["last_epoch"] == STEPS
    # trainer_state's LR is the float64 schedule's, optax's the float32 one's: a few 2^-24 roundings apart.
    assert state["lr_scheduler"]["_last_lr"][0] == pytest.approx(float(optim.lr_schedule(cfg)(STEPS)), rel=1e-6)


def _fc_kernel(tree):
    """h.1.mlp.c_fc's (in, out) = (32, 128) kernel in params, mu or nu."""
    return np.asarray(tree["h"][1]["mlp"]["c_fc"]["kernel"][...])


def test_weights_and_moments_are_torch_layout(tmp_path):
    _, state, out = exported(False, tmp_path)
    weights, moments = (load_file(os.path.join(out, f)) for f in ("model.safetensors", "optimizer.safetensors"))
    adam = optim.adam_state(state.opt_state)
    assert weights["transformer.h.1.mlp.c_fc.weight"].shape == (128, 32)  # torch's Linear: (out, in)
    assert np.array_equal(weights["transformer.h.1.mlp.c_fc.weight"], _fc_kernel(state.params).T)
    assert np.array_equal(moments["transformer.h.1.mlp.c_fc.weight.exp_avg"], _fc_kernel(adam.mu).T)
    assert np.array_equal(moments["transformer.h.1.mlp.c_fc.weight.exp_avg_sq"], _fc_kernel(adam.nu).T)
    assert np.abs(moments["transformer.h.1.mlp.c_fc.weight.exp_avg"]).max() > 0
    assert np.array_equal(moments["lm_head.weight.exp_avg"], np.asarray(adam.mu["lm_head"]["kernel"][...]).T)
    assert np.array_equal(moments["transformer.ln_f.bias.exp_avg_sq"], np.asarray(adam.nu["ln_f"]["bias"][...]))


def _edit_tensors(file, edit):
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _drop(file, name):
    return lambda out: _edit_tensors(os.path.join(out, file), lambda tensors: tensors.pop(name))


def _set(file, name, shape):
    ones = np.ones(shape, np.float32)
    return lambda out: _edit_tensors(os.path.join(out, file), lambda tensors: tensors.update({name: ones}))


def _truncate(file):
    return lambda out: os.truncate(os.path.join(out, file), os.path.getsize(os.path.join(out, file)) - 100)


def _edit_trainer_state(edit):
    def apply(out):
        file = os.path.join(out, "trainer_state.json")
        state = json.load(open(file, encoding="utf-8"))
        edit(state)
        json.dump(state, open(file, "w", encoding="utf-8"))
    return apply


def _bad_json(out):
    with open(os.path.join(out, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write('{"format": ')


# damage -> (file named in the error, text it must contain, how to damage an exported folder)
DAMAGE = {
    "missing tensor": ("model.safetensors", "'transformer.h.1.attn.c_proj.bias' expected with shape (32,), found no",
                       _drop("model.safetensors", "transformer.h.1.attn.c_proj.bias")),
    "missing moment": ("optimizer.safetensors", "transformer.wpe.weight.exp_avg_sq",
                       _drop("optimizer.safetensors", "transformer.wpe.weight.exp_avg_sq")),
    "extra tensor": ("model.safetensors", "unexpected tensor 'transformer.h.2.ln_1.weight' (shape (32,))",
                     _set("model.safetensors", "transformer.h.2.ln_1.weight", (32,))),
    "wrong shape": ("model.safetensors", "'transformer.wpe.weight' expected with shape (16, 32), found shape (8, 32)",
                    _set("model.safetensors", "transformer.wpe.weight", (8, 32))),
    "moment of another shape": ("optimizer.safetensors", "found shape (8, 32); it does not hold the moments of "
                                "the weights in model.safetensors beside it (copied from another checkpoint?)",
                                _set("optimizer.safetensors", "transformer.wpe.weight.exp_avg", (8, 32))),
    "truncated file": ("optimizer.safetensors", "unreadable", _truncate("optimizer.safetensors")),
    "bad json": ("trainer_state.json", "not valid JSON", _bad_json),
    "no data seed": ("trainer_state.json", "'data.seed' is missing or not an integer (got None)",
                     _edit_trainer_state(lambda state: state["data"].pop("seed"))),
    "skipped past step": ("trainer_state.json", f"'skipped' is not an integer from 0 to step ({STEPS}) (got 9)",
                          _edit_trainer_state(lambda state: state.update(skipped=9))),
    "skipped negative": ("trainer_state.json", "'skipped' is not an integer from 0 to step",
                         _edit_trainer_state(lambda state: state.update(skipped=-1))),
    "step a boolean": ("trainer_state.json", "'step' is missing or not an integer from 0 to 2^31 - 1 (got True)",
                       _edit_trainer_state(lambda state: state.update(step=True))),
    "step past int32": ("trainer_state.json", "'step' is missing or not an integer from 0 to 2^31 - 1 (got "
                        "1000000000000)", _edit_trainer_state(lambda state: state.update(step=10**12))),
    "tokens negative": ("trainer_state.json", "'data.tokens' is not an integer >= 0 (got -1)",
                        _edit_trainer_state(lambda state: state["data"].update(tokens=-1))),
    "rng a list": ("trainer_state.json", "'rng' is not {torch: <base64> or null, cuda: <base64> or null} (got [1])",
                   _edit_trainer_state(lambda state: state.update(rng=[1]))),
    "loss scale 0": ("trainer_state.json", "'loss_scale' is not {scale: a finite number > 0, growth_tracker: an "
                     "integer >= 0} (got {'scale': 0, 'growth_tracker': 0})",
                     _edit_trainer_state(lambda state: state.update(loss_scale={"scale": 0, "growth_tracker": 0}))),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_errors_name_the_tensor_and_file(damage, tmp_path):
    file, detail, apply = DAMAGE[damage]
    cfg, _, out = exported(False, tmp_path)
    apply(out)
    with pytest.raises(UserError) as e:
        torch_format.load(out, step.fresh_state(cfg, V), cfg)
    assert os.path.join(out, file) in str(e.value) and detail in str(e.value)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-into-untied", "untied-into-tied"])
def test_tied_mismatch_says_which_setting(tied, tmp_path):
    _, _, out = exported(tied, tmp_path)
    other = make_cfg(not tied)
    with pytest.raises(UserError, match=rf"lm_head\.weight.*tie_embeddings={str(tied).lower()}"):
        torch_format.load(out, step.fresh_state(other, V), other)


def test_a_bias_free_untied_checkpoint_names_both_keys_in_both_backends(tmp_path):
    """Loaded with the defaults (biases, tied embeddings), a checkpoint without biases and with its own head names
    both keys to set, in jaxtrain and in torchref (before: tie_embeddings alone, or in torchref the wrong key)."""
    from torchref import checkpoint as torchref_checkpoint
    from torchref.model import GPT

    bare = make_cfg(False, "--model.bias=false")
    torch_format.export(step.fresh_state(bare, V), bare, str(tmp_path / "bare"))
    says = re.escape("the checkpoint's tensors are those of model.tie_embeddings=false (this config: true), "
                     "model.bias=false (this config: true); pass --model.tie_embeddings=false "
                     "--model.bias=false") + "$"
    defaults = make_cfg(True)
    with pytest.raises(UserError, match=says):
        torch_format.load(str(tmp_path / "bare"), step.fresh_state(defaults, V), defaults)
    with pytest.raises(UserError, match=says):
        torchref_checkpoint.load_weights(str(tmp_path / "bare"), GPT(defaults.model))


@pytest.mark.parametrize("other, says", [
    (["--model.d_model=64"], "model.d_model=32 (this config: 64); pass --model.d_model=32"),
    (["--model.n_layer=3", "--model.seq_len=32"],
     "model.n_layer=2 (this config: 3), model.seq_len=16 (this config: 32); pass --model.n_layer=2 "
     "--model.seq_len=16"),
    ([f"--model.vocab_size={V + 8}"], f"model.vocab_size={V} (this config: {V + 8}); pass --model.vocab_size={V}")])
def test_a_shape_mismatch_names_the_flags_the_tensors_tell_in_both_backends(other, says, tmp_path):
    """A checkpoint of another width, depth, context or vocabulary, loaded into this config: the model.* keys its
    tensors show, with the values to pass (before: the first tensor of another shape, and "set the model.* config
    to the checkpoint's"), in jaxtrain and in torchref alike."""
    from torchref import checkpoint as torchref_checkpoint
    from torchref.model import GPT

    _, _, out = exported(True, tmp_path)
    cfg = make_cfg(True, *other)
    says = "; the checkpoint's tensors are those of " + re.escape(says) + "$"
    with pytest.raises(UserError, match=says):
        torch_format.load(out, step.fresh_state(cfg, cfg.model.vocab_size), cfg)
    with pytest.raises(UserError, match=says):
        torchref_checkpoint.load_weights(out, GPT(cfg.model))


def test_a_folder_whose_trainer_state_and_tensors_disagree_says_so_in_both_backends(tmp_path, capsys):
    """from-torch (and torchref's resume) builds the model from the folder's own trainer_state.json, where no flag
    applies: tensors of another width than it says are named as the folder's files disagreeing."""
    from torchref import checkpoint as torchref_checkpoint
    from torchref.model import GPT

    _, _, out = exported(True, tmp_path)
    _edit_trainer_state(lambda state: state["config"]["model"].update(d_model=64))(out)
    says = ("; the checkpoint's tensors are those of model.d_model=32 (trainer_state.json: 64): the folder's files "
            "disagree (one copied from another checkpoint, or trainer_state.json edited); copy or convert the whole "
            "folder again")
    with pytest.raises(SystemExit) as e:
        convert.main(["from-torch", out, str(tmp_path / "back")])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(says + "\n")
    with pytest.raises(UserError, match=re.escape(says) + "$"):
        torchref_checkpoint.load_weights(out, GPT(make_cfg(True, "--model.d_model=64").model), "trainer_state.json")


def test_a_folder_whose_files_disagree_without_a_key_to_name_and_to_hf_of_one_are_refused(tmp_path, capsys):
    """A bias tensor missing from a folder whose trainer_state.json says biases: no model.* key differs, and the
    config came from that file, so from-torch says the folder does not hold the model it describes (it told to set
    the model.* config to trainer_state.json's). to-hf of a folder whose trainer_state.json says model.bias=false
    beside bias tensors is refused: writing zeros over them would change the model."""
    _, _, out = exported(True, tmp_path)
    _drop("model.safetensors", "transformer.h.1.attn.c_proj.bias")(out)
    with pytest.raises(SystemExit):
        convert.main(["from-torch", out, str(tmp_path / "back")])
    assert capsys.readouterr().err.endswith(
        "found no such tensor; it does not hold the model its trainer_state.json describes (damaged, or copied from "
        "another checkpoint); copy or convert the whole folder again\n")
    _, _, whole = exported(True, tmp_path / "whole")
    _edit_trainer_state(lambda state: state["config"]["model"].update(bias=False))(whole)
    with pytest.raises(SystemExit):
        convert.main(["to-hf", whole, str(tmp_path / "hf")])
    assert capsys.readouterr().err == (
        f"error: {whole}: its config says model.bias=false, and its weights hold 13 bias tensors "
        f"('transformer.h.0.attn.c_attn.bias' first): its files disagree (one edited, or copied from another "
        f"checkpoint); copy or convert the whole folder again\n")
    assert not os.path.exists(tmp_path / "hf")


def test_weights_only_load_keeps_a_fresh_optimizer(tmp_path):
    cfg, state, out = exported(False, tmp_path)
    os.remove(os.path.join(out, "optimizer.safetensors"))
    template = step.fresh_state(cfg, V)
    loaded, kind = torch_format.load(out, template, cfg)
    assert kind == "weights" and int(loaded.step) == 0
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(state.params)):
        assert np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(loaded.opt_state), jax.tree.leaves(template.opt_state)):
        assert np.array_equal(a, b)


def test_export_refuses_mid_window_state_and_existing_folder(tmp_path):
    cfg, state = trained(False)
    mid = state._replace(opt_state=state.opt_state._replace(mini_step=state.opt_state.mini_step + 1))
    with pytest.raises(UserError, match="middle of a gradient-accumulation window"):
        torch_format.export(mid, cfg, str(tmp_path / "mid"))
    assert not os.path.exists(tmp_path / "mid")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(UserError, match="already exists"):
        torch_format.export(state, cfg, str(tmp_path / "taken"))


def test_export_leaves_a_folder_named_like_its_temporary_one_alone(tmp_path):
    """A folder of the user's named `<DST>.tmp` (a fixed temporary name, deleted before) is left as it is; DST
    gets its files with the permissions a folder made by makedirs has; a write that fails leaves nothing."""
    cfg, state = trained(False)
    users = tmp_path / "torch.tmp"
    users.mkdir()
    (users / "notes.txt").write_text("the user's")
    torch_format.export(state, cfg, str(tmp_path / "torch"))
    assert (users / "notes.txt").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path / "torch")) == sorted([torch_format.MODEL, torch_format.OPTIMIZER,
                                                             torch_format.TRAINER_STATE])
    os.makedirs(tmp_path / "made")
    assert os.stat(tmp_path / "torch").st_mode == os.stat(tmp_path / "made").st_mode
    with pytest.raises(OSError, match="disk full"):
        with torch_format.folder_into_place(str(tmp_path / "failed")) as tmp:
            (pathlib.Path(tmp) / torch_format.MODEL).write_text("half written")
            raise OSError("disk full")
    assert sorted(os.listdir(tmp_path)) == ["made", "torch", "torch.tmp"]


def test_convert_cli_round_trip(tmp_path, capsys):
    """A jaxtrain run folder -> torch format -> a new run folder whose checkpoint restores the same state."""
    # data seed 7: the run continues another's batch order (data.continued_seed); 12,345 tokens: it began from
    # init.from's state at another batch size, so its count is no multiple of its own windows
    step_dir = _saved_run(tmp_path, data_seed=7, data_fingerprint="f" * 64, tokens=12_345)
    state = trained(True)[1]
    convert.main(["to-torch", step_dir, str(tmp_path / "torch")])
    trainer_state = checkpoint_kind.read_trainer_state(str(tmp_path / "torch"))
    assert trainer_state["data"]["seed"] == 7 and trainer_state["data_fingerprint"] == "f" * 64
    assert trainer_state["data"]["tokens"] == 12_345  # was STEPS windows of this config: the count lost
    convert.main(["from-torch", str(tmp_path / "torch"), str(tmp_path / "back")])
    back = config.load(["--config", str(tmp_path / "back" / "config.yaml")])
    assert back.run.out_dir == str(tmp_path / "back") and back.model.vocab_size == V and back.run.seed == 7
    restorer = checkpoint.Checkpointer(back)
    target = checkpoint.abstract_state(back, V, mesh.make_mesh(back))
    resumed = restorer.resume(target)
    restorer.close()
    assert resumed.step == STEPS and resumed.data_seed == 7
    assert resumed.tokens == 12_345  # the checkpoint's count, through to-torch and back
    assert json.load(open(tmp_path / "back" / "checkpoints" / str(STEPS) / "meta" / "metadata"))["data_fingerprint"] \
        == "f" * 64
    assert_same_state(resumed.state, state, target)
    with pytest.raises(SystemExit) as e:
        convert.main(["from-torch", str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert e.value.code == 2 and f"SRC='{tmp_path / 'nowhere'}' does not exist" in capsys.readouterr().err


def test_the_converters_files_have_the_mode_open_gives(tmp_path):
    """Under a umask of 022, every file to-torch and to-hf write is 0644, as open() makes a file: safetensors 0.8
    writes its own 0600, and the weights were the one file of a shared folder its other users could not read."""
    step = _saved_run(tmp_path)
    umask = os.umask(0o022)
    try:
        convert.main(["to-torch", step, str(tmp_path / "torch")])
        convert.main(["to-hf", step, str(tmp_path / "hf")])
    finally:
        os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for out in ("torch", "hf") for p in (tmp_path / out).iterdir()}
    assert {"model.safetensors", "optimizer.safetensors", "config.json"} <= set(modes)
    assert set(modes.values()) == {"0o644"}, modes


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_torchref_model_reads_the_export(tied, tmp_path):
    """torch code without torch.load: safetensors into torchref's GPT (strict), which then computes our logits."""
    import torch  # the [test] extra installs it: a failure to import is a failure, not a skip
    from safetensors.torch import load_file as load_torch
    from torchref.model import GPT

    cfg, state, out = exported(tied, tmp_path)
    gpt = GPT(cfg.model)
    state_dict = load_torch(os.path.join(out, "model.safetensors"))
    if tied:  # safetensors stores a shared tensor once; torch's state dict lists it under both names
        state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]
    gpt.load_state_dict(state_dict, strict=True)
    idx_BxT = np.random.default_rng(1).integers(0, V, (2, 16))
    graphdef = model.init_params(cfg.model, vocab_size=V, precision="fp32", seed=0)[0]
    want = np.asarray(model.apply(graphdef, state.params, idx_BxT))
    with torch.no_grad():
        got = gpt(torch.from_numpy(idx_BxT)).numpy()
    # fp32 in two frameworks' summation orders: measured 1.8e-7 (3 ulps of logits below 0.7), 10x margin.
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_skipped_updates_cross_the_bridge(tmp_path):
    """A state whose last window was skipped (train.nan_policy=skip) is STEPS + 1 windows in but STEPS updates:
    trainer_state says so (step, skipped, LambdaLR at the updates) and the round trip keeps every count."""
    cfg, state = trained(True)
    skipped_state = state._replace(opt_state=state.opt_state._replace(gradient_step=state.opt_state.gradient_step + 1))
    out = str(tmp_path / "torch")
    torch_format.export(skipped_state, cfg, out)
    trainer_state = checkpoint_kind.read_trainer_state(out)
    assert (trainer_state["step"], trainer_state["skipped"]) == (STEPS + 1, 1)
    assert trainer_state["lr_scheduler"]["last_epoch"] == STEPS
    template = step.fresh_state(cfg, V)
    loaded, _ = torch_format.load(out, template, cfg)
    assert_same_state(loaded, skipped_state, template)


def test_a_run_trained_with_cudnn_attention_converts_without_a_gpu(tmp_path):
    """A GPU run's checkpoint with model.attention=cudnn (its meta's config): the kernel shapes no param, so the
    state restores here, where cuDNN's attention would refuse to build (before, both directions refused), and the
    config written out stays the run's."""
    _, state = trained(True)
    cfg = make_cfg(True, f"--run.out_dir={tmp_path / 'run'}", "--checkpoint.async_save=false")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="cudnn"))
    with pytest.raises(UserError, match="model.attention=cudnn needs"):
        step.fresh_state(cfg, V)  # what the conversions built their shapes from
    saver = checkpoint.Checkpointer(cfg)
    saver.save(state, data_seed=0)
    saver.close()
    convert.main(["to-torch", str(tmp_path / "run" / "checkpoints" / str(STEPS)), str(tmp_path / "torch")])
    assert checkpoint_kind.read_trainer_state(str(tmp_path / "torch"))["config"]["model"]["attention"] == "cudnn"
    convert.main(["from-torch", str(tmp_path / "torch"), str(tmp_path / "back")])
    back = config.load(["--config", str(tmp_path / "back" / "config.yaml")])
    assert back.model.attention == "cudnn"
    restored, _, _ = convert.restore_step(str(tmp_path / "back" / "checkpoints" / str(STEPS)))
    assert_same_state(restored, state, restored)  # the values; restore_step places them on its own mesh


@pytest.mark.parametrize("command", ["to-torch", "to-hf", "from-torch", "from-hf"])
def test_a_url_or_the_current_folder_is_refused_before_anything_is_read(command, tmp_path, capsys, monkeypatch):
    """Conversions write local folders: a gs:// DST was written to ./gs:/..., reported as written; a URL SRC was
    "does not exist" (to-torch's and to-hf's, a step folder, is read from its bucket, in a store jaxtrain reads:
    test_gcs reads one); DST `.` (renamed into place: impossible) failed after the work with a raw OSError."""
    monkeypatch.chdir(tmp_path)
    local = str(tmp_path / "src")  # never read: each refusal comes first
    url_src = ("is not a folder jaxtrain reads: give a local path, or gs://bucket/path or s3://bucket/path"
               if command.startswith("to-") else
               "is a URL, and this command takes local folders only; give it a local copy")
    cases = [([command, local, "gs://bucket/out"], "DST gs://bucket/out is a URL, and this command takes local "
                                                   "folders only; give it a local folder and copy"),
             ([command, "ftp://bucket/run/checkpoints/3", "dst"], f"SRC ftp://bucket/run/checkpoints/3 {url_src}"),
             ([command, local, "."], "DST '.' is the folder this command runs in; the conversion is made as a new "
                                     "folder: name one, e.g. ./converted"),
             ([command, local, str(tmp_path)], f"DST {str(tmp_path)!r} is the folder this command runs in"),
             ([command, local, ""], "DST '' is the folder this command runs in")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as e:
            convert.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and "Traceback" not in err, (argv, err)
    assert os.listdir(tmp_path) == []


def test_a_step_in_a_bucket_whose_store_package_is_missing_names_its_install(tmp_path, capsys, monkeypatch):
    def no_package(scheme):
        raise ImportError(f"Install {scheme}fs")
    monkeypatch.setattr(runfolder.fsspec, "get_filesystem_class", no_package)
    with pytest.raises(SystemExit) as e:
        convert.main(["to-torch", "s3://bucket/run/checkpoints/3", str(tmp_path / "dst")])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: to-torch SRC s3://bucket/run/checkpoints/3 needs the s3fs package: pip install 's3fs' (for "
        "gs://: pip install 'jaxtrain[gcs]')\n")


def _saved_run(tmp_path, data_seed: int = 0, data_fingerprint: str | None = None, tokens: int | None = None,
               *overrides) -> str:
    """A jaxtrain run folder holding trained(True)'s state as its one checkpoint, its config make_cfg's with
    `overrides`; returns the step folder."""
    _, state = trained(True)
    cfg = make_cfg(True, f"--run.out_dir={tmp_path / 'run'}", "--checkpoint.async_save=false", *overrides)
    saver = checkpoint.Checkpointer(cfg, data_fingerprint=data_fingerprint)
    saver.save(state, data_seed=data_seed, tokens=tokens)
    saver.close()
    return str(tmp_path / "run" / "checkpoints" / str(STEPS))


def test_a_checkpoint_off_its_fingerprint_is_refused_by_the_converters_and_the_sampler(tmp_path, capsys):
    """to-torch, to-hf and jaxtrain.sample restored a step without checking it against its fingerprint, as a resume
    does: a corrupt checkpoint converted with exit 0, and from-torch then gave the damage a valid fingerprint. Here
    the arrays read but one checksum in meta differs (what a flipped bit in them gives), so each refuses, naming
    the array and what to do instead, and writes nothing. An AdamW moment's: to-torch, which writes them, refuses;
    to-hf and sample read and check the weights alone (restore_step's weights_only), which are whole."""
    from jaxtrain import model_source
    step_dir = _saved_run(tmp_path)
    for broken, refusing in [("params/", ("to-torch", "to-hf")), ("opt_state/inner_opt_state", ("to-torch",))]:
        path = _break_fingerprint(step_dir, broken)
        for command in ("to-torch", "to-hf"):
            out = tmp_path / broken.replace("/", "") / command
            if command not in refusing:
                convert.main([command, step_dir, str(out)])
                assert (out / "model.safetensors").exists()
                continue
            with pytest.raises(SystemExit) as e:
                convert.main([command, step_dir, str(out)])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"checkpoint {step_dir} does not match its fingerprint: {path}" in err
            assert "it is corrupt; convert another step folder of the run" in err and not out.exists()
        if broken == "params/":
            with pytest.raises(UserError, match=f"{path} .*it is corrupt; its run has no other checkpoint to sample"):
                model_source.from_run(str(tmp_path / "run"), None, None, "sample")
        else:
            assert model_source.from_run(str(tmp_path / "run"), None, None, "sample").step == STEPS
        _break_fingerprint(step_dir, path, by=-1)  # mended


@pytest.mark.parametrize("n_layer", [3, 1])
def test_a_step_whose_config_names_more_or_fewer_blocks_than_it_holds_is_refused_by_the_weights_readers(
        tmp_path, n_layer):
    """The step's config edited to 3 blocks where it holds 2: orbax's partial restore handed back the third's
    arrays unread (its ShapeDtypeStructs), and the fingerprint then failed with a traceback; to 1: it read the first
    block alone. Both refused in one line: the array it lacks, the saved array not read."""
    from jaxtrain import model_source
    step_dir = _saved_run(tmp_path)
    meta_file = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(meta_file))
    meta["config"]["model"]["n_layer"] = n_layer
    json.dump(meta, open(meta_file, "w"))
    said = (f"checkpoint {step_dir} cannot be read (it holds no params/h/2/" if n_layer == 3 else
            f"checkpoint {step_dir} does not match its fingerprint: params/h/1/")
    with pytest.raises(UserError, match=re.escape(said)):
        model_source.from_run(str(tmp_path / "run"), None, None, "sample")


def test_a_checkpoint_off_its_fingerprint_names_the_runs_other_steps_to_convert(tmp_path, capsys):
    """README: convert refuses a corrupt step "naming another"; it said only "convert another step folder"."""
    good = _saved_run(tmp_path)
    bad = copy_step(good, STEPS + 1)
    _break_fingerprint(bad, "params/")  # an array both read
    for command in ("to-torch", "to-hf"):
        with pytest.raises(SystemExit):
            convert.main([command, bad, str(tmp_path / command)])
        assert f"it is corrupt; convert another step folder of the run ({good})" in capsys.readouterr().err


def test_a_step_folder_holding_another_step_is_refused_by_the_converters_and_the_sampler(tmp_path, capsys):
    """A copy of the run's step 3 put back as step 4 (a backup restored under another name) was converted, and
    sampled as "step 4", with exit 0. Refused in one line naming the step it holds, nothing written."""
    from jaxtrain import model_source
    good = _saved_run(tmp_path)
    copied = os.path.join(os.path.dirname(good), str(STEPS + 1))
    shutil.copytree(good, copied)
    why = (f"checkpoint {copied} holds step {STEPS}, not the step its folder is named for (a copy or a backup put "
           f"there?)")
    for command in ("to-torch", "to-hf"):
        with pytest.raises(SystemExit) as e:
            convert.main([command, copied, str(tmp_path / command)])
        assert e.value.code == 2 and not (tmp_path / command).exists()
        assert capsys.readouterr().err == f"error: {why}; convert another step folder of the run ({good})\n"
    with pytest.raises(UserError) as e:
        model_source.from_run(str(tmp_path / "run"), None, None, "sample")
    assert str(e.value) == f"{why}; sample another of its checkpoints with --step ({STEPS})"


def test_a_step_whose_arrays_cannot_be_read_is_one_line_from_the_converter(tmp_path):
    """A flipped byte in a step's largest data file: the converter's one line came after 50-325 lines of orbax's
    tracebacks and "Event loop is closed" reports (a resume, through checkpoint.py's quieting, said one line)."""
    step_dir = _saved_run(tmp_path)
    data_file = max(glob.glob(os.path.join(step_dir, "state", "d", "*")), key=os.path.getsize)
    body = bytearray(open(data_file, "rb").read())
    body[len(body) // 2] ^= 0xFF
    open(data_file, "wb").write(bytes(body))
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.convert", "to-torch", step_dir, str(tmp_path / "t")],
                          capture_output=True, text=True)
    [line] = proc.stderr.splitlines()
    assert proc.returncode == 2 and line.startswith(f"error: checkpoint {step_dir} cannot be read ("), proc.stderr
    assert line.endswith("convert another step folder of the run") and not (tmp_path / "t").exists()


def test_a_destination_that_would_be_lost_or_cannot_be_made_is_refused_before_the_source_is_read(tmp_path):
    """DST a link to nowhere ended in a traceback, exit 1; DST in a run's checkpoints/ was written, then deleted
    with its step by the run's rotation (an export inside the step folder), or it stopped every resume."""
    step_dir = _saved_run(tmp_path)
    (tmp_path / "run" / "config.yaml").write_text("the run's\n")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    checkpoints = tmp_path / "run" / "checkpoints"
    for dst, says in [(tmp_path / "link", f"DST {tmp_path / 'link'} is a symbolic link to {tmp_path / 'nowhere'}, "
                                          f"which does not exist; make that folder, or choose another DST"),
                      (checkpoints / str(STEPS) / "torch", f"DST {checkpoints / str(STEPS) / 'torch'} lies in the "
                                                            f"run folder's {checkpoints}, where the run's rotation"),
                      (checkpoints / "export", f"DST {checkpoints / 'export'} lies in the run folder's "
                                               f"{checkpoints}")]:
        for command in ("to-torch", "to-hf"):
            with pytest.raises(UserError) as refused:
                getattr(convert, command.replace("-", "_"))(step_dir, str(dst))
            assert str(refused.value).startswith(says), refused.value
    assert os.listdir(checkpoints) == [str(STEPS)] and "torch" not in os.listdir(checkpoints / str(STEPS))


def test_from_torch_writes_its_config_last_and_with_an_absolute_out_dir(tmp_path, monkeypatch):
    """A from-torch killed before its checkpoint was complete left config.yaml beside an empty checkpoints/, and its
    resume command trained from step 0; a relative DST wrote a relative run.out_dir, which resumed from another
    folder into a new one there, from step 0."""
    torch_dir = str(tmp_path / "t")
    convert.to_torch(_saved_run(tmp_path), torch_dir)
    written, save = [], config.save
    monkeypatch.setattr(config, "save", lambda cfg, out_dir: (written.append(
        checkpoint.saved_steps(out_dir)), save(cfg, out_dir))[1])
    monkeypatch.chdir(tmp_path)
    convert.from_torch(torch_dir, "back")
    assert written == [[STEPS]]  # the step complete when config.yaml was written
    assert config.load(["--config", str(tmp_path / "back" / "config.yaml")]).run.out_dir == str(tmp_path / "back")


def copy_step(step_dir: str, step: int) -> str:
    """A copy of the step folder as a true checkpoint of `step` beside it (its meta's step rewritten, as a save at
    that step writes it): the copy's folder."""
    copy = os.path.join(os.path.dirname(step_dir), str(step))
    shutil.copytree(step_dir, copy)
    meta_file = os.path.join(copy, "meta", "metadata")
    meta = json.load(open(meta_file))
    json.dump({**meta, "step": step}, open(meta_file, "w"))
    return copy


def _break_fingerprint(step_dir: str, prefix: str = "", by: int = 1) -> str:
    """One checksum in the step's meta off by one (what a flipped bit in its array gives), the first of an array
    whose path starts with `prefix`: that array's path."""
    meta_file = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(meta_file))
    path = next(path for path in sorted(meta["fingerprint"]) if path.startswith(prefix))
    meta["fingerprint"][path] = (meta["fingerprint"][path] + by) % 2**32
    json.dump(meta, open(meta_file, "w"))
    return path


def test_a_save_that_did_not_finish_is_named_so_and_a_complete_step_offered(tmp_path, capsys):
    """Orbax writes a step into <step>.orbax-checkpoint-tmp(-<time>) and renames it when complete; a run killed
    mid-save leaves that folder (with Orbax's metadata file in it). to-torch called it a renamed step and said to
    give it back its number: that put an incomplete save under a step's name."""
    step_dir = _saved_run(tmp_path)
    for name in (f"{STEPS + 1}.orbax-checkpoint-tmp", f"{STEPS + 1}.orbax-checkpoint-tmp-1764270000"):
        partial = tmp_path / "run" / "checkpoints" / name
        (partial / "state").mkdir(parents=True)
        (partial / "_CHECKPOINT_METADATA").write_text("{}")
        with pytest.raises(SystemExit) as e:
            convert.main(["to-torch", str(partial), str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "renamed" not in err
        assert f"{partial} is a save that did not finish" in err and f"e.g. {step_dir}" in err


def test_from_torch_refuses_inf_or_nan_and_leaves_no_half_written_folder(tmp_path, capsys, monkeypatch):
    """A torch-format state holding NaN got the message of a training step that overflowed (lower optim.lr,
    --run.fresh) and left DST with config.yaml and an empty checkpoints/, which blocked the retry. Now it is refused
    before anything is written, naming the array; and a conversion that fails while writing removes DST."""
    _, _, out = exported(True, tmp_path)
    nan = str(tmp_path / "nan")
    shutil.copytree(out, nan)
    _edit_tensors(os.path.join(nan, "model.safetensors"),
                  lambda tensors: tensors["transformer.ln_f.bias"].__setitem__(0, np.nan))
    with pytest.raises(SystemExit) as e:
        convert.main(["from-torch", nan, str(tmp_path / "back")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{nan} holds inf or NaN (params/ln_f/bias" in err and "optim.lr" not in err
    assert not (tmp_path / "back").exists()

    save = checkpoint.Checkpointer.save

    def full_disk(self, *args, **kwargs):  # the step's files written, then the disk full
        save(self, *args, **kwargs)
        self.wait()
        assert os.listdir(os.path.join(self.cfg.run.out_dir, "checkpoints"))
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.Checkpointer, "save", full_disk)
    for dst in (tmp_path / "new", tmp_path / "empty"):
        if dst.name == "empty":
            dst.mkdir()
        with pytest.raises(OSError):
            convert.from_torch(out, str(dst))
        assert (not dst.exists()) if dst.name == "new" else os.listdir(dst) == []


def test_to_hf_takes_weights_with_their_trainer_state_and_names_what_bare_weights_lack(tmp_path, capsys):
    """A torch-format folder whose optimizer.safetensors was deleted (what read_trainer_state's message suggests,
    to load the weights alone) holds the model's config in trainer_state.json: to-hf ignored it and asked for a
    Hugging Face config.json. Weights with neither file are refused naming both."""
    _, _, out = exported(True, tmp_path)
    os.remove(os.path.join(out, "optimizer.safetensors"))
    convert.main(["to-hf", out, str(tmp_path / "hf")])
    assert json.load(open(tmp_path / "hf" / "config.json"))["n_layer"] == 2
    os.remove(os.path.join(out, "trainer_state.json"))
    with pytest.raises(SystemExit) as e:
        convert.main(["to-hf", out, str(tmp_path / "hf2")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds weights alone, with neither trainer_state.json" in err


def test_init_from_a_state_at_or_past_train_steps_is_refused_in_both_backends(tmp_path, capsys):
    """A full training state at step 3 with train.steps=3 printed "already trained to step 3; nothing to do",
    exit 0, and left a new run folder that trained nothing. Refused, in both backends, with the key to raise, and
    by jaxtrain before it compiles the step (minutes for a large model)."""
    cfg = make_cfg(True)
    with pytest.raises(UserError, match=r"init.from=x is a training state at step 3, at or past train.steps=3: "
                                        r"raise train.steps"):
        same_run.check_init_step(dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, from_="x"),
                                                     train=dataclasses.replace(cfg.train, steps=3)), 3)
    same_run.check_init_step(cfg, 3)  # train.steps=10: goes on
    from jaxtrain import prepare, run
    from torchref import run as torchref_run
    _, _, out = exported(True, tmp_path)
    tokens = np.random.default_rng(0).integers(0, V, 5000, dtype=np.uint16)
    prepare.write_token_dir(str(tmp_path / "data"), tokens, tokens, V, "bytes")
    for backend, train in (("jaxtrain", run.train), ("torchref", torchref_run.train)):
        argv = [*make_cfg_args(True), f"--data.path={tmp_path / 'data'}", f"--init.from={out}",
                f"--run.out_dir={tmp_path / backend}", f"--train.steps={STEPS}", "--log.sample_tokens=0"]
        with pytest.raises(UserError, match=f"is a training state at step {STEPS}, at or past train.steps={STEPS}"):
            train(config.load(argv))
        assert not os.path.exists(tmp_path / backend / "config.yaml")
        assert "compiled the train step" not in capsys.readouterr().err


def test_to_hf_writes_no_tokenizer_but_the_one_the_run_trained_with(tmp_path, capsys):
    """A byte run whose data folder was prepared again as GPT-2 BPE got GPT-2's vocab.json and merges.txt beside its
    64-row model: to-hf read the folder's meta.json without the checkpoint's data fingerprint, which
    jaxtrain.sample checks. Now it writes no tokenizer, saying why; and a checkpoint older than fingerprints, which
    cannot tell, gets none either: GPT-2's 50257 tokens are more than its 64 embedding rows."""
    data_dir = str(tmp_path / "tokens")
    byte_ids = np.frombuffer(b"some text to train on, " * 40, np.uint8)
    prepare.write_token_dir(data_dir, byte_ids, byte_ids, 256, "bytes")
    trained_on = data.load(config.DataConfig(path=data_dir), 16).fingerprint
    step_dir = _saved_run(tmp_path, 0, trained_on, None, f"--data.path={data_dir}")
    gpt2_ids = np.random.default_rng(0).integers(0, 50257, 2000, dtype=np.uint16)
    prepare.write_token_dir(data_dir, gpt2_ids, gpt2_ids, 50257, "gpt2")  # the folder prepared again
    capsys.readouterr()
    convert.main(["to-hf", step_dir, str(tmp_path / "hf")])
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    assert capsys.readouterr().err.endswith(
        f"; no tokenizer files: the run's data folder {data_dir} no longer holds the data the run trained on (its "
        f"data fingerprint changed: prepared again since), so its meta.json does not say the run's tokenizer; pass "
        f"--tokenizer bytes or --tokenizer gpt2, the one the run's data used\n")
    convert.main(["to-torch", step_dir, str(tmp_path / "torch")])
    _edit_trainer_state(lambda state: state.update(data_fingerprint=None))(str(tmp_path / "torch"))  # an older one
    capsys.readouterr()
    convert.main(["to-hf", str(tmp_path / "torch"), str(tmp_path / "hf-older")])
    assert sorted(os.listdir(tmp_path / "hf-older")) == ["config.json", "model.safetensors"]
    assert capsys.readouterr().err.endswith(
        f"; no tokenizer files: the run's data folder names GPT-2's BPE, whose 50257 tokens are more than the "
        f"model's {V} embedding rows: the run was trained with another tokenizer\n")


def test_an_empty_folder_behind_a_symlink_receives_each_conversion(tmp_path):
    """DST a symlink to an empty folder (or an empty mount point: neither can a rename replace) was accepted, then
    the rename onto it failed with a raw OSError, exit 1. Each converter writes its files into the folder, and the
    link stays a link."""
    step_dir = _saved_run(tmp_path)
    expected = {"to-torch": ["model.safetensors", "optimizer.safetensors", "trainer_state.json"],
                "to-hf": ["config.json", "model.safetensors"], "from-hf": ["config.json", "model.safetensors"]}
    for command, src in (("to-torch", step_dir), ("to-hf", step_dir), ("from-hf", str(tmp_path / "to-hf-link"))):
        (tmp_path / command).mkdir()
        os.symlink(tmp_path / command, tmp_path / f"{command}-link")
        convert.main([command, src, str(tmp_path / f"{command}-link")])
        assert os.path.islink(tmp_path / f"{command}-link")
        assert sorted(os.listdir(tmp_path / command)) == expected[command], command


def test_an_existing_folder_is_left_as_it_was_when_the_conversion_fails_or_it_gets_files_meanwhile(tmp_path):
    """Writing into an existing empty folder: a failed write leaves it empty, and a file that appears in it while
    the conversion is written is never replaced: refused, naming it."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError, match="disk full"):
        with torch_format.folder_into_place(str(out)) as tmp:
            (pathlib.Path(tmp) / torch_format.MODEL).write_text("half written")
            raise OSError("disk full")
    assert os.listdir(out) == []
    with pytest.raises(UserError, match=f"{out} was empty and now holds 'model.safetensors', written there while"):
        with torch_format.folder_into_place(str(out)) as tmp:
            (pathlib.Path(tmp) / torch_format.MODEL).write_text("the conversion's")
            (out / torch_format.MODEL).write_text("the user's")
    assert os.listdir(out) == [torch_format.MODEL] and (out / torch_format.MODEL).read_text() == "the user's"
