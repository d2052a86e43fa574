"""Fixtures of the unit tests that need more than one test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random-weight Llama and its freshly trained tokenizer, saved as a pretrained directory
    (nothing downloaded); built once per session (~1 s), read-only for the tests."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from flotilla.models._hf_tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
