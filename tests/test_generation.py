"""Sampling, incremental text with stop strings, and cached decoding equal to full recomputation."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from engine.generation import StopTokens, TextAssembler, generate_steps, sample_next
from engine.interface import GenerationDone, GenerationParams, TokenDelta


def test_greedy_takes_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_next(logits, GenerationParams(temperature=0.0), None) == 1


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    params = GenerationParams(temperature=1.0, top_p=0.5)
    generator = torch.Generator(torch.get_default_device()).manual_seed(0)
    picks = {sample_next(logits, params, generator) for _ in range(200)}
    assert picks == {0}
    params = GenerationParams(temperature=1.0, top_p=0.85)
    picks = {sample_next(logits, params, generator) for _ in range(400)}
    assert picks == {0, 1}


def test_seed_makes_sampling_repeatable():
    logits = torch.randn(1000)
    params = GenerationParams(temperature=1.0)

    def draw(seed: int) -> list[int]:
        generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
        return [sample_next(logits, params, generator) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def _feed(assembler: TextAssembler, tokenizer, text: str) -> str:
    out = "".join(assembler.add(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])
    return out + assembler.flush()


def test_assembler_reproduces_text_without_stops(tiny_tokenizer):
    text = "Hello world, naïve café — ünïcödé 🙂 text."
    assert _feed(TextAssembler(tiny_tokenizer, ()), tiny_tokenizer, text) == text


def test_assembler_cuts_at_stop_string_and_never_emits_it(tiny_tokenizer):
    assembler = TextAssembler(tiny_tokenizer, ("STOP",))
    emitted = []
    for token in tiny_tokenizer("one two STOP three", add_special_tokens=False)["input_ids"]:
        emitted.append(assembler.add(token))
        if assembler.stopped:
            break
    assert assembler.stopped
    assert "".join(emitted) + assembler.flush() == "one two "
    assert not any("S" in piece for piece in emitted)


def test_assembler_releases_held_text_that_is_not_a_stop(tiny_tokenizer):
    assert _feed(TextAssembler(tiny_tokenizer, ("STOPPED",)), tiny_tokenizer, "a STOP b") == "a STOP b"


def _run(model, tokenizer, prompt, params):
    events = list(generate_steps(model, tokenizer, prompt, params, StopTokens(frozenset())))
    assert isinstance(events[-1], GenerationDone)
    return "".join(e.text for e in events if isinstance(e, TokenDelta)), events[-1]


def test_cached_decoding_equals_full_recomputation(tiny_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tiny_tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):  # greedy without any cache: a full forward pass per token
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    expected = tiny_tokenizer.decode(ids[len(prompt) :], skip_special_tokens=True)
    text, done = _run(model, tiny_tokenizer, prompt, GenerationParams(max_tokens=12))
    assert text == expected
    assert done.finish_reason == "length" and done.completion_tokens == 12 and done.prompt_tokens == len(prompt)


def test_stop_token_ends_generation(tiny_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tiny_tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    events = list(generate_steps(model, tiny_tokenizer, prompt, GenerationParams(max_tokens=5), StopTokens(frozenset({first}))))
    assert [type(e) for e in events] == [GenerationDone]
    assert events[0].finish_reason == "stop" and events[0].completion_tokens == 1


def test_seeded_sampling_is_repeatable_end_to_end(tiny_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tiny_tokenizer("Seeds", add_special_tokens=False)["input_ids"]
    params = GenerationParams(max_tokens=8, temperature=1.0, seed=123)
    assert _run(model, tiny_tokenizer, prompt, params)[0] == _run(model, tiny_tokenizer, prompt, params)[0]
