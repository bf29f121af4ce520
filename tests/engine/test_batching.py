"""Continuous batching (engine/runtime/scheduler.py): on these test models every request gets exactly the
answer it gets alone, whoever shares its steps, joins or leaves (on a real model a near-tie can
flip with the batch's size unless `batch_invariant` is set: docs/studies/batching-and-cpu-speed.md#batched-decoding);
a cancelled or failing request leaves the others be."""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.interface import GenerationDone, GenerationParams, TokenDelta
from engine.memories.neurocache.adapter import LoRALinear, Neurocache, NeurocacheConfig
from engine.models import cpu_kernels
from engine.models.llama_step import BatchDecoder, Row
from engine.models.quantize import WeightOnlyLinear, quantize_linears
from engine.runtime.generation import AnswerState, StopTokens, generate_steps
from engine.runtime.scheduler import Batcher
from engine.runtime.worker import SerialWorker
from research.lms.byte_tokenizer import ByteTokenizer
from tests.helpers import TEST_DEVICE

# --quantize is for models on the CPU (weight-only kernels); the server refuses it elsewhere
ON_CPU = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="weight-only quantization runs on the CPU only")

NO_STOP = StopTokens(frozenset())
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
MODEL_TYPES = {**FAMILIES, "qwen3": (Qwen3Config, Qwen3ForCausalLM)}  # `tiny` builds these; FAMILIES are batched


# float32 summation orders by row count were measured with MKL on x86 CPUs (bench/bench_batch_step.py);
# elsewhere (another CPU, CUDA) padding to 4 rows promises nothing bit for bit
X86_CPU_ONLY = pytest.mark.skipif(
    TEST_DEVICE != "cpu" or platform.machine() not in ("x86_64", "AMD64"), reason="bit-exact float32 on x86 CPUs only"
)


def tiny(family: str, vocab: int, **overrides: Any) -> Any:
    torch.manual_seed(0)
    config_type, model_type = MODEL_TYPES[family]
    window = {"sliding_window": None} if family == "mistral" else {}
    settings = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    return model_type(
        config_type(**{**settings, **window, **overrides})
    ).eval()  # weights large enough that every position changes the logits


def requests(vocab: int) -> list[tuple[list[int], GenerationParams]]:
    """Prompts of different lengths and answers of different lengths (rows leave at different
    steps, one right after its prefill), one cut by a stop string, one sampled with a seed."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(1)
    lengths, max_tokens = (3, 17, 40, 9, 11), (5, 24, 12, 18, 1)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    params[2] = GenerationParams(max_tokens=12, temperature=0.0, stop=("e",))
    params[3] = GenerationParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=7)
    return list(zip(prompts, params, strict=True))


def answer_of(events: list) -> tuple[str, GenerationDone]:
    """The text of an answer's deltas, and its done event (last)."""
    done = events[-1]
    assert isinstance(done, GenerationDone) and all(isinstance(event, TokenDelta) for event in events[:-1])
    return "".join(event.text for event in events[:-1]), done


def alone(model, tokenizer, prompt: list[int], params: GenerationParams) -> tuple[str, GenerationDone]:
    return answer_of(list(generate_steps(model, tokenizer, prompt, params, NO_STOP)))


async def collect(batcher: Batcher, prompt: list[int], params: GenerationParams) -> tuple[str, GenerationDone]:
    return answer_of([event async for event in batcher.generate(prompt, params)])


def batcher_for(model, tokenizer, max_rows: int = 8) -> Batcher:
    return Batcher(BatchDecoder(model), SerialWorker("test", 16), tokenizer, NO_STOP, max_rows)


