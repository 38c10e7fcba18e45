"""Scale-out on this machine: fake CPU devices for the (data, fsdp) mesh, and processes on localhost for hosts.

Each case trains the same small model as a one-device run and must give the same losses: the global batch, the
params and the update are the same; only the order of the cross-device sums differs (fp32 rounding).
"""

import contextlib
import functools
import os
import socket
import subprocess
import sys
import time
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import Mesh

import compiled_hlo
from processes import finish, start_processes

from parity_tests.runs import read_metrics
from jaxtrain import config, mesh, prepare, run, target_devices
from jaxtrain.errors import UserError

SMALL = ["--config", "configs/tiny.yaml", "--model.n_layer=2", "--model.d_model=32", "--model.n_head=2",
         "--model.seq_len=32", "--data.batch_size=16", "--optim.grad_accum_steps=2", "--train.steps=4",
         "--optim.warmup_steps=1", "--checkpoint.every=2", "--train.eval_every=2", "--train.eval_batches=2",
         "--log.progress=false", "--train.precision=fp32", "--log.sample_tokens=0"]
# Sharded runs reduce gradients across devices in another order: fp32 rounding of sums, amplified over 4 Adam
# steps by at most a few ulps of O(1) losses.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory, cache_dir):
    out_dir = str(tmp_path_factory.mktemp("one"))
    run.train(config.load(SMALL + [f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}"]))
    return losses(out_dir)


def losses(out_dir):
    return [line.get("loss", line.get("eval_loss")) for line in read_metrics(out_dir)]


def test_fsdp_shards_the_largest_divisible_axis():
    devices = np.array(jax.devices() * 4)[:4].reshape(1, 4)  # sharding specs only: devices may repeat
    m = Mesh(devices, ("data", "fsdp"))
    tree = {"kernel": jax.ShapeDtypeStruct((32, 96), np.float32), "bias": jax.ShapeDtypeStruct((6,), np.float32),
            "count": jax.ShapeDtypeStruct((), np.int32)}
    specs = jax.tree.map(lambda s: tuple(s.spec), mesh.fsdp_sharding(m, tree))
    assert specs == {"kernel": (None, "fsdp"), "bias": (None,), "count": ()}  # 6 does not split in 4


EIGHT_DEVICE_SCRIPT = """
import sys
from jaxtrain import config, run
cfg = config.load(sys.argv[1:])
trainer = run.Trainer(cfg)
kernel = trainer.abstract_state.params["h"][0]["mlp"]["c_fc"]["kernel"]
print("devices", len(trainer.mesh.devices.flat), "kernel spec", tuple(kernel.sharding.spec), flush=True)
trainer.close()
run.train(cfg)
"""


@pytest.mark.parametrize("vocab_tiles", [1, 4])
def test_eight_devices_data_and_fsdp(tmp_path, cache_dir, one_device_losses, vocab_tiles):
    """With model.vocab_tiles, each device sums its share of the head's gradient over the tiles (loss._by_shard):
    the losses are still the one-device run's (whose logits are whole), up to the order of fp32 sums."""
    out_dir = str(tmp_path / "eight")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", EIGHT_DEVICE_SCRIPT, *SMALL, f"--run.out_dir={out_dir}",
                           f"--data.cache_dir={cache_dir}", "--mesh.fsdp=4", f"--model.vocab_tiles={vocab_tiles}"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "devices 8 kernel spec (None, 'fsdp')" in proc.stdout  # (32, 128): its 128 columns split over fsdp=4
    np.testing.assert_allclose(losses(out_dir), one_device_losses, rtol=LOSS_RTOL)


# Compiles the train step on 8 fake devices and prints its optimized HLO.
COMPILED_HLO_SCRIPT = """
import sys
from jaxtrain import checkpoint, config, dryrun, mesh
cfg = config.load(sys.argv[1:])
dryrun.use_fake_devices(8)
device_mesh = mesh.make_mesh(cfg)
state = checkpoint.abstract_state(cfg, cfg.model.vocab_size, device_mesh)
print(dryrun.compiled_step(cfg, state, device_mesh).as_text())
""".strip()
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
D, V, T = 384, 256, 64  # the model's d_model, vocabulary and sequence length: a vocabulary narrower than d_model


@functools.cache
def collectives(vocab_tiles: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(op, "loop" or "once", shape) of each array the 8-device FSDP train step (fsdp 4 x data 2) moves between
    devices, one per array a collective moves (a combined all-reduce moves several); "loop" where it runs in the
    body of a loop (compiled_hlo.instructions)."""
    overrides = ["--config", "configs/tiny.yaml", "--model.n_layer=2", f"--model.d_model={D}", "--model.n_head=6",
                 f"--model.seq_len={T}", f"--model.vocab_size={V}", "--data.batch_size=32", "--mesh.fsdp=4",
                 "--optim.grad_accum_steps=1", f"--model.vocab_tiles={vocab_tiles}"]
    proc = subprocess.run([sys.executable, "-c", COMPILED_HLO_SCRIPT, *overrides], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [(op, "loop" if looped else "once", tuple(int(n) for n in shape.split("[")[1][:-1].split(",") if n))
            for op, looped, shapes in compiled_hlo.instructions(proc.stdout) if op in COLLECTIVES for shape in shapes]


@pytest.mark.parametrize("vocab_tiles", [1, 4])
def test_fsdp_moves_params_never_activations(vocab_tiles):
    """Under FSDP a device gathers whole params (all-gather) and reduces gradients; its activations stay its own
    rows of the batch. So every all-gather in the compiled step produces a param's full shape (in either
    orientation), and nothing is permuted or exchanged all-to-all. A vocabulary (256) narrower than d_model (384)
    shards the embedding along d_model; without mesh.batch_sharded, XLA carried that split into the activations
    and gathered them back (here: [16,64,384] all-gathers; with remat, collective-permutes too). With vocabulary
    tiles, a tile of consecutive tokens would lie on some devices only: XLA moved the hidden states between
    devices for the scan over tiles (all-gathers of [1,256,384], collective-permutes); loss._tiled's strided tiles
    keep each device's rows."""
    param_shapes = {(V, D), (T, D), (D,), (D, 3 * D), (3 * D,), (D, D), (D, 4 * D), (4 * D,), (4 * D, D)}
    moved = [(op, shape) for op, _, shape in collectives(vocab_tiles) if op not in ("all-reduce", "reduce-scatter")]
    assert moved and all(op == "all-gather" for op, _ in moved), moved
    assert {tuple(sorted(s)) for _, s in moved} <= {tuple(sorted(s)) for s in param_shapes}, moved


def test_vocab_tiles_reduce_each_gradient_once():
    """With vocabulary tiles as without, the step reduces each gradient over the devices once, outside any loop:
    no array bigger than a scalar is reduced in the body of the scan over tiles. When each tile's share of the
    head weight's gradient was summed over all the tokens, XLA reduced it in that body, once per tile (all-reduces
    of [384,256] and of a [96,256] shard); loss._by_shard keeps each device's share on it until the scan is done."""
    for tiles in (1, 4):
        reduced = [(where, shape) for op, where, shape in collectives(tiles) if op in ("all-reduce", "reduce-scatter")]
        assert ("once", (D, V)) in reduced or ("once", (V, D)) in reduced, (tiles, reduced)
        assert [r for r in reduced if r[0] == "loop" and r[1]] == [], tiles


@pytest.mark.parametrize("n_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("vocab_tiles", [1, 2, 8, 64, 128, 256])
def test_vocab_tiles_must_divide_each_devices_tokens(n_devices, vocab_tiles):
    """Each device holds 16 / n_devices sequences of 32 tokens of a micro-batch of 512 (every tile count here
    divides that): the tiles must divide the device's tokens, so that a tile's rows on a device are its own."""
    cfg = config.load([*SMALL, f"--model.vocab_tiles={vocab_tiles}", "--optim.grad_accum_steps=1"])
    device_tokens = {1: 512, 2: 256, 4: 128, 8: 64}[n_devices]
    if device_tokens % vocab_tiles == 0:
        assert mesh.validate_devices(cfg, n_devices) == (n_devices, 1)
    else:
        with pytest.raises(UserError, match=rf"^model\.vocab_tiles={vocab_tiles} does not divide the "
                                            rf"{device_tokens} tokens each of the {n_devices} devices"):
            mesh.validate_devices(cfg, n_devices)


def test_batch_must_split_over_devices(tmp_path, cache_dir):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", *SMALL, f"--run.out_dir={tmp_path}",
                           f"--data.cache_dir={cache_dir}", "--data.batch_size=12"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "does not split over 8 devices" in proc.stderr


@pytest.mark.slow
def test_two_processes_on_localhost(tmp_path, cache_dir, one_device_losses):
    """Two hosts of two devices each: every process loads only its rows of the batch."""
    out_dir = str(tmp_path / "hosts")
    cmd = [sys.executable, "-m", "jaxtrain.run", *SMALL, f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
           "--mesh.fsdp=2"]
    procs = start_processes([cmd] * 2, 2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = [out for _, out, _ in finish(procs, 600)]
    assert [p.returncode for p in procs] == [0, 0], outputs
    np.testing.assert_allclose(losses(out_dir), one_device_losses, rtol=LOSS_RTOL)
    assert sorted(os.listdir(os.path.join(out_dir, "checkpoints"))) == ["2", "4"]


def _two_hosts_on(tmp_path, cache_dir, data_paths: list[str]) -> list[tuple[int, str]]:
    """(exit code, stderr) of the two processes of one run, each reading its own data.path."""
    out_dir = str(tmp_path / "run")
    procs = start_processes(
        [[sys.executable, "-m", "jaxtrain.run", *SMALL, f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
          "--mesh.fsdp=2", f"--data.path={path}", "--train.steps=2"] for path in data_paths], 2,
        stderr=subprocess.PIPE, text=True)
    return [(code, err) for code, _, err in finish(procs, 300)]


def test_hosts_whose_data_differs_or_fails_to_load_all_stop_in_one_line(tmp_path, cache_dir):
    """Each host reads its own copy of the data folder. Another text on host 1 trained, exit 0; a copy host 1 lacks
    failed there alone, and host 0 waited in a collective until the launch's deadline (5 min, then SIGABRT)."""
    tokens = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint16)
    for name, train in (("a", tokens), ("b", tokens[::-1].copy())):
        prepare.write_token_dir(str(tmp_path / name), train, tokens[:1000], 256, "bytes")
    other = _two_hosts_on(tmp_path, cache_dir, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert [code for code, _ in other] == [2, 2], other
    for (code, err), own in zip(other, "ab"):
        assert err.count("\n") == 1 and err.startswith(
            f"error: process(es) 1 read other data than process 0 (the tokens or meta.json differ: data fingerprints "
            f"differ; this process read data.path={tmp_path / own}); each host must hold the same data"), err
    missing = _two_hosts_on(tmp_path, cache_dir, [str(tmp_path / "a"), str(tmp_path / "missing")])
    assert [code for code, _ in missing] == [2, 2], missing
    assert missing[0][1].startswith("error: process(es) 1 could not load the data (their output says why)")
    assert missing[1][1].startswith(f"error: data folder '{tmp_path / 'missing'}' not found"), missing[1][1]


# Every variable that makes a launch of several processes, cleared by the `launch` fixture.
LAUNCH_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS", "JAX_COORDINATOR_PORT",
                    *mesh.BY_HAND_VARIABLES, "SLURM_NTASKS", *mesh.SLURM_STEP_VARIABLES, "TPU_WORKER_HOSTNAMES",
                    "TPU_WORKER_ID", "MEGASCALE_COORDINATOR_ADDRESS")


@pytest.fixture
def launch(monkeypatch):
    """No launch's variables and no TPU device files; jax.distributed.initialize recorded, not run: its calls."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(target_devices, "has_tpu_device_files", lambda: False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    return calls


@pytest.fixture
def tpu_vm(monkeypatch, launch):
    """A Cloud TPU VM (libtpu found its chips, its device files are there) whose GCE metadata server answers as
    jax asks it (jax._src.clusters.cloud_tpu_cluster); set the slice with the returned function."""
    from jax._src.clusters import cloud_tpu_cluster, cluster
    metadata = {"tpu-env": ""}
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", lambda key: (metadata.get(key, ""), 200 if key in metadata
                                                                        else 404))
    for module in (cloud_tpu_cluster, cluster):
        monkeypatch.setattr(module, "running_in_cloud_tpu_vm", True)
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)  # jax sets it where it finds no TPU chips, as here
    monkeypatch.setattr(cloud_tpu_cluster.BaseTpuCluster, "wait_for_coordinator",
                        classmethod(lambda cls, address, timeout_s: None))  # a DNS lookup of the worker's address
    monkeypatch.setattr(target_devices, "has_tpu_device_files", lambda: True)

    def slice_of(hosts: int, worker: int | None):
        """The slice's `hosts` workers, this one `worker`; none for a VM that is no TPU VM worker (GKE's)."""
        if hosts:
            metadata.update({"agent-worker-number": str(worker),
                             "worker-network-endpoints": ",".join(f"10.0.0.{i}" for i in range(hosts))})
    return slice_of


@pytest.mark.parametrize("env, joins, kwargs", [
    ({}, None, None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None, None),  # one task (an salloc shell on an 8-GPU node)
    ({"SLURM_JOB_ID": "7"}, None, None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "9",
      "SLURM_LOCALID": "1"}, "as task 9 of 16 of the SLURM step on n[1-2];",  # srun: one per GPU, JAX's detection
     {"coordinator_address": "n1:61447", "num_processes": 16, "process_id": 9}),  # port 61440 + job id % 4096
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
     "as process 3 of 4, through the coordinator at 10.0.0.1:1234;",
     {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}),
])
@pytest.mark.parametrize("join_s", [0.0, 0.5])
def test_which_launches_join_a_cluster(monkeypatch, capsys, launch, env, joins, kwargs, join_s):
    """Which launches join. A join still waiting after JOIN_QUIET_S (0.1 s here) says so, naming who this process is
    and the wait: when another process never joins, jax aborts this one from C++ after 300 s with no Python
    exception, and that line is what gives the abort its context. A quick join says nothing."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(mesh, "JOIN_QUIET_S", 0.1)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: (launch.append(kw), time.sleep(join_s)))
    mesh.init_distributed()
    time.sleep(0.2)  # a line said after the join would show by now
    said = capsys.readouterr().err
    if joins is None:
        assert (launch, said) == ([], "")
        return
    assert launch == [dict(kwargs, initialization_timeout=300)]
    assert said == ("" if join_s == 0.0 else f"waiting for the run's other processes to join, {joins} jax waits up "
                                             f"to 300 s for all of them, then aborts this process\n")


@pytest.mark.parametrize("hosts, worker, env, joins", [
    (16, 3, {}, {"coordinator_address": "10.0.0.0:8482", "num_processes": 16, "process_id": 3}),  # a v5e-64
    (16, 3, {"JAX_COORDINATOR_PORT": "9999"},
     {"coordinator_address": "10.0.0.0:9999", "num_processes": 16, "process_id": 3}),
    (1, 0, {}, None),  # a v5e-8: one host, nothing to join
    (0, None, {"TPU_WORKER_HOSTNAMES": "t0,t1", "TPU_WORKER_ID": "1"},  # GKE: its variables, no worker metadata
     {"coordinator_address": "t0:8482", "num_processes": 2, "process_id": 1}),
])
def test_a_tpu_vm_joins_the_slice_jax_finds(monkeypatch, launch, tpu_vm, hosts, worker, env, joins):
    """`gcloud compute tpus tpu-vm ssh --worker=all`: nothing in the environment names the slice; jax finds it in
    the metadata server, which jaxtrain's join lets it ask wherever the TPU's device files are (without the join,
    orbax refuses to save from a pod: it needs jax.distributed). One host joins nothing."""
    tpu_vm(hosts, worker)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    mesh.init_distributed()
    assert launch == ([dict(joins, initialization_timeout=300)] if joins else [])


def test_tpu_device_files_where_jax_finds_no_tpu_vm_join_nothing(monkeypatch, launch):
    """/dev/vfio/N of another device, or TPU device files without libtpu: jax finds no slice; one process, as
    before, not jax's "coordinator_address should be defined" ValueError."""
    monkeypatch.setattr(target_devices, "has_tpu_device_files", lambda: True)
    mesh.init_distributed()
    assert launch == []


def test_one_process_in_an_allocation_of_several_tasks_is_one_line(monkeypatch, launch):
    """`python -m jaxtrain.run` straight in an salloc shell or batch script of 8 tasks (no srun): SLURM_NTASKS says
    8 but no step's variables say which task this is. Refused naming srun, not jax's ValueError traceback."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    with pytest.raises(UserError, match=r"^SLURM_NTASKS=8, but this process is not a task of an srun step "
                                        r"\(SLURM_STEP_NODELIST is not set\).*srun"):
        mesh.init_distributed()
    assert launch == []


@pytest.mark.parametrize("count, index", [("2", "2"), ("2", "-1"), ("0", "0")])
def test_a_process_id_outside_the_process_count_is_one_line(monkeypatch, launch, count, index):
    """JAX_PROCESS_ID counts from 0 (a 1-based id on the last of two processes is 2): refused before joining, not
    jax's ValueError traceback."""
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", count)
    monkeypatch.setenv("JAX_PROCESS_ID", index)
    with pytest.raises(UserError, match=rf"^JAX_PROCESS_ID={index} with JAX_NUM_PROCESSES={count}: "):
        mesh.init_distributed()
    assert launch == []


@pytest.mark.parametrize("env, named", [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_NUM_PROCESSES=2 is set, so this is one process of several, but "
                                 "JAX_COORDINATOR_ADDRESS is not: "),
    ({"JAX_PROCESS_ID": "1", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1",
      "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}, "JAX_PROCESS_ID=1 is set, "),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDR": "10.0.0.1:1234"},
     "JAX_COORDINATOR_ADDRESS is not (JAX_COORDINATOR_ADDR is set: a misspelling?): set JAX_COORDINATOR_ADDRESS="),
])
def test_a_process_count_without_a_coordinator_address_is_one_line(monkeypatch, launch, env, named):
    """JAX_NUM_PROCESSES or JAX_PROCESS_ID without JAX_COORDINATOR_ADDRESS (forgotten, or misspelled): each host
    would train alone, as process 0 of 1, writing the same run folder. Refused, naming the missing variable."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as refused:
        mesh.init_distributed()
    assert named in str(refused.value) and "\n" not in str(refused.value)
    assert launch == []


HOSTS = st.one_of(st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?){0,3}\Z"),
                  st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda a: f"[{a}]"))
PORTS = st.integers(1, 65535)
# no NUL: an environment variable cannot hold one (os.environ refuses it before jaxtrain could)
NOT_PORTS = st.one_of(st.text(st.characters(exclude_characters="\x00")).filter(
                          lambda text: not (text.isascii() and text.isdigit())),
                      st.sampled_from([0, 65536, 99999, 123456]).map(str))


def by_hand_init(address: str) -> list[dict]:
    """init_distributed launched by hand as process 0 of 2 through `address`; jax.distributed.initialize's calls."""
    with mock.patch.dict(os.environ, {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
                                      "JAX_PROCESS_ID": "0"}), \
            mock.patch.object(jax.distributed, "initialize") as initialize:
        mesh.init_distributed()
    return [call.kwargs for call in initialize.call_args_list]


@given(host=HOSTS, port=PORTS)
def test_a_coordinator_address_of_host_and_port_is_taken(host, port):
    """A name, an IPv4 address, or an IPv6 one in brackets, then a port: handed to jax as it is."""
    assert [call["coordinator_address"] for call in by_hand_init(f"{host}:{port}")] == [f"{host}:{port}"]


@given(address=st.one_of(HOSTS, st.ip_addresses(v=6).map(str),  # no port ("localhost")
                         st.builds("{}:{}".format, HOSTS, NOT_PORTS),  # a port that is no port
                         st.builds("{}:{}".format, st.ip_addresses(v=6), PORTS)))  # unbracketed: gRPC sees no port
def test_a_coordinator_address_without_a_port_is_one_line(address):
    """jax splits the port off with rsplit(':')[1]: an address without one was an IndexError inside jax; a port
    that is not a number, or an IPv6 address without brackets (gRPC reads it all as the host), failed later in
    gRPC. Refused before joining, naming the address and the form to give."""
    with pytest.raises(UserError, match=r"^JAX_COORDINATOR_ADDRESS=.* is not host:port: give process 0's host and "
                                        r"a port \(1-65535\)"):
        by_hand_init(address)


@pytest.mark.parametrize("port", ["abc", "0", "65536", "8482 "])
def test_a_coordinator_port_that_is_no_port_is_one_line(monkeypatch, launch, port):
    """JAX_COORDINATOR_PORT (what the port-in-use line tells a SLURM or TPU launch to set) becomes the port of the
    address jax finds: one that is no port is refused before joining, not left to gRPC."""
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "1",
                        "SLURM_LOCALID": "1", "JAX_COORDINATOR_PORT": port}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=rf"^JAX_COORDINATOR_PORT='{port}' is not a port: set a free one \(1-65535\)"):
        mesh.init_distributed()
    assert launch == []


