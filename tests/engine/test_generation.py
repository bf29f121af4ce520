"""Sampling, incremental text with stop strings, and cached decoding equal to full recomputation."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from engine.interface import GenerationDone, GenerationParams, TokenDelta
from engine.runtime.generation import StopTokens, TextAssembler, generate_steps, sample_next


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


class CountingTokenizer:
    """The tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_assembler_equals_full_decoding_at_a_cost_per_token_that_does_not_grow(tiny_tokenizer):
    """Random ids (special tokens, byte pieces of split characters and all) give exactly what one
    decode of the whole answer gives, and each token decodes a few ids, not the answer so far."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(0)
    ids = torch.randint(0, len(tiny_tokenizer), (3000,), generator=generator).tolist()
    counting = CountingTokenizer(tiny_tokenizer)
    assembler = TextAssembler(cast(PreTrainedTokenizerBase, counting), ())
    text = "".join(assembler.add(t) for t in ids) + assembler.flush()
    assert text == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 10 * len(ids)  # a full re-decode per token would be ~4.5 million


@pytest.mark.parametrize("stop", ["e t", "the", "\n\n", "xyz never"])
def test_assembler_stops_where_a_full_decode_finds_the_stop(tiny_tokenizer, stop):
    ids = tiny_tokenizer("Is the tea hot? Let the e tea wait.\n\nThe end.", add_special_tokens=False)["input_ids"]
    full = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assembler = TextAssembler(tiny_tokenizer, ("abcdefgh", stop))
    pieces = []
    for token in ids:
        pieces.append(assembler.add(token))
        if assembler.stopped:
            break
    text = "".join(pieces) + assembler.flush()
    assert text == (full[: full.index(stop)] if stop in full else full)


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
    text, done = _run(model, tiny_tokenizer, prompt, GenerationParams(max_tokens=12, no_repeat_ngram_size=0))
    assert text == expected
    assert done.finish_reason == "length" and done.completion_tokens == 12 and done.prompt_tokens == len(prompt)


def test_stop_token_ends_generation(tiny_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tiny_tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    events = list(generate_steps(model, tiny_tokenizer, prompt, GenerationParams(max_tokens=5), StopTokens(frozenset({first}))))
    assert [type(e) for e in events] == [GenerationDone]
    assert isinstance(events[0], GenerationDone)
    assert events[0].finish_reason == "stop" and events[0].completion_tokens == 1


def test_ignore_eos_runs_past_a_stop_token_to_max_tokens(tiny_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tiny_tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    params = GenerationParams(max_tokens=5, ignore_eos=True)
    events = list(generate_steps(model, tiny_tokenizer, prompt, params, StopTokens(frozenset({first}))))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    assert done.finish_reason == "length" and done.completion_tokens == 5


def test_seeded_sampling_is_repeatable_end_to_end(tiny_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tiny_tokenizer("Seeds", add_special_tokens=False)["input_ids"]
    params = GenerationParams(max_tokens=8, temperature=1.0, seed=123)
    assert _run(model, tiny_tokenizer, prompt, params)[0] == _run(model, tiny_tokenizer, prompt, params)[0]


def _loop_forward(vocab: int = 8):
    """A 'model' that always prefers the token after the last one, cycling 1, 2, 3, 1, 2, 3, ...
    with token 5 a close second: greedy decoding loops forever unless something stops it."""

    def forward(ids: list[int]) -> torch.Tensor:
        logits = torch.zeros(vocab)
        logits[ids[-1] % 3 + 1] = 2.0
        logits[5] = 1.0
        return logits

    return forward


def _decode(params: GenerationParams, tiny_tokenizer) -> list[int]:
    from engine.runtime.generation import RepetitionGuard

    forward, guard, ids = _loop_forward(), RepetitionGuard(params), [3]
    for _ in range(params.max_tokens):
        token = sample_next(guard.apply(forward(ids)), params, None)
        guard.add(token)
        ids.append(token)
    return ids[1:]


def test_without_the_guard_greedy_decoding_loops(tiny_tokenizer):
    answer = _decode(GenerationParams(max_tokens=12, no_repeat_ngram_size=0), tiny_tokenizer)
    assert answer == [1, 2, 3] * 4


def test_no_repeat_ngram_guard_never_repeats_an_ngram_of_the_answer(tiny_tokenizer):
    for n in (2, 3, 4):
        answer = _decode(GenerationParams(max_tokens=24, no_repeat_ngram_size=n), tiny_tokenizer)
        grams = [tuple(answer[i : i + n]) for i in range(len(answer) - n + 1)]
        assert len(grams) == len(set(grams)), (n, answer)
        assert answer[:n] == [1, 2, 3, 1][:n]  # nothing changes before a repeat would happen


def test_repetition_penalty_demotes_tokens_the_answer_already_holds(tiny_tokenizer):
    from engine.runtime.generation import RepetitionGuard

    guard = RepetitionGuard(GenerationParams(no_repeat_ngram_size=0, repetition_penalty=2.5))
    guard.add(1)
    guard.add(3)
    logits = guard.apply(torch.tensor([0.0, 2.0, 1.0, -1.0]))
    assert logits.tolist() == pytest.approx([0.0, 0.8, 1.0, -2.5]) and int(torch.argmax(logits)) == 2


def test_the_guard_works_on_the_logits_device():
    """The seen-token mask and the banned ids live where the logits do (a CPU mask beside CUDA
    logits was a 500 on the GPU); the meta device stands in for CUDA here."""
    from engine.runtime.generation import RepetitionGuard

    guard = RepetitionGuard(GenerationParams(no_repeat_ngram_size=2, repetition_penalty=1.3))
    for token in (1, 2, 1):
        guard.add(token)
    logits = guard.apply(torch.zeros(8, device="meta"))
    assert guard._seen is not None
    assert logits.device.type == "meta" and guard._seen.device.type == "meta"


def test_the_guard_ignores_the_prompt_and_never_bans_digits(tiny_tokenizer):
    """Copying from the document is what answers are made of: a prompt holding the n-gram bans
    nothing; and numbers spelt a digit a token ("7 7 7 7 7") can always be written."""
    from engine.runtime.generation import decode_steps, word_tokens

    seven, word = tiny_tokenizer.convert_tokens_to_ids("7"), tiny_tokenizer(" river", add_special_tokens=False).input_ids[0]
    assert not word_tokens(tiny_tokenizer)[seven] and word_tokens(tiny_tokenizer)[word]

    def run(token: int, prompt: list[int]) -> list[int]:
        fed: list[list[int]] = []

        def forward(ids: list[int]) -> torch.Tensor:  # always wants `token`; sees each chosen token next
            fed.append(ids)
            logits = torch.zeros(len(tiny_tokenizer))
            logits[token] = 5.0
            return logits

        params = GenerationParams(max_tokens=9, no_repeat_ngram_size=2)
        list(decode_steps(forward, tiny_tokenizer, prompt, params, StopTokens(frozenset())))
        return [ids[0] for ids in fed[1:]]  # the first 8 tokens chosen

    assert run(seven, [seven] * 6) == [seven] * 8  # digits: never banned, whatever the prompt
    words = run(word, [word] * 6)
    assert words[:2] == [word, word] and words[2] != word  # a word: free until the answer itself would repeat a bigram


def test_word_tokens_of_the_byte_tokenizer():
    from engine.runtime.generation import word_tokens
    from research.lms.byte_tokenizer import ByteTokenizer

    words = word_tokens(ByteTokenizer())
    assert words.shape == (256,) and words[ord("a")] and not words[ord("7")] and not words[ord(" ")]
