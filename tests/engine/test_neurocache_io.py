"""Adapter files: round trip, and clear errors for every kind of mismatch."""

from __future__ import annotations

import json
from typing import cast

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from engine.memories.neurocache.adapter_io import load_adapter, read_meta, save_adapter
from tests.helpers import CONFIG, VOCAB, adapted, filled_cache, open_gates, tiny


class VocabTokenizer:
    def __init__(self, n: int) -> None:
        self._vocab = {f"t{i}": i for i in range(n)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def vocab_tokenizer(n: int) -> PreTrainedTokenizerBase:
    """A `VocabTokenizer` where the adapter files expect a tokenizer (they read only its vocabulary)."""
    return cast(PreTrainedTokenizerBase, VocabTokenizer(n))


def test_round_trip_gives_the_same_model(tmp_path):
    model, neurocache, _ = adapted("llama")
    open_gates(neurocache)
    save_adapter(neurocache, vocab_tokenizer(VOCAB), tmp_path / "a", steps=3, seed=0)
    meta = read_meta(tmp_path / "a")
    assert meta["neurocache"]["top_k"] == CONFIG.top_k and meta["neurocache"]["lora_rank"] == CONFIG.lora_rank
    assert meta["manifest"] == {"steps": 3, "seed": 0}
    fresh = tiny("llama")
    loaded = load_adapter(fresh, vocab_tokenizer(VOCAB), tmp_path / "a")
    ids = torch.randint(0, VOCAB, (1, 10))
    cache = filled_cache(neurocache)
    with torch.no_grad():
        with neurocache.attached([cache]):
            a = model(ids).logits
        with loaded.attached([cache]):
            b = fresh(ids).logits
    assert torch.equal(a, b)


def test_mismatches_fail_with_a_clear_message(tmp_path):
    _, neurocache, _ = adapted("llama")
    save_adapter(neurocache, vocab_tokenizer(VOCAB), tmp_path / "a")
    with pytest.raises(ValueError, match="tokenizer"):
        load_adapter(tiny("llama"), vocab_tokenizer(VOCAB + 1), tmp_path / "a")
    with pytest.raises(ValueError, match="architecture"):
        load_adapter(tiny("gpt2"), vocab_tokenizer(VOCAB), tmp_path / "a")
    with pytest.raises(FileNotFoundError):
        load_adapter(tiny("llama"), vocab_tokenizer(VOCAB), tmp_path / "missing")
    meta = json.loads((tmp_path / "a" / "adapter.json").read_text())
    meta["neurocache"]["lora_rank"] = 2  # weights no longer fit the settings
    (tmp_path / "a" / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="shape"):
        load_adapter(tiny("llama"), vocab_tokenizer(VOCAB), tmp_path / "a")
    meta["neurocache"]["surprise"] = 1
    (tmp_path / "a" / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown Neurocache settings"):
        load_adapter(tiny("llama"), vocab_tokenizer(VOCAB), tmp_path / "a")


def test_shipping_stores_bfloat16_and_loads_strictly(tmp_path):
    from scripts.ship_adapter import ship

    model, neurocache, _ = adapted("llama")
    open_gates(neurocache)
    save_adapter(neurocache, vocab_tokenizer(VOCAB), tmp_path / "run", steps=3)
    ship(tmp_path / "run", tmp_path / "shipped", {"passkey": "5/5"})
    meta = read_meta(tmp_path / "shipped")
    assert meta["manifest"]["steps"] == 3 and meta["manifest"]["eval"] == {"passkey": "5/5"}
    assert meta["manifest"]["stored_dtype"] == "bfloat16"
    loaded = load_adapter(tiny("llama"), vocab_tokenizer(VOCAB), tmp_path / "shipped")
    original, shipped = neurocache.adapter_state_dict(), loaded.adapter_state_dict()
    assert original.keys() == shipped.keys()
    for name, tensor in original.items():  # the float32 model holds each weight rounded to bfloat16
        torch.testing.assert_close(shipped[name], tensor.to(torch.bfloat16).float(), rtol=0, atol=0)
