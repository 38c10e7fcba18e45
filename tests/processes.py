"""The processes tests start: whether one has ended (for the tests that stop processes, a stage past its cap or
CI's background install, and check that nothing they started is left running), and a run of several processes on
this machine, whose coordinator listens on 127.0.0.1 only: started, and waited for with none left running."""

import os
import socket
import subprocess
import time


def alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie has ended (nobody reaps a killed orphan in some containers)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def ended_within(pid: int, seconds: float = 5.0) -> bool:
    """Whether process `pid` has ended within `seconds` from now (a killed process takes a moment to go)."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator_env(processes: int) -> dict[str, str]:
    """The variables that make `processes` jaxtrain processes on this machine one run (each adds its JAX_PROCESS_ID):
    the coordinator on a free port of 127.0.0.1, bound there too, where jax would bind every interface ([::]) unless
    JAX_COORDINATOR_BIND_ADDRESS says otherwise (jax._src.distributed, 0.10 to 0.12)."""
    address = f"127.0.0.1:{free_port()}"
    return {"JAX_COORDINATOR_ADDRESS": address, "JAX_COORDINATOR_BIND_ADDRESS": address,
            "JAX_NUM_PROCESSES": str(processes)}


def start_processes(argvs: list[list[str]], devices_each: int, coordinator: dict[str, str] | None = None,
                    **popen_kwargs) -> list[subprocess.Popen]:
    """Process i runs argvs[i] as process i of one run, on `devices_each` fake CPU devices; `coordinator` is a fresh
    coordinator_env unless given (a second launch on a live run's coordinator). One process is a plain run,
    joining no coordinator."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}")
    if len(argvs) == 1:
        return [subprocess.Popen(argvs[0], env=env, **popen_kwargs)]
    env.update(coordinator or coordinator_env(len(argvs)))
    return [subprocess.Popen(argv, env=dict(env, JAX_PROCESS_ID=str(i)), **popen_kwargs)
            for i, argv in enumerate(argvs)]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Each process's (exit code, stdout, stderr), waiting up to `timeout` s for each; none is left running, even
    on a timeout or an error: a process left waiting for the others would wait for good."""
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
