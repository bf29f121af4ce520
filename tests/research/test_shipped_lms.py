"""Every shipped from-scratch checkpoint (research/checkpoints/): at most 10 MB, served by name on the
`state` memory, its manifest consistent with its weights, and its held-out score reproduced from
the weights (the held-out split begins with alice29.txt, a test fixture here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from engine.models.loader import load_model
from research.lms.feeders import feeder_for
from research.lms.lm_common import LanguageModel
from research.plugin import shipped_checkpoints
from research.training.lm_train import bits_per_byte
from tests.helpers import FIXTURES

HELD_OUT_START = np.frombuffer((FIXTURES / "alice29.txt").read_bytes().replace(b"\r\n", b"\n"), dtype=np.uint8)


# README and docs/research-families.md name each
SHIPPED = ("cacheformer-bytes", "llp-bytes", "perceiver-ar-bytes", "segment-cache-bytes")


def test_the_shipped_checkpoints_are_the_documented_ones():
    assert tuple(sorted(shipped_checkpoints())) == tuple(sorted(SHIPPED))


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_checkpoint_is_small_servable_and_scores_what_its_manifest_says(name):
    folder = shipped_checkpoints()[name]
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 10 * 2**20
    assert (folder / "MANIFEST.md").is_file()
    loaded = load_model(name, cache_dir=Path("/nonexistent"), device="cpu")
    model = cast(LanguageModel, loaded.model)  # a plugin's model, typed as a Hugging Face one in LoadedModel
    assert loaded.own_memory == "state" and loaded.context_len == model.config.max_seq_len
    feeder_for(model)  # the state memory can feed it
    meta = json.loads((folder / "config.json").read_text())
    manifest, trained = meta["manifest"], meta["manifest"]["train_config"]
    assert manifest["command"].startswith("longdoc train lm") and trained["model"] == meta["config"]
    assert trained["eval_bytes"] <= len(HELD_OUT_START)
    score = bits_per_byte(model, HELD_OUT_START, trained["seq_len"], trained["eval_bytes"], trained.get("eval_scored"))
    assert score == pytest.approx(manifest["eval"]["heldout_bits_per_byte"], abs=1e-4)
