"""Shared fixtures. The embedded model is loaded once per session (it takes seconds)."""

from __future__ import annotations

import os
import tempfile

import pytest

# Nothing the tests run (in process or as a subprocess) may touch the user's own cache directory.
os.environ["MLXKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlxkv-test-cache-")

from mlxkv_inference import MlxAutoregressiveBinding, load_binding


@pytest.fixture(scope="session")
def embedded() -> MlxAutoregressiveBinding:
    """The real embedded SmolLM2-135M-Instruct model (tests using it are named `..._embedded_...`)."""
    return load_binding()
