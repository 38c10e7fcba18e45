"""A checkpoint restores on any topology: written by 2 processes x 4 devices on mesh (2, 4), it continues on one
device, on 8 devices as (8, 1) and as (1, 8), and a one-device checkpoint continues on 2 x 4.

Every process joins the save and the restore (orbax writes and reads each process's shards of the global arrays; no
host gathers the state); the restore places each array in the new mesh's sharding (checkpoint.abstract_state).
The batches of a step do not depend on the topology (data.window), so the losses after the restore follow the
uninterrupted one-device run, up to the order of the cross-device sums.
"""

import glob
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from processes import finish, start_processes
from test_mesh import losses
from jaxtrain import config, prepare, run

STEPS, HALF = 8, 4
SMALL = ["--config", "configs/tiny.yaml", "--model.n_layer=2", "--model.d_model=32", "--model.n_head=2",
         "--model.seq_len=32", "--data.batch_size=16", "--optim.grad_accum_steps=2", "--optim.warmup_steps=1",
         f"--optim.decay_steps={STEPS}", f"--checkpoint.every={HALF}", f"--train.eval_every={HALF}",
         "--train.eval_batches=2", "--log.progress=false", "--train.precision=fp32", "--log.sample_tokens=0"]
# fp32: gradients reduced across devices in another order differ by ulps, and 4 Adam steps after the restore
# (lr 1e-3 on O(1) losses) keep that at a few ulps: measured <= 2e-7 relative on this model, margin 50x.
LOSS_RTOL = 1e-5


