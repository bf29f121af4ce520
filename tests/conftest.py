"""Shared fixtures: SmolLM2-135M's tokenizer, tiny random models built on it, a test app, a Neurocache adapter for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.memories.neurocache.adapter import CacheAttention, Neurocache, NeurocacheConfig
from engine.memories.neurocache.adapter_io import save_adapter
from engine.models import cpu_kernels
from engine.models.loader import small_model_dir
from server.app import create_app
from tests.helpers import CACHE_DIR, FIXTURES, TEST_DEVICE, int4_rounds_inputs, make_tiny_llama, tiny_settings, wait_ready


@pytest.fixture(autouse=True)
def _test_device() -> Iterator[None]:
    if TEST_DEVICE == "cpu":
        yield
        return
    with torch.device(TEST_DEVICE):
        yield


@pytest.fixture(params=["avx2", "avx2_int8", "avx512", "vnni"])
def kernel_set(request):
    """The matmuls' AVX2 versions (int4 on float32 inputs), then with int4 on inputs rounded to int8,
    then their AVX-512 ones (float32 inputs), then those with int4 and int8 on int8 inputs (AVX-512
    VNNI), where the CPU has each."""
    if cpu_kernels.library() is None:
        pytest.skip("the CPU kernels cannot be built here")
    before = cpu_kernels.use_avx512(), cpu_kernels.use_int8_inputs()
    try:
        wide = request.param in ("avx512", "vnni")
        if cpu_kernels.use_avx512(wide) != wide:
            pytest.skip("no AVX-512 on this CPU")
        cpu_kernels.use_int8_inputs(request.param.endswith(("int8", "vnni")))
        if request.param == "vnni" and not int4_rounds_inputs():
            pytest.skip("no AVX-512 VNNI on this CPU")
        yield request.param
    finally:
        cpu_kernels.use_avx512(before[0])
        cpu_kernels.use_int8_inputs(before[1])


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The small model (SmolLM2-135M) as safetensors (converted once from the wheel's GGUF)."""
    return small_model_dir(CACHE_DIR)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, default_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def embedder():
    from engine.models.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def served_embedder():
    """The sentence embedder as the server loads it: MiniLM with the shipped adapter merged."""
    from engine.config import SHIPPED_EMBEDDER_ADAPTER
    from engine.models.embedder import Embedder

    return Embedder(adapter=SHIPPED_EMBEDDER_ADAPTER)


@pytest.fixture(scope="session")
def alice() -> str:
    return (FIXTURES / "alice29.txt").read_text(encoding="utf-8")


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


@pytest.fixture(scope="module")
def shared_client(tiny_dir: Path) -> Iterator[TestClient]:
    """One app for a module's tests that read only what they make themselves (their own sessions,
    refusals, stateless routes), never the server's lists, metrics or settings: an app started
    once rather than once a test."""
    with TestClient(create_app(tiny_settings(tiny_dir))) as client:
        wait_ready(client)
        yield client


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    torch.manual_seed(0)  # before the adapter's layers are made: the same adapter whatever ran before
    neurocache = Neurocache(model, NeurocacheConfig(top_k=4, capacity=4096, lora_rank=4))
    with torch.no_grad():
        for module in neurocache.cache_attention.values():
            attention = cast(CacheAttention, module)
            attention.gate.fill_(3.0)
            attention.o.weight.mul_(200.0)  # a loud cache branch, so its effect shows in sampled text
    folder = tmp_path_factory.mktemp("adapters")
    save_adapter(neurocache, AutoTokenizer.from_pretrained(tiny_dir), folder / tiny_dir.name, note="test adapter")
    return folder
