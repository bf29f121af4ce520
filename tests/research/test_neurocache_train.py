"""Neurocache training on a tiny model: episodes, schedule, steps, checkpoints and resume."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from safetensors.torch import load_file

from engine.memories.neurocache.adapter import Neurocache, NeurocacheConfig
from engine.memories.neurocache.adapter_io import read_meta
from research.training.corpus import CANTERBURY
from research.training.fact_tasks import NAMES, facts
from research.training.neurocache_data import DISTRACTOR_NAMES, EpisodeSampler, near_miss, tokenize_files
from research.training.neurocache_train import TrainConfig, Trainer, parameter_groups, train
from research.training.schedule import lr_factor
from tests.helpers import CONFIG, filler, tiny


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for name in (*CANTERBURY, "kjv-Genesis.txt", "kjv-John.txt"):
        (folder / name).write_text(filler(400))  # present, so nothing is downloaded
    return folder


def test_passkey_episode_layout(tiny_tokenizer, corpus_dir):
    corpus = tokenize_files(tiny_tokenizer, sorted(corpus_dir.glob("*.txt")))
    sampler = EpisodeSampler(tiny_tokenizer, corpus, segment_len=64, n_segments=4, passkey_ratio=1.0, seed=0)
    for _ in range(5):
        episode = sampler.sample()
        assert episode.kind == "passkey" and len(episode.token_ids) == 256 == len(episode.answer_mask)
        text = tiny_tokenizer.decode(episode.token_ids)
        key = text.split("The pass key is ")[1][:5]
        assert key.isdigit()
        last = tiny_tokenizer.decode(episode.token_ids[192:])
        assert "What is the pass key?" in last and key not in last.split("The pass key is")[0]
        body = tiny_tokenizer.decode(episode.token_ids[:192])
        assert f"The pass key is {key}" in body  # the fact lies before the last segment
        answer = tiny_tokenizer.decode([t for t, m in zip(episode.token_ids, episode.answer_mask, strict=True) if m])
        assert key in answer


def test_schedule_warms_up_then_decays():
    factors = [lr_factor(s, warmup=10, total=100, min_ratio=0.1) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in pairwise(factors[10:]))
    assert factors[-1] == pytest.approx(0.1, abs=0.01)


def test_train_checkpoint_and_resume(tiny_dir, corpus_dir, tmp_path):
    config = TrainConfig(
        model=str(tiny_dir),
        out=tmp_path / "run",
        corpus_dir=corpus_dir,
        device="cpu",
        steps=4,
        batch_size=2,
        segment_len=32,
        n_segments=3,
        accumulation=2,
        lr=1e-2,
        warmup=1,
        checkpoint_every=2,
        passkey_ratio=0.5,
        neurocache=NeurocacheConfig(top_k=4, capacity=512, lora_rank=2, retrieval_layer=0),
    )
    records = train(config, command="test")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["lm_loss"]) and r["grad_norm"] > 0 for r in records)
    assert records[-1]["gate_abs_mean"] > 0  # the gates opened
    meta = read_meta(tmp_path / "run" / tiny_dir.name)  # named after the model, as serving looks for it
    assert meta["manifest"]["steps"] == 4 and meta["manifest"]["command"] == "test"
    config.steps, config.resume = 6, True
    more = train(config)
    assert [r["step"] for r in more] == [5, 6]
    lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]


def test_gates_train_at_their_own_learning_rate():
    neurocache = Neurocache(tiny("llama"), CONFIG)
    rest, gates = parameter_groups(neurocache, lr=1e-4, gate_lr=1e-2)
    assert rest["lr"] == 1e-4 and gates["lr"] == 1e-2
    own_rate = {id(p) for a in neurocache.cache_attention.values() for p in (a.gate, a.slot_bias)}
    assert {id(p) for p in gates["params"]} == own_rate
    everything = [id(p) for p in neurocache.adapter_parameters()]
    assert sorted(everything) == sorted(id(p) for p in rest["params"] + gates["params"])  # each exactly once


def test_distractor_facts_are_near_misses_and_never_hide_the_key(tiny_tokenizer, corpus_dir):
    corpus = tokenize_files(tiny_tokenizer, sorted(corpus_dir.glob("*.txt")))
    sampler = EpisodeSampler(tiny_tokenizer, corpus, segment_len=96, n_segments=4, passkey_ratio=1.0, seed=3, distractors=3)
    seen = 0
    for _ in range(8):
        episode = sampler.sample()
        assert len(episode.token_ids) == 384
        text = tiny_tokenizer.decode(episode.token_ids[:288])
        key = text.split("The pass key is ")[1][:5]
        assert f"{key} is the pass key." in text  # the whole fact is cached, before the question's segment
        for name in DISTRACTOR_NAMES:
            for part in text.split(f"The {name} is ")[1:]:
                other = part[:5]
                assert other.isdigit() and other != key
                assert sum(a == b for a, b in zip(other, key, strict=True)) >= 3 or sorted(other) == sorted(key)
                seen += 1
        answer = tiny_tokenizer.decode([t for t, m in zip(episode.token_ids, episode.answer_mask, strict=True) if m])
        assert key in answer
    assert seen > 0


def test_near_miss_differs_from_the_key():
    rng = random.Random(0)
    for _ in range(200):
        key = str(rng.randrange(10_000, 100_000))
        other = near_miss(rng, key)
        assert other != key and len(other) == 5 and other[0] != "0"


def test_fine_tuning_starts_from_the_given_adapter(tiny_dir, corpus_dir, tmp_path):
    config = TrainConfig(
        model=str(tiny_dir),
        out=tmp_path / "first",
        corpus_dir=corpus_dir,
        device="cpu",
        steps=2,
        batch_size=1,
        segment_len=32,
        n_segments=2,
        accumulation=1,
        lr=1e-2,
        warmup=1,
        passkey_ratio=0.5,
        neurocache=NeurocacheConfig(top_k=3, capacity=256, lora_rank=2, retrieval_layer=0),
    )
    train(config)
    first = tmp_path / "first" / tiny_dir.name
    tuned = Trainer(replace(config, out=tmp_path / "second", init_adapter=first, neurocache=NeurocacheConfig()))
    assert tuned.neurocache.config.top_k == 3  # the adapter's settings, not the defaults passed
    saved = load_file(first / "adapter.safetensors")
    for name, tensor in tuned.neurocache.adapter_state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_repeats_give_keys_with_a_digit_twice(tiny_tokenizer, corpus_dir):
    corpus = tokenize_files(tiny_tokenizer, sorted(corpus_dir.glob("*.txt")))
    always = EpisodeSampler(tiny_tokenizer, corpus, segment_len=64, n_segments=4, passkey_ratio=1.0, seed=0, repeats=1.0)
    never = EpisodeSampler(tiny_tokenizer, corpus, segment_len=64, n_segments=4, passkey_ratio=1.0, seed=0)
    keys = [always._key() for _ in range(100)]
    assert all(len(set(k)) < 5 and len(k) == 5 and k[0] != "0" for k in keys)
    plain = [never._key() for _ in range(200)]
    assert any(len(set(k)) == 5 for k in plain)  # without the option, about 30% of keys have five different digits


def test_bad_distractor_settings_fail_clearly(tiny_tokenizer, corpus_dir):
    corpus = tokenize_files(tiny_tokenizer, sorted(corpus_dir.glob("*.txt")))
    for bad in ({"distractors": -1}, {"repeats": 1.5}):
        with pytest.raises(ValueError, match="distractors must be"):
            EpisodeSampler(tiny_tokenizer, corpus, segment_len=64, n_segments=4, passkey_ratio=1.0, seed=0, **bad)
    crowded = EpisodeSampler(tiny_tokenizer, corpus, segment_len=64, n_segments=2, passkey_ratio=1.0, seed=0, distractors=40)
    with pytest.raises(ValueError, match="do not fit"):
        for _ in range(20):
            crowded.sample()


def test_fact_episode_asks_about_a_fact_stated_before_the_last_segment(tiny_tokenizer, corpus_dir):
    corpus = tokenize_files(tiny_tokenizer, sorted(corpus_dir.glob("*.txt")))
    sampler = EpisodeSampler(
        tiny_tokenizer, corpus, segment_len=128, n_segments=4, passkey_ratio=0.0, fact_ratio=1.0, seed=5, distractors=3
    )
    for _ in range(8):
        episode = sampler.sample()
        assert episode.kind == "fact" and len(episode.token_ids) == 512 == len(episode.answer_mask)
        body = tiny_tokenizer.decode(episode.token_ids[:384])
        last = tiny_tokenizer.decode(episode.token_ids[384:])
        answer = tiny_tokenizer.decode([t for t, m in zip(episode.token_ids, episode.answer_mask, strict=True) if m])
        answer = answer.removesuffix(tiny_tokenizer.eos_token or "").strip()
        question = last.split(answer)[0]
        asked = next(name for name in NAMES if name in question)
        statement = next(part for part in body.split(".") if asked in part)  # stated before the last segment
        content = set(answer.rstrip(".").split()) - set(question.replace("?", " ").split())
        assert content and all(word in statement for word in content), (statement, answer)
        others = [name for name in NAMES if name in body and name != asked]
        assert not any(name in answer for name in others)


def test_facts_name_different_people_and_answer_with_the_statement_words():
    rng = random.Random(0)
    for _ in range(50):
        told = facts(rng, 5)
        names = [next(n for n in NAMES if f.question.count(n)) for f in told]
        assert len(set(names)) == 5
        content = set(told[0].answer.rstrip(".").split()) - set(told[0].question.rstrip("?").split())
        assert content and all(word in told[0].statement for word in content)


def test_episode_kinds_follow_the_ratios(tiny_tokenizer, corpus_dir):
    corpus = tokenize_files(tiny_tokenizer, sorted(corpus_dir.glob("*.txt")))
    sampler = EpisodeSampler(tiny_tokenizer, corpus, segment_len=96, n_segments=3, passkey_ratio=0.3, fact_ratio=0.3, seed=0)
    kinds = [sampler.sample().kind for _ in range(200)]
    for kind in ("passkey", "fact", "lm"):
        assert 0.2 < kinds.count(kind) / len(kinds) < 0.5, kind
    with pytest.raises(ValueError, match="sum to at most 1"):
        EpisodeSampler(tiny_tokenizer, corpus, segment_len=96, n_segments=3, passkey_ratio=0.6, fact_ratio=0.6, seed=0)
    with pytest.raises(ValueError, match="a name per fact"):
        EpisodeSampler(
            tiny_tokenizer,
            corpus,
            segment_len=96,
            n_segments=3,
            passkey_ratio=0.0,
            fact_ratio=0.5,
            seed=0,
            distractors=len(NAMES),
        )
