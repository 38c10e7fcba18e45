"""Shared by the end-to-end tests of this folder."""

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """Where the embedded corpus is prepared: once for the whole session (a few seconds each time)."""
    return str(tmp_path_factory.mktemp("corpus"))