def launch(out_dir: str, cache_dir: str, steps: int, processes: int, devices: int, fsdp: int, *extra: str,
           resumes_at: int = HALF) -> None:
    """`python -m jaxtrain.run` as `processes` processes on localhost with `devices` fake devices each; it must say
    that it resumes from step `resumes_at` where that checkpoint exists."""
    resumes = os.path.isdir(os.path.join(out_dir, "checkpoints", str(resumes_at)))
    args = [sys.executable, "-m", "jaxtrain.run", *SMALL, f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
            f"--train.steps={steps}", f"--mesh.fsdp={fsdp}", *extra]
    procs = start_processes([args] * processes, devices, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = [out for _, out, _ in finish(procs, 600)]
    assert [p.returncode for p in procs] == [0] * processes, outputs
    assert (f"resuming from step {resumes_at}" in outputs[0]) == resumes, outputs[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    out_dir = str(tmp_path_factory.mktemp("reference"))
    run.train(config.load(SMALL + [f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
                                   f"--train.steps={STEPS}"]))
    return losses(out_dir)


@pytest.fixture(scope="module")
def written_by_two_hosts(tmp_path_factory, cache_dir):
    """A run folder at step 4, written by 2 processes x 4 devices as mesh (data 2, fsdp 4)."""
    out_dir = str(tmp_path_factory.mktemp("two-hosts"))
    launch(out_dir, cache_dir, HALF, processes=2, devices=4, fsdp=4)
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("devices,fsdp", [(1, 1), (8, 1), (8, 8)], ids=["1 device", "(8,1)", "(1,8)"])
def test_two_host_checkpoint_continues_anywhere(devices, fsdp, written_by_two_hosts, reference, tmp_path,
                                                cache_dir):
    out_dir = str(tmp_path / "continued")
    shutil.copytree(written_by_two_hosts, out_dir)
    launch(out_dir, cache_dir, STEPS, processes=1, devices=devices, fsdp=fsdp)
    np.testing.assert_allclose(losses(out_dir), reference, rtol=LOSS_RTOL)


@pytest.mark.slow
def test_one_device_checkpoint_continues_on_two_hosts(reference, tmp_path, cache_dir):
    out_dir = str(tmp_path / "back")
    run.train(config.load(SMALL + [f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
                                   f"--train.steps={HALF}"]))
    launch(out_dir, cache_dir, STEPS, processes=2, devices=4, fsdp=4)
    np.testing.assert_allclose(losses(out_dir), reference, rtol=LOSS_RTOL)


@pytest.mark.slow
def test_a_checkpoint_continues_on_more_devices_with_less_accumulation(reference, tmp_path, cache_dir):
    """Written on one device in 2 micro-batches of 8, continued on 16 devices in one micro-batch of 16, where 8 rows
    would not split over 16 devices: the same batches and the same gradient up to the order of its sums (without
    dropout, optim.grad_accum_steps is how a step is computed, not what; before, the resume refused the change)."""
    out_dir = str(tmp_path / "wider")
    run.train(config.load(SMALL + [f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
                                   f"--train.steps={HALF}"]))
    launch(out_dir, cache_dir, STEPS, 1, 16, 1, "--optim.grad_accum_steps=1")
    np.testing.assert_allclose(losses(out_dir), reference, rtol=LOSS_RTOL)


@pytest.mark.slow
def test_same_topology_resumes_bitwise(written_by_two_hosts, tmp_path, cache_dir):
    """Back on 2 x 4 as (2, 4): the same program on the same shards, so the same bits as never stopping."""
    continued, uninterrupted = str(tmp_path / "continued"), str(tmp_path / "uninterrupted")
    shutil.copytree(written_by_two_hosts, continued)
    launch(continued, cache_dir, STEPS, processes=2, devices=4, fsdp=4)
    launch(uninterrupted, cache_dir, STEPS, processes=2, devices=4, fsdp=4)
    assert losses(continued) == losses(uninterrupted)


@pytest.mark.slow
def test_a_checkpoint_one_host_cannot_read_is_set_aside_on_every_host(reference, tmp_path, cache_dir):
    """Step 4's shards written by process 1 are lost; fsdp spans both processes (2 x 2 devices as (1, 4)), so
    process 0 reads none of them. Every process moves past step 4 and resumes from step 2, as one process would.
    Before, process 0 waited for good in orbax's barrier after its read, and process 1, its next restore meeting
    process 0 there out of step, found none of the checkpoints readable and told the user to start over."""
    out_dir = str(tmp_path / "lost-shards")
    launch(out_dir, cache_dir, HALF, 2, 2, 4, "--checkpoint.every=2")
    lost = glob.glob(os.path.join(out_dir, "checkpoints", str(HALF), "state", "ocdbt.process_1", "d", "*"))
    assert lost, "process 1 wrote no shard files of its own"
    for name in lost:
        os.remove(name)
    launch(out_dir, cache_dir, STEPS, 2, 2, 4, "--checkpoint.every=2", resumes_at=2)
    assert [name.split("-")[0] for name in os.listdir(os.path.join(out_dir, "checkpoints.corrupt"))] == [str(HALF)]
    np.testing.assert_allclose(losses(out_dir), reference, rtol=LOSS_RTOL)


@pytest.mark.slow
def test_hosts_with_other_data_stop_every_host_in_one_line(tmp_path, cache_dir):
    """Process 1's copy of the data differs from process 0's: both stop at the data, each in one line, exit 2 (before,
    process 1 refused to resume and process 0 followed it; other data and no checkpoint trained). Both hosts' copies
    differing from the data that wrote the checkpoint: each refuses to resume from it (before that refusal, process
    0 went on to read the arrays and ended in a traceback when process 1 left). The run folder stays as it was."""
    out_dir, other_data = str(tmp_path / "run"), str(tmp_path / "other-data")
    run.train(config.load(SMALL + [f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
                                   f"--train.steps={HALF}"]))
    (tmp_path / "other.py").write_text("print('other data')\n" * 2000)
    prepare.prepare([str(tmp_path / "other.py")], other_data, "bytes")
    before = sorted(os.listdir(out_dir))
    args = [sys.executable, "-m", "jaxtrain.run", *SMALL, f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
            f"--train.steps={STEPS}", "--mesh.fsdp=4"]

    def errors_of(data_args: list[list[str]]) -> list[list[str]]:
        procs = start_processes([args + extra for extra in data_args], 2, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        outputs = [out for _, out, _ in finish(procs, 600)]
        assert [p.returncode for p in procs] == [2, 2], outputs
        return [[line for line in out.splitlines() if line.startswith(("error:", "Traceback"))] for out in outputs]

    other = f"--data.path={other_data}"
    for errors in errors_of([[], [other]]):
        assert len(errors) == 1 and errors[0].startswith(
            "error: process(es) 1 read other data than process 0 (the tokens or meta.json differ: data fingerprints "
            "differ; "), errors
    for errors in errors_of([[other], [other]]):
        assert len(errors) == 1 and errors[0].startswith(
            f"error: the data ({other_data}) differs from the data that wrote {out_dir}/checkpoints/{HALF} "), errors
    assert sorted(os.listdir(out_dir)) == before and os.listdir(os.path.join(out_dir, "checkpoints")) == [str(HALF)]
