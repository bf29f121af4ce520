"""CUDA against CPU: the same computation on both devices gives the same result. Skipped without a
GPU (CI has none); `scripts/gpu/check.sh` runs them on one."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from engine.memories.neurocache.knn import FaissCpuKnn, TorchKnn
from engine.models.loader import load_model
from research.lms import build
from server.app import create_app
from tests.helpers import ARCHS, CACHE_DIR, FIXTURES, SMALL, VARIANTS, VOCAB, adapted, filled_cache, tiny_settings, wait_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_torch_knn_on_cuda_finds_faiss_cpu_neighbours():
    torch.manual_seed(0)
    database, queries = torch.randn(5000, 64), torch.randn(100, 64)
    _, expected = FaissCpuKnn().search(database, queries, k=8)
    _, got = TorchKnn().search(database.cuda(), queries.cuda(), k=8)
    assert torch.equal(got.cpu().sort(-1).values, expected.cpu().sort(-1).values)


@pytest.mark.parametrize("name", ["long-short", "cf-both-p8", "cf-cache-p1-u3"])
def test_compiled_flex_on_cuda_equals_the_cpu_math_path(name):
    arch, flags = VARIANTS[name]
    torch.manual_seed(0)
    model = build(arch, **{**SMALL, **flags}).eval()
    ids = torch.randint(0, 50, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = model.use_kernel("math")(ids)
        got = model.cuda().use_kernel("flex")(ids.cuda())  # compiled on CUDA (research/lms/flex.py)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_neurocache_on_cuda_closed_gate_is_the_base_model_and_matches_cpu(arch):
    model, neurocache, reference = adapted(arch)
    ids = torch.randint(0, VOCAB, (2, 24))
    cache = filled_cache(neurocache)
    with torch.no_grad():
        cpu = model(ids).logits
        model.cuda(), reference.cuda(), neurocache.cuda()
        gpu_cache = neurocache.new_cache()
        gpu_cache.add(cache.states[: cache.size].cuda(), document=0)
        with neurocache.attached([gpu_cache, gpu_cache]):
            with_cache = model(ids.cuda()).logits
        base = reference(ids.cuda()).logits
    torch.testing.assert_close(with_cache, base, rtol=0, atol=1e-6)
    torch.testing.assert_close(base.cpu(), cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_default_model_in_bf16_on_cuda_agrees_with_float32_on_cpu(default_dir):
    """bf16 kernels: next-token choices over a passage of Alice agree with the float32 CPU model."""
    text = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")[20_000:24_000]
    cpu = load_model(str(default_dir), cache_dir=CACHE_DIR, device="cpu", dtype="float32")
    gpu = load_model(str(default_dir), cache_dir=CACHE_DIR, device="cuda", dtype="auto")
    assert gpu.dtype == torch.bfloat16
    ids = cpu.tokenizer(text, return_tensors="pt").input_ids[:, :768]
    with torch.inference_mode():
        expected = cpu.model(ids).logits.argmax(-1)
        got = gpu.model(ids.cuda()).logits.argmax(-1).cpu()
    agreement = (got == expected).float().mean().item()
    print(f"bf16 CUDA vs float32 CPU top-1 agreement: {agreement:.3f}")
    assert agreement > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["truncate", "text", "neurocache"])
def test_a_cuda_server_answers_as_the_cpu_server_does(default_dir, memory):
    """The whole serving path (ingest, memory, prompt, greedy decode) in float32 on both devices."""
    text = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")[:12_000]
    question = {"question": "Where did the White Rabbit go?", "max_tokens": 24}
    answers = []
    for device in ("cpu", "cuda"):
        with TestClient(create_app(tiny_settings(default_dir, device=device, segment_len=256))) as client:
            wait_ready(client)
            session = client.post("/v1/sessions", json={"memory": memory}).json()["id"]
            assert client.post(f"/v1/sessions/{session}/documents", json={"text": text}).status_code == 201
            response = client.post(f"/v1/sessions/{session}/ask", json=question)
            assert response.status_code == 200, response.text
            answers.append(response.json()["answer"])
    print(f"{memory}: {answers}")
    assert answers[0] == answers[1]
