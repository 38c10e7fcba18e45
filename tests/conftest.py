"""Shared by the end-to-end tests of this folder."""

import collections
import itertools
import os

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """Where the embedded corpus is prepared: once for the whole session (a few seconds each time)."""
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A GCS emulator on 127.0.0.1 for the session, with its environment set in this process (before any client
    reads it: TensorStore reads its variable once) and so in every subprocess; yields a function that creates a
    new bucket and returns its gs:// URL."""
    import gcs_emulator
    from google.cloud import storage

    process, env = gcs_emulator.start(str(tmp_path_factory.mktemp("gcs")))
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    client, names = storage.Client(), itertools.count()

    def bucket() -> str:
        name = f"bucket-{next(names)}"
        client.create_bucket(name)
        return f"gs://{name}"

    yield bucket
    gcs_emulator.stop(process)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def wandb_offline(tmp_path_factory):
    """W&B's environment for the session, in this process and every subprocess: offline runs, no error reports,
    its config and cache folders in a temporary folder, no API key, and its server address a port on 127.0.0.1
    where nothing listens, so that nothing here can reach a network even if a run went online."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    home = tmp_path_factory.mktemp("wandb-home")
    env = {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false", "WANDB_SILENT": "true",
           "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port}", "WANDB_API_KEY": None,
           "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "NETRC": str(home / "netrc")}
    saved = {key: os.environ.get(key) for key in env}
    _set_environ(env)
    yield env
    _set_environ(saved)


def _set_environ(values: dict) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_terminal_summary(terminalreporter):
    """test_fuzz.py's closing line: how many invalid inputs its tests generated, by kind, summed from the reports'
    `fuzz_invalid_inputs` property (what its tests record: reports come back from xdist's workers, prints do not)."""
    invalid = collections.Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, counts in getattr(report, "user_properties", ()):
                if name == "fuzz_invalid_inputs" and report.when == "teardown":
                    invalid.update(counts)
    if invalid:
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(invalid.items()))
        terminalreporter.write_line(f"test_fuzz: {sum(invalid.values())} generated invalid inputs refused ({kinds})")
