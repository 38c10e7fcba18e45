"""Shared by the end-to-end tests of this folder."""

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