def same_answer(a: tuple[str, GenerationDone], b: tuple[str, GenerationDone]) -> bool:
    return a[0] == b[0] and (a[1].finish_reason, a[1].completion_tokens) == (b[1].finish_reason, b[1].completion_tokens)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_steps_equal_full_recomputation(family):
    """Rows at different positions, stepped together: each row's logits are those of the model run
    on that row's whole sequence at once."""
    model = tiny(family, 101)
    decoder = BatchDecoder(model)
    generator = torch.Generator(torch.get_default_device()).manual_seed(2)
    sequences = [torch.randint(0, 101, (n,), generator=generator).tolist() for n in (5, 30, 12)]
    rows = []
    for sequence in sequences:
        row = Row(sequence, GenerationParams(max_tokens=6))
        row.state = AnswerState(cast(PreTrainedTokenizerBase, ByteTokenizer()), sequence, row.params, NO_STOP)
        decoder.prefill(row)
        rows.append(row)
    for step in range(6):
        tokens = torch.randint(0, 101, (len(rows),), generator=generator).tolist()
        for row, token in zip(rows, tokens, strict=True):
            assert row.state is not None
            row.state.next_token = token
            row.prompt_ids = [*row.prompt_ids, token]
        logits = decoder.step(rows)
        for i, row in enumerate(rows):
            with torch.no_grad():
                full = model(input_ids=torch.tensor([row.prompt_ids])).logits[0, -1]
            torch.testing.assert_close(
                logits[i], full, rtol=1e-4, atol=1e-4, msg=cast(Callable[[str], str], lambda m, step=step: f"step {step}: {m}")
            )


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("max_rows", [8, 2], ids=["all-at-once", "two-rows-others-wait"])
def test_each_request_gets_the_answer_it_gets_alone(family, max_rows, tiny_tokenizer):
    model = tiny(family, len(tiny_tokenizer))
    assert BatchDecoder.supports(model)
    work = requests(len(tiny_tokenizer))
    expected = [alone(model, tiny_tokenizer, prompt, params) for prompt, params in work]
    batcher = batcher_for(model, tiny_tokenizer, max_rows)

    async def run():
        return await asyncio.gather(*(collect(batcher, prompt, params) for prompt, params in work))

    got = asyncio.run(run())
    for a, b in zip(got, expected, strict=True):
        assert same_answer(a, b), (a, b)
    assert batcher._rows == [] and not batcher._waiting


def test_a_neurocache_wrapped_model_batches_as_it_answers_alone(tiny_tokenizer):
    """SmolLM2-135M is served with its Neurocache adapter attached; with no cache bound (a
    text or truncate session) the batched path runs the same layers, LoRA included."""
    model = tiny("llama", len(tiny_tokenizer))
    neurocache = Neurocache(model, NeurocacheConfig(top_k=4, capacity=64, lora_rank=4))
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in neurocache.adapter_parameters():
            parameter.normal_(0, 0.5)  # an open adapter: LoRA changes the FFNs
    work = requests(len(tiny_tokenizer))[:2]
    expected = [alone(model, tiny_tokenizer, prompt, params) for prompt, params in work]
    batcher = batcher_for(model, tiny_tokenizer)

    async def run():
        return await asyncio.gather(*(collect(batcher, prompt, params) for prompt, params in work))

    for a, b in zip(asyncio.run(run()), expected, strict=True):
        assert same_answer(a, b)


def test_a_cancelled_request_leaves_the_others_and_frees_its_row(tiny_tokenizer):
    model = tiny("llama", len(tiny_tokenizer))
    (p1, params1), (p2, params2) = requests(len(tiny_tokenizer))[1:3]
    expected = alone(model, tiny_tokenizer, p2, params2)
    batcher = batcher_for(model, tiny_tokenizer)

    async def run():
        async def leave_early():
            stream = batcher.generate(p1, params1)
            await anext(stream)
            await stream.aclose()

        other = asyncio.create_task(collect(batcher, p2, params2))
        await leave_early()
        return await other

    assert same_answer(asyncio.run(run()), expected)
    assert batcher._rows == []


