"""Helpers shared by more than one test file (its fixtures are in conftest.py)."""

from __future__ import annotations

import copy
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from fastapi.testclient import TestClient
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from clients.client import events_of as parse_events
from engine.config import operator_cache_dir
from engine.memories.neurocache.adapter import CacheAttention, LoRALinear, Neurocache, NeurocacheConfig
from research.lms.byte_tokenizer import ByteTokenizer
from research.lms.feeders import feeder_for
from server.settings import Settings

# --- paths and the test device ---

FIXTURES = Path(__file__).parent / "fixtures"
CACHE_DIR = operator_cache_dir()
# `LONGDOC_TEST_DEVICE=cuda pytest` runs the suite with CUDA as the default device of every test and
# of the test servers' engines (scripts/gpu/check.sh); CI leaves it unset, on CPU.
TEST_DEVICE = os.environ.get("LONGDOC_TEST_DEVICE", "cpu")

# --- int4 on inputs rounded to int8 (AVX2, or AVX-512 VNNI, csrc/weight_only.c) ---


def int4_rounds_inputs() -> bool:
    """Whether int4 matmuls run on inputs rounded to int8 now (the AVX2 kernels, or the AVX-512
    ones on a CPU with VNNI, with int8 inputs on)."""
    from engine.models import cpu_kernels

    return cpu_kernels.int4_rounds_inputs()


def int4_inputs(x: torch.Tensor) -> torch.Tensor:
    """The inputs an int4 matmul multiplies its codes by, as float64 [rows, in]: each group of 32
    rounded to int8 at a scale of its largest magnitude / 127 (ties to even) and scaled back, where
    `int4_rounds_inputs()`; else the inputs as they are."""
    if not int4_rounds_inputs():
        return x.double()
    return rounded_groups(x.float().reshape(*x.shape[:-1], -1, 32)).reshape(x.shape)


def rounded_groups(groups: torch.Tensor) -> torch.Tensor:
    """Float32 groups [..., 32] each rounded to int8 at a step of its largest magnitude / 127 (ties
    to even; a step too small to invert rounds to zeros) and scaled back, as float64."""
    step = groups.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(step > torch.finfo(torch.float32).tiny, 1.0 / step, torch.zeros_like(step))
    return (groups * inverse).round().clamp(-127, 127).double() * step.double()