@contextlib.contextmanager
def port_held_on_localhost():
    """A port of 127.0.0.1 that a listening socket holds meanwhile (another job's coordinator, a leftover run's)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_coordinator_port_in_use_is_one_line(tmp_path):
    """Process 0's coordinator on a port that something else holds: one line naming the address and the fix, exit
    2; jax's own failure there is a JaxRuntimeError traceback ("Failed to start RPC server") or a segfault."""
    env = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    with port_held_on_localhost() as port:
        address = f"127.0.0.1:{port}"
        env.update(JAX_COORDINATOR_ADDRESS=address, JAX_COORDINATOR_BIND_ADDRESS=address, JAX_NUM_PROCESSES="1",
                   JAX_PROCESS_ID="0")
        proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", *SMALL, f"--run.out_dir={tmp_path}"],
                              capture_output=True, text=True, timeout=300, env=env)
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [
        f"error: the coordinator could not listen on {address}: port {port} is taken, by another job or a leftover "
        f"process on this host (`ss -ltnp 'sport = :{port}'` names it); end that process, or choose a free port in "
        f"JAX_COORDINATOR_ADDRESS, the same in every process, and in JAX_COORDINATOR_BIND_ADDRESS"])


def test_a_slurm_coordinator_port_in_use_names_jax_coordinator_port(monkeypatch, launch):
    """Under SLURM jax takes port 61440 + SLURM_JOB_ID % 4096 (jobs 4096 apart share it): the fix is
    JAX_COORDINATOR_PORT, which jax's cluster detection reads (the port here: bound on 127.0.0.1 alone)."""
    with port_held_on_localhost() as port:
        for name, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "n[1-2]",
                            "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "JAX_COORDINATOR_PORT": str(port),
                            "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(UserError) as refused:
            mesh.init_distributed()
    assert str(refused.value).startswith(f"the coordinator could not listen on 127.0.0.1:{port}: port {port} is "
                                         f"taken")
    assert str(refused.value).endswith("or choose a free port with JAX_COORDINATOR_PORT=<port> in every process's "
                                       "environment (under SLURM: export it before srun), and in "
                                       "JAX_COORDINATOR_BIND_ADDRESS")
    assert launch == []