def test_a_failing_request_fails_alone(tiny_tokenizer, monkeypatch):
    model = tiny("qwen2", len(tiny_tokenizer))
    (p1, params1), (p2, params2) = requests(len(tiny_tokenizer))[1:3]
    expected = alone(model, tiny_tokenizer, p2, params2)
    take = AnswerState.take

    def failing_take(self, logits):
        if self.prompt_tokens == len(p1) and self.produced == 3:
            raise RuntimeError("this row broke")
        return take(self, logits)

    monkeypatch.setattr(AnswerState, "take", failing_take)
    batcher = batcher_for(model, tiny_tokenizer)

    async def run():
        return await asyncio.gather(collect(batcher, p1, params1), collect(batcher, p2, params2), return_exceptions=True)

    failed, other = asyncio.run(run())
    assert isinstance(failed, RuntimeError) and str(failed) == "this row broke"
    assert same_answer(other, expected)
    assert batcher._rows == []


def test_models_the_batched_step_would_get_wrong_are_not_batched():
    """Other families, sliding-window attention (Mistral's default, Qwen2's when used), and rotary
    scalings whose frequencies depend on the whole batch's positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    small: dict[str, Any] = dict(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    assert not BatchDecoder.supports(GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2)))
    assert not BatchDecoder.supports(MistralForCausalLM(MistralConfig(**small, sliding_window=4096)))
    assert BatchDecoder.supports(MistralForCausalLM(MistralConfig(**small, sliding_window=None)))
    assert not BatchDecoder.supports(
        Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    )
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not BatchDecoder.supports(LlamaForCausalLM(LlamaConfig(**small, rope_parameters=dynamic)))
    assert BatchDecoder.supports(LlamaForCausalLM(LlamaConfig(**small)))


def test_a_failing_forward_ends_its_rows_and_a_scheduler_fault_hangs_no_one(tiny_tokenizer, monkeypatch):
    model = tiny("llama", len(tiny_tokenizer))
    (p1, params1), (p2, params2) = requests(len(tiny_tokenizer))[1:3]
    batcher = batcher_for(model, tiny_tokenizer)

    expected = alone(model, tiny_tokenizer, p2, params2)
    step = batcher._decoder.step

    def broken(rows):  # fails whenever the first request's row is in the step
        if any(row.state.prompt_tokens == len(p1) for row in rows):
            raise RuntimeError("the forward broke")
        return step(rows)

    monkeypatch.setattr(batcher._decoder, "step", broken)

    async def run():
        return await asyncio.wait_for(
            asyncio.gather(collect(batcher, p1, params1), collect(batcher, p2, params2), return_exceptions=True), 60
        )

    failed, other = asyncio.run(run())
    assert str(failed) == "the forward broke" and same_answer(other, expected)
    monkeypatch.undo()

    keep_live = Batcher._keep_live

    def fault(self):  # breaks once rows hold keys and values
        if any(row.keys is not None and row.state.produced >= 2 for row in self._rows):
            raise KeyError("a scheduler bug")
        keep_live(self)

    monkeypatch.setattr(Batcher, "_keep_live", fault)
    batcher = batcher_for(model, tiny_tokenizer)
    results = asyncio.run(run())
    assert all(isinstance(result, KeyError) for result in results)
    assert batcher._rows == [] and not batcher._waiting  # nothing kept: no keys or values leak


def test_an_answer_that_ends_as_the_worker_stops_still_gets_its_end(tiny_tokenizer, monkeypatch):
    """The next step is queued before a step's events are handed out; if the worker has stopped by
    then, the answers that step ended still get their events, and the ones left get the error."""
    model = tiny("llama", len(tiny_tokenizer))
    (p1, _), (p2, params2) = requests(len(tiny_tokenizer))[:2]
    batcher = batcher_for(model, tiny_tokenizer)
    start = batcher._worker.start
    calls = []

    def stopping(fn, *args):  # the worker stops while the first step runs
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("worker 'test' has stopped")
        return start(fn, *args)

    monkeypatch.setattr(batcher._worker, "start", stopping)

    async def run():
        one_token = GenerationParams(max_tokens=1, temperature=0.0)  # ends in the first step
        return await asyncio.wait_for(
            asyncio.gather(collect(batcher, p1, one_token), collect(batcher, p2, params2), return_exceptions=True), 60
        )

    ended, stopped = asyncio.run(run())
    assert ended[1].finish_reason == "length" and ended[1].completion_tokens == 1
    assert isinstance(stopped, RuntimeError) and "stopped" in str(stopped)
    assert len(calls) == 2


def prefilled_rows(decoder: BatchDecoder, lengths: list[int]) -> list[Row]:
    """A row per length, its prompt drawn from a seed of that length, prefilled."""
    made = []
    for n in lengths:
        sequence = torch.randint(0, 101, (n,), generator=torch.Generator(torch.get_default_device()).manual_seed(n)).tolist()
        row = Row(sequence, GenerationParams(max_tokens=4))
        row.state = AnswerState(cast(PreTrainedTokenizerBase, ByteTokenizer()), sequence, row.params, NO_STOP)
        decoder.prefill(row)
        made.append(row)
    return made


@X86_CPU_ONLY
def test_an_invariant_step_gives_a_row_the_same_logits_in_any_company():
    """With `batch_invariant` a row's logits are bit for bit the same stepped alone or beside
    others, so its greedy answer cannot depend on who else is being answered."""
    model = tiny("llama", 101)
    decoder = BatchDecoder(model, invariant=True)
    generator = torch.Generator(torch.get_default_device()).manual_seed(4)

    lone, crowd = prefilled_rows(decoder, [20]), prefilled_rows(decoder, [20, 7, 33, 12, 25, 9])
    for _ in range(4):
        token = int(torch.randint(0, 101, (1,), generator=generator))
        for row in (lone[0], *crowd):
            assert row.state is not None  # prefilled_rows made it
            row.state.next_token = token
        assert torch.equal(decoder.step(lone)[0], decoder.step(crowd)[0])


@X86_CPU_ONLY
def test_two_or_three_answers_step_as_four_rows_and_get_a_larger_batchs_logits():
    """Without `batch_invariant`, a step of 2 or 3 answers is padded to 4 rows: a row's logits are
    bit for bit those it gets beside 3 or 5 others, and only a lone answer steps alone."""
    model = tiny("llama", 101)
    decoder = BatchDecoder(model)
    assert [decoder.step_rows(n) for n in (1, 2, 3, 4, 6)] == [1, 4, 4, 4, 6]
    assert [BatchDecoder(model, invariant=True).step_rows(n) for n in (1, 2, 3, 5)] == [4, 4, 4, 5]

    pair, trio, four, six = (
        prefilled_rows(decoder, lengths) for lengths in ([20, 7], [20, 7, 33], [20, 7, 33, 12], [20, 7, 33, 12, 25, 9])
    )
    for token in (5, 17, 60):
        for row in (*pair, *trio, *four, *six):
            assert row.state is not None
            row.state.next_token = token
        reference = decoder.step(six)[:2]
        assert torch.equal(decoder.step(pair), reference)
        assert torch.equal(decoder.step(trio)[:2], reference)
        assert torch.equal(decoder.step(four)[:2], reference)


@X86_CPU_ONLY
@pytest.mark.parametrize("mode", ["bf16", "int8", "int4"])
def test_a_quantized_model_is_never_padded_and_a_row_gets_the_same_logits_in_any_company(mode):
    """torch's weight-only kernels compute each row alone (checked by the decoder when it is
    made): with `--quantize` no step is padded, and a row's logits are bit for bit the same
    stepped alone, beside one other or beside five."""
    if mode == "int4" and cpu_kernels.library() is None:
        pytest.skip("int4 without longdoc's kernels widens its weights for a float32 matmul, whose rows depend on their company")
    model = tiny("llama", 101)
    quantize_linears(model, mode)
    decoder = BatchDecoder(model, invariant=True)
    assert decoder.rows_alone
    assert [decoder.step_rows(n) for n in (1, 2, 3, 5)] == [1, 2, 3, 5]
    lone, pair, six = (prefilled_rows(decoder, lengths) for lengths in ([20], [20, 7], [20, 7, 33, 12, 25, 9]))
    for token in (5, 17, 60):
        for row in (*lone, *pair, *six):
            assert row.state is not None
            row.state.next_token = token
        reference = decoder.step(lone)[0]
        assert torch.equal(decoder.step(pair)[0], reference)
        assert torch.equal(decoder.step(six)[0], reference)


@ON_CPU
def test_a_kernel_whose_rows_depend_on_their_company_keeps_the_padding(monkeypatch):
    model = tiny("llama", 101)
    quantize_linears(model, "int8")
    forward = WeightOnlyLinear.forward
    monkeypatch.setattr(WeightOnlyLinear, "forward", lambda self, x: forward(self, x) * (1 + 1e-3 * (x.shape[0] > 1)))
    decoder = BatchDecoder(model)
    assert not decoder.rows_alone
    assert [decoder.step_rows(n) for n in (1, 2, 3)] == [1, 4, 4]
    assert not BatchDecoder(tiny("llama", 101)).rows_alone  # float32 layers are not tried: MKL's order depends on the rows


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["none", pytest.param("int8", marks=ON_CPU)])
def test_every_layer_steps_fused_and_a_second_decoder_shares_the_weights(family, mode):
    model = tiny(family, 101)
    quantize_linears(model, mode)
    first, second = BatchDecoder(model), BatchDecoder(model)
    assert all(f is not None for f in first.qkv + first.gate_up)
    assert all(a is b for a, b in zip(first.qkv + first.gate_up, second.qkv + second.gate_up, strict=True))


@ON_CPU
def test_a_neurocache_adapters_lora_layers_are_stepped_as_their_float32_bases_and_keep_the_padding():
    """Outside a Neurocache binding (a batched step is always outside) an adapter's LoRA layer is
    its base layer: the step fuses and calls the bases. With `--quantize` the bases stay float32 (as
    the server does it), so the torch step keeps the padding."""
    model = tiny("llama", 101)
    Neurocache(model, NeurocacheConfig(top_k=4, capacity=64, lora_rank=4))
    quantize_linears(model, "int8")
    decoder = BatchDecoder(model)
    adapted = [isinstance(layer.mlp.gate_proj, LoRALinear) for layer in decoder.layers]
    assert any(adapted) and not all(adapted)
    assert all(f is not None for f in decoder.qkv + decoder.gate_up)
    kinds = [type(f) for f in decoder.gate_up]
    assert [kind is nn.Linear for kind in kinds] == adapted and [type(d) is nn.Linear for d in decoder.down] == adapted
    assert decoder.native is None and not decoder.rows_alone  # head_dim 8: the torch step


def test_a_prompt_fed_in_parts_keeps_what_the_whole_prompt_keeps():
    model = tiny("llama", 101)
    decoder = BatchDecoder(model)
    prompt = torch.randint(0, 101, (30,), generator=torch.Generator(torch.get_default_device()).manual_seed(5)).tolist()
    whole, parts = Row(prompt, GenerationParams(max_tokens=4)), Row(prompt, GenerationParams(max_tokens=4))
    want = decoder.prefill(whole)
    assert [decoder.prefill_part(parts, 7) for _ in range(4)] == [None] * 4 and parts.fed == 28
    got = decoder.prefill_part(parts, 7)
    assert got is not None and parts.prompt_cache is None and parts.length == 30
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert whole.keys is not None and parts.keys is not None and whole.values is not None and parts.values is not None
    torch.testing.assert_close(parts.keys[:, :, :30], whole.keys[:, :, :30], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.values[:, :, :30], whole.values[:, :, :30], rtol=1e-5, atol=1e-5)


def test_a_long_prompt_is_fed_between_the_steps_of_the_answers_decoding(tiny_tokenizer):
    """With `prefill_chunk` 4, a 40-token prompt arriving while another answer decodes is fed over
    10 steps, and the other answer gets a token at each of them; both get their answers."""
    model = tiny("llama", len(tiny_tokenizer))
    generator = torch.Generator(torch.get_default_device()).manual_seed(6)
    short, long = (torch.randint(0, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (5, 40))
    first, second = GenerationParams(max_tokens=30, temperature=0.0), GenerationParams(max_tokens=3, temperature=0.0)
    expected = alone(model, tiny_tokenizer, short, first)
    batcher = Batcher(BatchDecoder(model), SerialWorker("test", 16), tiny_tokenizer, NO_STOP, 8, prefill_chunk=4)
    arrivals: list[str] = []

    async def run():
        async def follow(name, prompt, params):
            events = []
            async for event in batcher.generate(prompt, params):
                arrivals.append(name)
                events.append(event)
            return answer_of(events)

        decoding = asyncio.create_task(follow("short", short, first))
        while arrivals.count("short") < 2:
            await asyncio.sleep(0.001)
        arrivals.append("long arrives")
        return await asyncio.gather(decoding, follow("long", long, second))

    got_short, got_long = asyncio.run(run())
    assert same_answer(got_short, expected)
    assert got_long[1].completion_tokens == 3
    waited = arrivals[arrivals.index("long arrives") : arrivals.index("long")]
    assert waited.count("short") >= 8, arrivals  # a token of the short answer a chunk, not one long stall


def test_a_prompt_cancelled_while_it_is_fed_leaves_the_batch(tiny_tokenizer):
    model = tiny("llama", len(tiny_tokenizer))
    generator = torch.Generator(torch.get_default_device()).manual_seed(7)
    short, long = (torch.randint(0, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (5, 200))
    params = GenerationParams(max_tokens=20, temperature=0.0)
    expected = alone(model, tiny_tokenizer, short, params)
    batcher = Batcher(BatchDecoder(model), SerialWorker("test", 16), tiny_tokenizer, NO_STOP, 8, prefill_chunk=2)

    async def run():
        decoding = asyncio.create_task(collect(batcher, short, params))
        feeding = asyncio.create_task(collect(batcher, long, params))
        while (row := batcher._prefilling) is None or row.prompt_ids != long or row.fed < 20:
            await asyncio.sleep(0.001)  # its prompt half fed
        feeding.cancel()
        assert row.fed < len(long)
        return await decoding

    assert same_answer(asyncio.run(run()), expected)
    assert batcher._prefilling is None and batcher._rows == []


def test_a_prompt_failing_while_it_is_fed_fails_alone(tiny_tokenizer, monkeypatch):
    model = tiny("llama", len(tiny_tokenizer))
    generator = torch.Generator(torch.get_default_device()).manual_seed(8)
    short, long = (torch.randint(0, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (5, 40))
    params = GenerationParams(max_tokens=12, temperature=0.0)
    expected = alone(model, tiny_tokenizer, short, params)
    decoder = BatchDecoder(model)
    batcher = Batcher(decoder, SerialWorker("test", 16), tiny_tokenizer, NO_STOP, 8, prefill_chunk=4)
    feed = decoder.prefill_part

    def failing(row, tokens):
        if row.prompt_ids == long and row.fed >= 12:
            raise RuntimeError("out of memory in the fourth chunk")
        return feed(row, tokens)

    monkeypatch.setattr(decoder, "prefill_part", failing)

    async def run():
        decoding = asyncio.create_task(collect(batcher, short, params))
        with pytest.raises(RuntimeError, match="fourth chunk"):
            await collect(batcher, long, params)
        return await decoding

    assert same_answer(asyncio.run(run()), expected)
    assert batcher._prefilling is None and batcher._rows == []


def test_a_prompt_that_is_in_hands_out_its_first_token_before_any_step(tiny_tokenizer, monkeypatch):
    """The tick that feeds a prompt's last chunk ends with that row's first token; the rows
    already answering, and that one, step on the next tick, before another prompt is fed."""
    model = tiny("llama", len(tiny_tokenizer))
    (p1, params1), (p2, params2) = requests(len(tiny_tokenizer))[:2]
    batcher = batcher_for(model, tiny_tokenizer)
    steps: list[int] = []
    step = batcher._decoder.step

    def counted(rows: list[Row]) -> torch.Tensor:
        steps.append(len(rows))
        return step(rows)

    monkeypatch.setattr(batcher._decoder, "step", counted)
    first, second = Row(p1, params1), Row(p2, params2)

    batcher._waiting.append(first)
    out = batcher._tick()
    assert [row for row, _ in out] == [first] and steps == []  # its first token, no step
    assert isinstance(out[0][1][0], TokenDelta)
    batcher._waiting.append(second)
    batcher._tick()
    assert steps == [1] and second.prompt_cache is None and second.keys is None  # a step, and no prompt fed
    out = batcher._tick()
    assert [row for row, _ in out] == [second] and steps == [1]  # the first answer waits one tick
    batcher._tick()
    assert steps == [1, 2]


def test_a_tick_after_a_prompt_with_nothing_left_to_step_feeds_the_next_one(tiny_tokenizer):
    """An answer that ends with its first token leaves no row to step: the next tick feeds the
    next prompt at once instead of stepping nothing."""
    model = tiny("llama", len(tiny_tokenizer))
    batcher = batcher_for(model, tiny_tokenizer)
    (p1, _), (p5, one_token) = requests(len(tiny_tokenizer))[0], requests(len(tiny_tokenizer))[4]
    assert one_token.max_tokens == 1
    short, nxt = Row(p5, one_token), Row(p1, GenerationParams(max_tokens=4, temperature=0.0))
    batcher._waiting.append(short)
    out = batcher._tick()
    assert [row for row, _ in out] == [short] and isinstance(out[0][1][-1], GenerationDone) and batcher._rows == []
    batcher._waiting.append(nxt)
    out = batcher._tick()
    assert [row for row, _ in out] == [nxt] and isinstance(out[0][1][0], TokenDelta)


def test_answers_go_before_background_rows_and_a_background_prompt_steps_aside_for_one(tiny_tokenizer):
    """One row at a time, prompts fed 4 tokens a step: while an answer decodes, two background rows
    queue, then a second answer; it runs before both. Then a background prompt of 60 tokens is
    being fed when an answer arrives: the answer is fed and answered first, and the background row
    goes on from what it had fed. Every row gets what it gets alone."""
    model = tiny("llama", len(tiny_tokenizer))
    generator = torch.Generator(torch.get_default_device()).manual_seed(8)
    prompts = [torch.randint(0, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (5, 7, 9, 6, 60, 8)]
    params = GenerationParams(max_tokens=6, temperature=0.0)
    batcher = Batcher(BatchDecoder(model), SerialWorker("test", 16), tiny_tokenizer, NO_STOP, 1, prefill_chunk=4)
    finished: list[str] = []

    async def follow(name, prompt, background=False):
        events = [event async for event in batcher.generate(prompt, params, background=background)]
        finished.append(name)
        return answer_of(events)

    async def queued():
        first = asyncio.create_task(follow("first", prompts[0]))
        while batcher.rows == 0:
            await asyncio.sleep(0.001)
        jobs = [asyncio.create_task(follow(f"background {i}", prompts[i], background=True)) for i in (1, 2)]
        await asyncio.sleep(0)
        jobs.append(asyncio.create_task(follow("answer", prompts[3])))
        return await asyncio.gather(first, *jobs)

    async def stepping_aside():
        long = asyncio.create_task(follow("long background", prompts[4], background=True))
        while batcher._prefilling is None or batcher._prefilling.fed < 8:
            await asyncio.sleep(0.001)
        answer = await follow("late answer", prompts[5])
        assert not long.done()  # the answer did not wait for the rest of the long prompt
        return [answer, await long]

    answers = asyncio.run(queued())
    assert finished == ["first", "answer", "background 1", "background 2"]
    answers += asyncio.run(stepping_aside())
    assert finished[4:] == ["late answer", "long background"]
    for prompt, got in zip([prompts[0], prompts[1], prompts[2], prompts[3], prompts[5], prompts[4]], answers, strict=True):
        assert same_answer(got, alone(model, tiny_tokenizer, prompt, params))