def int8_inputs(x: torch.Tensor) -> torch.Tensor:
    """The inputs an int8 matmul multiplies its weights by, as float64 [rows, in]: where
    `cpu_kernels.int8_rounds_inputs()`, in spans of 512, each lane's group (inputs 64v + 4l to
    64v + 4l + 3 of the span, for each of its vectors v; lane l of 16) rounded to int8 at a step of
    its largest magnitude / 127 (ties to even) and scaled back; else the inputs as they are."""
    from engine.models import cpu_kernels

    if not cpu_kernels.int8_rounds_inputs():
        return x.double()
    rows, k = x.shape
    spans = -(-k // 512)
    padded = torch.zeros(rows, spans * 512)
    padded[:, :k] = x.float()
    lanes = padded.view(rows, spans, 8, 16, 4).transpose(2, 3).reshape(rows, spans, 16, 32)  # a lane's group last
    rounded = rounded_groups(lanes).view(rows, spans, 16, 8, 4).transpose(2, 3)
    return rounded.reshape(rows, -1)[:, :k]


def int4_parts(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 `WeightOnlyLinear`'s weights as float64 [out, in] parts: scale * code, and minimum."""
    groups = layer.scales.double()  # [out, in / 32, 2]
    low, high = layer.weight_low & 15, layer.weight_low >> 4  # a group's inputs 0-15, then 16-31
    out = low.shape[0]
    codes = torch.cat([low.view(out, -1, 16), high.view(out, -1, 16)], dim=-1).double()  # [out, groups, 32]
    return (codes * groups[..., :1]).view(out, -1), groups[..., 1:].expand(-1, -1, 32).reshape(out, -1)


def int4_product(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """An int4 `WeightOnlyLinear`'s decode product as its kernel computes it, in float64 [rows, out]:
    the codes' part multiplies `int4_inputs`, the minimums' part the inputs as they are (their
    sums over each group)."""
    coded, minimums = int4_parts(layer)
    return int4_inputs(x) @ coded.T + x.double() @ minimums.T


# --- documents ---

TEXT = (FIXTURES / "alice29.txt").read_text(encoding="utf-8")[:20_000]


def filler(n: int) -> str:
    words = ["river", "stone", "market", "winter", "lantern", "orchard", "bridge", "sparrow"]
    return " ".join(f"The {words[i % 8]} number {i} was quiet that day." for i in range(n))


# --- API: a test app, its requests and responses ---


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


def assert_error(response, status: int, kind: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "message"} and error["message"]
    if kind:
        assert error["type"] == kind
    return error


def new_session(client, **body) -> str:
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def events_of(response) -> list:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return list(parse_events(response))


def fail_on_third_segment(memory) -> None:
    """Make the memory's third `add_segment` call raise, as a crash in the middle of ingestion would."""
    original, calls = memory.add_segment, []

    def failing(segment):
        calls.append(segment.index)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        original(segment)

    memory.add_segment = failing


# --- API: requests held part way, to race others against them ---

DOCUMENT = "The lighthouse of Velmora is painted violet. " * 60
TIMEOUT = 60.0


class Hold:
    """Block the `after`-th call of a function until released, and say when it is reached."""

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0
        self.reached, self.released = threading.Event(), threading.Event()

    def wrap(self, fn: Callable) -> Callable:
        def held(*args, **kwargs):
            self.calls += 1
            if self.calls == self.after:
                self.reached.set()
                assert self.released.wait(TIMEOUT), "never released"
            return fn(*args, **kwargs)

        return held

    def hook(self, module, args) -> None:  # a forward pre-hook
        self.wrap(lambda: None)()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    return thread, result


def session_of(client, session_id: str):
    return client.app.state.engine.sessions.use(session_id)


def ingest_held(client, session_id: str) -> tuple[Hold, threading.Thread, list]:
    """Start ingesting DOCUMENT in a thread and hold it at its second segment."""
    memory = session_of(client, session_id).memory
    hold = Hold(after=2)
    memory.add_segment = hold.wrap(memory.add_segment)
    thread, result = in_thread(lambda: client.post(f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT}))
    assert hold.reached.wait(TIMEOUT)
    return hold, thread, result


# --- models: tiny Hugging Face models and a Neurocache on them ---


def make_tiny_llama(folder: Path, tokenizer_dir: Path, *, seed: int = 0, **sizes: int) -> Path:
    """A 2-layer, hidden-32 Llama (or of other `sizes`) with random weights and SmolLM2-135M's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **{**settings, **sizes},
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


VOCAB = 97


def tiny(arch: str) -> Any:
    """A tiny Hugging Face model, typed `Any`: tests reach its layers by attribute name."""
    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model: torch.nn.Module
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=256))
    return model.eval()


ARCHS = ["llama", "mistral", "qwen2", "gpt2"]
CONFIG = NeurocacheConfig(top_k=4, window=2, context=2, capacity=256, lora_rank=4)


def adapted(arch: str, config: NeurocacheConfig = CONFIG):
    base = tiny(arch)
    reference = copy.deepcopy(base)
    return base, Neurocache(base, config), reference


def filled_cache(neurocache: Neurocache, n: int = 100, seed: int = 1):
    torch.manual_seed(seed)
    cache = neurocache.new_cache()
    cache.add(torch.nn.functional.layer_norm(torch.randn(n, neurocache.compressed_dim), (neurocache.compressed_dim,)), document=0)
    return cache


def open_gates(neurocache: Neurocache, seed: int = 2) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in neurocache.cache_attention.values():
            attention = cast(CacheAttention, module)
            attention.gate.normal_(0, 1.0)
            attention.slot_bias.normal_(0, 1.0)
        for module in neurocache.lora.values():
            cast(LoRALinear, module).lora_b.weight.normal_(0, 0.1)


# --- models: the research language models (Transformer, Long-Short, CacheFormer) ---

SMALL = dict(vocab_size=50, dim=16, n_layers=2, n_heads=2, max_seq_len=64, window=6, segment_len=4, compressed_per_segment=2)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "transformer": ("transformer", {}),
    "long-short": ("long-short", {}),
    "cf-overlap": ("cacheformer", {"overlap": True}),
    "cf-cache-p4": ("cacheformer", {"cache_top_k": 2, "group_size": 4}),
    "cf-cache-p1-u3": ("cacheformer", {"cache_top_k": 2, "group_size": 1, "cache_neighbours": 3}),
    "cf-both-p8": ("cacheformer", {"overlap": True, "cache_top_k": 3, "group_size": 8, "cache_neighbours": 3}),
}


def greedy(model, context: str, question: str, n: int) -> str:
    """The answer computed directly: documents, a blank line, the question as the template renders it."""
    tokenizer, feeder = ByteTokenizer(), feeder_for(model)
    feeder.feed(tokenizer(context)["input_ids"])
    prompt = tokenizer("\n\n" + tokenizer.apply_chat_template([{"role": "user", "content": question}]))["input_ids"]
    logits, out = feeder.feed(prompt), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = feeder.feed(out[-1:])
    return tokenizer.decode(out)
