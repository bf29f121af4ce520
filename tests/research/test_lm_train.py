"""From-scratch LM training: steps, checkpoints loaded strictly, resume, held-out bits per byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from research.training.corpus import CANTERBURY
from research.training.lm_train import LMTrainConfig, bits_per_byte, corpus_bytes, initial_model, load_checkpoint, train_lm
from tests.helpers import filler

TINY = dict(dim=16, n_layers=1, n_heads=2, window=8, segment_len=4, compressed_per_segment=2, group_size=4)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bytes")
    for name in (*CANTERBURY, "kjv-Genesis.txt", "kjv-John.txt"):
        (folder / name).write_text(filler(100))
    return folder


@pytest.mark.parametrize(
    "arch, flags",
    [
        ("transformer", {}),
        ("long-short", {}),
        ("cacheformer", {"overlap": True, "cache_top_k": 2}),
        ("segment-cache", {"memory_len": 8, "cache_segments": 2, "cache_top_k": 1}),
        ("perceiver-ar-v3", {"latent": 12, "history_compressed": 4}),
        ("llp", {}),
    ],
)
def test_train_save_load_and_resume(arch, flags, corpus_dir, tmp_path):
    config = LMTrainConfig(
        arch=arch,
        model={**TINY, **flags},
        out=tmp_path / arch,
        corpus_dir=corpus_dir,
        steps=3,
        batch_size=2,
        seq_len=32,
        warmup=1,
        checkpoint_every=2,
        eval_bytes=256,
        device="cpu",
    )
    summary = train_lm(config, command="test")
    assert summary["steps"] == 3 and math.isfinite(summary["heldout_bits_per_byte"])
    model = load_checkpoint(tmp_path / arch / "checkpoint")
    assert model.arch == arch and model.config.cache_top_k == flags.get("cache_top_k", 0)
    _, held_out = corpus_bytes(corpus_dir)
    assert bits_per_byte(model, held_out, 32, 256) == pytest.approx(summary["heldout_bits_per_byte"], rel=1e-5)
    meta = json.loads((tmp_path / arch / "checkpoint" / "config.json").read_text())
    assert meta["manifest"]["command"] == "test" and meta["manifest"]["eval"]["steps"] == 3
    curve = [json.loads(line) for line in (tmp_path / arch / "curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [2, 3] and curve[-1]["heldout_bits_per_byte"] == summary["heldout_bits_per_byte"]
    assert summary["train_targets"] == 3 * 2 * min(32, model.config.latent if arch.startswith("perceiver") else 32)
    config.steps, config.resume = 5, True
    assert train_lm(config)["steps"] == 5


def test_strict_loading(corpus_dir, tmp_path):
    config = LMTrainConfig(
        arch="long-short",
        model=TINY,
        out=tmp_path / "ls",
        corpus_dir=corpus_dir,
        steps=1,
        batch_size=1,
        seq_len=16,
        warmup=1,
        eval_bytes=64,
        device="cpu",
    )
    train_lm(config)
    folder = tmp_path / "ls" / "checkpoint"
    meta = json.loads((folder / "config.json").read_text())
    meta["config"]["dim"] = 32
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises((ValueError, RuntimeError)):
        load_checkpoint(folder)
    meta["format"] = "other"
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a"):
        load_checkpoint(folder)


def test_the_shipped_cacheformer_was_trained_in_two_stages():  # what every shipped one must be: tests/research/test_shipped_lms.py
    from engine.models.loader import load_model
    from research.plugin import SHIPPED_CHECKPOINTS

    folder = SHIPPED_CHECKPOINTS / "cacheformer-bytes"
    loaded = load_model("cacheformer-bytes", cache_dir=Path("/nonexistent"), device="cpu")
    assert loaded.own_memory == "state" and loaded.architecture == "cacheformer" and loaded.context_len == 4096
    meta = json.loads((folder / "config.json").read_text())
    manifest = meta["manifest"]
    assert manifest["command"].startswith("longdoc train lm") and manifest["seed"] == 1
    assert manifest["train_config"]["init"] == "research/checkpoints/cacheformer-bytes"  # stage 2 of MANIFEST.md
    assert manifest["train_config"]["model"] == meta["config"]
    assert manifest["steps"] == 60 and manifest["eval"]["heldout_bits_per_byte"] < 3.2


def test_init_starts_from_a_checkpoint_at_a_longer_length(corpus_dir, tmp_path):
    flags = {**TINY, "overlap": True, "cache_top_k": 2}
    first = LMTrainConfig(
        arch="cacheformer",
        model=flags,
        out=tmp_path / "a",
        corpus_dir=corpus_dir,
        steps=2,
        batch_size=2,
        seq_len=32,
        warmup=1,
        eval_bytes=256,
        device="cpu",
    )
    train_lm(first)
    start = load_checkpoint(tmp_path / "a" / "checkpoint")
    longer = LMTrainConfig(
        arch="cacheformer",
        out=tmp_path / "b",
        corpus_dir=corpus_dir,
        steps=1,
        seq_len=64,
        init=tmp_path / "a" / "checkpoint",
        device="cpu",
    )
    model = initial_model(longer)
    assert model.config.max_seq_len == 64 and model.config.cache_top_k == 2  # the checkpoint's settings
    assert all(
        torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.state_dict().values(), start.state_dict().values(), strict=True)
    )
    with pytest.raises(ValueError, match="holds a cacheformer model"):
        initial_model(LMTrainConfig(arch="long-short", init=tmp_path / "a" / "checkpoint"))
