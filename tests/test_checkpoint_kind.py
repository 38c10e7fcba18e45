"""jaxtrain/checkpoint_kind.py on folders as the tools write them: a jaxtrain run saved by the Checkpointer (Orbax),
torch-format folders written by the converter, and a torchref-style run of them; each is told for what it is, and a
run folder of the other backend is refused with the way to use it."""

import os
import re
import shutil

import jax.numpy as jnp
import pytest

from jaxtrain import checkpoint, checkpoint_kind, config, step, torch_format
from jaxtrain.errors import UserError

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
    steps."""
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
    return {"jaxtrain run": str(root / "jaxtrain-run"), "jaxtrain step": str(root / "jaxtrain-run/checkpoints/20"),
            "torch": str(root / "torch"), "torchref run": str(root / "torchref-run"), "other": str(root)}


@pytest.mark.parametrize("name,expected", [("jaxtrain run", "jaxtrain run"), ("jaxtrain step", "jaxtrain step"),
                                           ("torch", "torch"), ("torchref run", "torchref run"), ("other", None)])
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
                     "python -m jaxtrain.convert to-torch {jaxtrain step} DST, then --init.from=DST")])
def test_a_jaxtrain_checkpoint_given_as_a_torch_source_says_how_to_use_it(folders, name, says):
    with pytest.raises(UserError) as e:
        checkpoint_kind.check_torch_source(folders[name], "init.from")
    assert str(e.value) == f"init.from={folders[name]!r} " + says.format(**folders)


def test_a_torch_source_that_is_no_folder_says_so(folders):
    checkpoint_kind.check_torch_source(folders["torch"], "init.from")
    missing, a_file = f"{folders['other']}/nowhere", f"{folders['torch']}/model.safetensors"
    with pytest.raises(UserError, match=f"^init.from='{re.escape(missing)}' does not exist; point it at a torch"):
        checkpoint_kind.check_torch_source(missing, "init.from")
    with pytest.raises(UserError, match=f"^init.from='{re.escape(a_file)}' is a file; point it at a torch"):
        checkpoint_kind.check_torch_source(a_file, "init.from")