@pytest.mark.parametrize("overrides, fix", [(["--mesh.fsdp=3"], "set an fsdp that divides 4"),
                                            (["--mesh.data=3", "--mesh.fsdp=1"], "set mesh.data=-1 and an fsdp")])
def test_a_mesh_that_misses_the_devices_names_only_the_keys_to_change(overrides, fix):
    """mesh.data=-1 (the default) already takes the devices fsdp leaves: the fix names it only where it is not -1."""
    with pytest.raises(UserError, match=rf"does not cover the 4 devices; {fix}"):
        mesh.validate_devices(config.load([*SMALL, *overrides]), 4)


@pytest.mark.parametrize("d_model, fsdp, devices, instead", [(40, 16, 16, 8), (48, 32, 32, 16), (30, 4, 8, 2),
                                                              (384, 5, 5, 1), (35, 5, 5, None)])
def test_an_fsdp_that_does_not_divide_d_model_is_refused_naming_one_that_does(d_model, fsdp, devices, instead):
    """fsdp_sharding splits a leaf only along a dimension fsdp divides: an fsdp that divides no d_model-sized
    dimension left the embeddings, LayerNorms and most weights whole on every device, with nothing said (a dry run
    showed the same state per device at fsdp 5 as at 1). The largest divisor of both the devices and d_model,
    worked out here by hand, is named instead."""
    cfg = config.load([*SMALL, f"--model.d_model={d_model}", "--model.n_head=1", f"--mesh.fsdp={fsdp}",
                       f"--data.batch_size={2 * devices}"])
    if d_model % fsdp == 0:
        assert mesh.validate_devices(cfg, devices) == (devices // fsdp, fsdp)
        return
    with pytest.raises(UserError, match=rf"^mesh\.fsdp={fsdp} does not divide model\.d_model={d_model}: .*\(e\.g\. "
                                        rf"{instead}\), or change d_model$"):
        mesh.validate_devices(cfg, devices)


@pytest.mark.parametrize("overrides, devices, fix", [
    (["--mesh.fsdp=8"], 1, "--run.dry_run_devices=N, N a multiple of 8"),
    (["--mesh.data=2", "--mesh.fsdp=4"], 4, "--run.dry_run_devices=8"),
])
def test_a_dry_run_on_too_few_devices_names_run_dry_run_devices(overrides, devices, fix):
    """A pod config dry-run without run.dry_run_devices compiles for this machine's devices: the refusal names the
    count to compile for, beside the config's fix (a smaller fsdp would dry-run another config)."""
    cfg = config.load([*SMALL, *overrides, "--run.dry_run=true"])
    with pytest.raises(UserError) as refused:
        mesh.validate_devices(cfg, devices)
    assert str(refused.value).endswith(f"an fsdp that divides {devices}; or dry-run it for the devices it is meant "
                                       f"for: {fix}")
    with pytest.raises(UserError) as refused:  # a real run has no such way out
        mesh.validate_devices(config.load([*SMALL, *overrides]), devices)
    assert str(refused.value).endswith(f"an fsdp that divides {devices}")


def test_devices_that_are_no_block_of_a_tpu_torus_are_meshed_in_the_order_given():
    """evaluate --devices 3 on a TPU host of 4 chips: create_device_mesh asserts the devices form a whole block of
    the torus; model_mesh lays them out in their order instead (data 3 x fsdp gcd(run's 2, 3) = 1), a mesh arrays
    are placed on. 3 fake CPU devices, given in reverse, with create_device_mesh made to assert as it does there."""
    script = """
import jax, numpy as np
from jaxtrain import mesh
def no_block(*args, **kwargs):
    raise AssertionError("the devices are not a cuboid")  # what mesh_utils._get_physical_tpu_mesh asserts
mesh.mesh_utils.create_device_mesh = no_block
devices = jax.devices()[::-1]
laid_out = mesh.model_mesh(2, devices)
placed = jax.device_put(np.arange(6.0), jax.sharding.NamedSharding(laid_out, jax.sharding.PartitionSpec("data")))
print(dict(laid_out.shape), [d.id for d in laid_out.devices.flat], [s.device.id for s in placed.addressable_shards])
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "{'data': 3, 'fsdp': 1} [2, 1, 0] [2, 1, 0]\n"
