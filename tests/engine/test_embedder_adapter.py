"""The embedder's LoRA adapter: merged weights equal the adapter's forward, zero B is the base model,
and the trainer's loss moves the factors."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import SHIPPED_EMBEDDER_ADAPTER, embedder_adapter_path
from engine.models.embedder import BASE_NAME, Embedder
from engine.models.embedder_adapter import AdapterConfig, merge_adapter, save_adapter, target_names
from research.training.retriever_train import Pair, batches, loss_of, with_lora


@pytest.fixture
def base(embedder):
    return copy.deepcopy(embedder)


def _inputs(embedder) -> dict[str, torch.Tensor]:
    return embedder.tokenizer(["Which animal carried the spices?", "The hind is let loose."], padding=True, return_tensors="pt")


def test_targets_are_every_layers_projections(embedder) -> None:
    names = target_names(embedder.model)
    layers = embedder.model.config.num_hidden_layers
    assert len(names) == 6 * layers
    assert "encoder.layer.0.attention.self.query" in names and f"encoder.layer.{layers - 1}.output.dense" in names


def test_merged_adapter_equals_the_lora_forward(base, tmp_path: Path) -> None:
    config = AdapterConfig(4, 8.0, tuple(target_names(base.model)))
    lora_model = copy.deepcopy(base.model)
    lora = with_lora(lora_model, config, seed=0)
    generator = torch.Generator().manual_seed(1)
    for module in lora.values():
        module.B.data = torch.randn(module.B.shape, generator=generator) * 0.02
    save_adapter(tmp_path, config, {name: (m.A, m.B) for name, m in lora.items()})
    merged = copy.deepcopy(base.model)
    merge_adapter(merged, tmp_path)
    inputs = _inputs(base)
    with torch.no_grad():
        expected = lora_model(**inputs).last_hidden_state
        got = merged(**inputs).last_hidden_state
        plain = base.model(**inputs).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-2  # the adapter changed something


def test_zero_b_is_the_base_model(base, tmp_path: Path) -> None:
    config = AdapterConfig(4, 8.0, tuple(target_names(base.model)))
    lora = with_lora(copy.deepcopy(base.model), config, seed=0)  # B starts at zero
    save_adapter(tmp_path, config, {name: (m.A, m.B) for name, m in lora.items()})
    merged = copy.deepcopy(base.model)
    merge_adapter(merged, tmp_path)
    for (name, a), (_, b) in zip(merged.state_dict().items(), base.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_an_adapter_for_another_model_is_refused(base, tmp_path: Path) -> None:
    config = AdapterConfig(2, 2.0, ("encoder.layer.0.attention.self.query",))
    save_adapter(tmp_path, config, {config.targets[0]: (torch.zeros(2, 5), torch.zeros(7, 2))})
    with pytest.raises(ValueError, match="does not fit"):
        merge_adapter(copy.deepcopy(base.model), tmp_path)


def test_a_training_step_trains_the_factors_and_freezes_the_base(base) -> None:
    config = AdapterConfig(4, 8.0, tuple(target_names(base.model)))
    lora = with_lora(base.model, config, seed=0)
    trainable = [n for n, p in base.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".A", ".B")) for n in trainable)
    pairs = [
        Pair("b", "Which animals carried the queen's spices?", "She came with camels that bare spices, and very much gold."),
        Pair("b", "What did the mother coat the basket with?", "She daubed it with slime and with pitch."),
    ]
    optimizer = torch.optim.AdamW([p for m in lora.values() for p in (m.A, m.B)], lr=1e-2)
    loss_of(base, pairs, ["And the LORD spake unto Moses, saying,"], scale=20.0).backward()
    optimizer.step()
    assert all(m.B.abs().sum() > 0 for m in lora.values())


def test_batches_take_a_books_questions_together() -> None:
    pairs = [Pair(book, f"q{book}{i}", f"p{book}{i}") for book, n in (("a", 5), ("b", 7), ("c", 9)) for i in range(n)]
    cut = batches(pairs, 4, random.Random(0))
    assert sorted(p.question for b in cut for p in b) == sorted(p.question for p in pairs)
    assert all(len(batch) <= 4 and len({p.book for p in batch}) <= 2 for batch in cut)
    assert sum(len({p.book for p in batch}) == 1 for batch in cut) >= 3


def test_an_adapter_needs_both_files(tmp_path: Path) -> None:
    (tmp_path / "adapter.json").write_text("{}")
    with pytest.raises(ValueError, match="no adapter.safetensors"):
        embedder_adapter_path(str(tmp_path))


def test_the_shipped_adapter_fits_and_names_its_vectors(embedder) -> None:
    adapted = Embedder(adapter=SHIPPED_EMBEDDER_ADAPTER)
    assert embedder.name == BASE_NAME
    assert adapted.name.startswith(f"{BASE_NAME}+adapter@")
    question = ["Which son is likened to a female deer let loose?"]
    assert not np.allclose(embedder.encode(question), adapted.encode(question), atol=1e-3)
