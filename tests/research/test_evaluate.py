"""Evaluation on a tiny model: a closed-gate adapter leaves perplexity exactly unchanged; pass-key and QA rows."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.errors import InvalidRequestError
from engine.memories.neurocache.adapter import Neurocache, NeurocacheConfig
from engine.memories.neurocache.adapter_io import save_adapter
from research.training.corpus import CANTERBURY
from research.training.evaluate import EvalSetup, markdown, passkey, passkey_document, perplexity
from tests.helpers import filler


def test_passkey_document_puts_the_key_at_the_depth(tiny_tokenizer):
    text = passkey_document(filler(300), 1000, 0.25, "54321", tiny_tokenizer)
    at = text.index("The pass key is 54321")
    assert 0.15 < at / len(text) < 0.35
    assert 950 < len(tiny_tokenizer(text)["input_ids"]) < 1100


def _corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in (*CANTERBURY, "kjv-Genesis.txt", "kjv-John.txt", "kjv-Acts.txt"):
        (corpus / name).write_text(filler(200))
    return corpus


def test_passkey_seed_draws_other_keys_and_misses_name_them(tiny_dir, tmp_path):
    setup = EvalSetup(model=str(tiny_dir), corpus_dir=_corpus(tmp_path), cache_dir=tmp_path / "cache", device="cpu")
    rows = {seed: passkey(setup, memories=("truncate",), lengths=(300,), depths=(0.5,), seed=seed)[0] for seed in (0, 1)}
    for seed, row in rows.items():
        assert (row["memory"], row["length"], row["trials"], row["correct"]) == ("truncate", 300, 1, 0)
        # The tiny random model cannot copy the key; the row names the key drawn from this seed.
        assert row["missed"].startswith(f"depth 0.5: key {random.Random(seed).randrange(10_000, 100_000)}, answered")
    assert rows[0]["missed"] != rows[1]["missed"]


def test_passkey_takes_a_memory_with_its_options(tiny_dir, tmp_path):
    setup = EvalSetup(model=str(tiny_dir), corpus_dir=_corpus(tmp_path), cache_dir=tmp_path / "cache", device="cpu")
    (row,) = passkey(setup, memories=(("truncate", {"window_tokens": 16}),), lengths=(300,), depths=(0.5,))
    assert row["memory"] == 'truncate {"window_tokens": 16}' and row["trials"] == 1
    with pytest.raises(InvalidRequestError, match="window_tokens"):  # the options reach the session
        passkey(setup, memories=(("truncate", {"window_tokens": 1}),), lengths=(300,), depths=(0.5,))


def test_passkey_counts_the_answers_whose_sources_hold_the_key(tiny_dir, tmp_path):
    setup = EvalSetup(model=str(tiny_dir), corpus_dir=_corpus(tmp_path), cache_dir=tmp_path / "cache", device="cpu")
    every_segment = {"segment_len": 16, "top_k": 64, "neighbours": 1, "window": 16, "sinks": 4, "selection": "summary"}
    memories = (("kvcache", every_segment), "truncate", ("truncate", {"window_tokens": 16}))
    rows = passkey(setup, memories=memories, lengths=(300,), depths=(0.5,))
    assert [row["key in sources"] for row in rows] == [1, 1, 0]  # a 16-token window keeps the end, not the key
    assert [row["key's layers"] for row in rows] == ["2.0", "-", "-"]  # the tiny model's two layers both select it


def test_closed_gate_perplexity_equals_the_window_baseline(tiny_dir, tmp_path):
    corpus = _corpus(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    neurocache = Neurocache(model, NeurocacheConfig(top_k=4, capacity=512, lora_rank=2))
    save_adapter(neurocache, AutoTokenizer.from_pretrained(tiny_dir), tmp_path / "adapter")
    setup = EvalSetup(model=str(tiny_dir), adapter=tmp_path / "adapter", corpus_dir=corpus, device="cpu")
    rows = perplexity(setup, segment_len=64, capacities=(128, 1024), max_tokens=400)
    assert [r["setting"].split(",")[0] for r in rows] == [
        "base",
        "base",
        "base + adapter",
        "base + Neurocache",
        "base + Neurocache",
    ]
    window, _, empty, small, large = rows
    assert empty["perplexity"] == window["perplexity"]
    assert small["tokens"] == window["tokens"] > 1000
    assert small["perplexity"] == window["perplexity"] == large["perplexity"]
    assert "| setting |" in markdown(rows)


def test_what_runs_beside_the_server_keeps_models_where_the_server_does(monkeypatch, tmp_path):
    """LONGDOC_CACHE_DIR is read by the evals, the trainer and the built kernels as by the server: on a GPU
    machine (2026-11-29) an eval ignored it and converted the default model a second time."""
    from engine.config import DEFAULT_CACHE_DIR, operator_cache_dir
    from engine.models.cpu_kernels import kernel_dir
    from research.training.neurocache_train import TrainConfig
    from server.settings import Settings

    monkeypatch.delenv("LONGDOC_KERNEL_DIR", raising=False)
    monkeypatch.setenv("LONGDOC_CACHE_DIR", str(tmp_path))
    assert operator_cache_dir() == EvalSetup().cache_dir == TrainConfig().cache_dir == Settings().cache_dir == tmp_path
    assert kernel_dir() == tmp_path / "kernels"
    monkeypatch.delenv("LONGDOC_CACHE_DIR")
    assert operator_cache_dir() == EvalSetup().cache_dir == Settings().cache_dir == DEFAULT_CACHE_DIR
