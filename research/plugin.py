"""The from-scratch LMs as a longdoc plugin (engine/plugins.py): `longdoc serve --model NAME` serves
a shipped checkpoint by name, or any `longdoc train lm` checkpoint folder, each session on the
`state` memory. pyproject.toml lists `register` under the `longdoc.plugins` entry points."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.memories import register_memory
from engine.models.loader import LoadedModel
from engine.plugins import ModelFamily, register_family
from research.lms.byte_tokenizer import ByteTokenizer
from research.lms.feeders import feeder_for
from research.lms.lm_io import is_checkpoint, load_checkpoint
from research.lms.state_memory import StateMemory

SHIPPED_CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"


def shipped_checkpoints() -> dict[str, Path]:
    return {folder.name: folder for folder in sorted(SHIPPED_CHECKPOINTS.iterdir()) if is_checkpoint(folder)}


def load(name: str, source: str, folder: Path, device: torch.device) -> LoadedModel:
    """A byte-level from-scratch LM checkpoint, kept in float32 (it was trained in it)."""
    model = load_checkpoint(folder, device)
    feeder_for(model)  # a family the state memory cannot feed is refused here
    # the engine reaches this model and tokenizer only through the state memory and generation's
    # duck-typed calls (forward, decode), never as a Hugging Face model
    return LoadedModel(
        name=name,
        source=source,
        model=cast(PreTrainedModel, model),
        tokenizer=cast(PreTrainedTokenizerBase, ByteTokenizer()),
        device=device,
        dtype=torch.float32,
        architecture=model.arch,
        context_len=model.config.max_seq_len,
        own_memory=StateMemory.kind,
    )


def register() -> None:
    register_memory(StateMemory, former_names=("stream",))  # its name until 2026-11-23
    register_family(ModelFamily("from-scratch LM", shipped_checkpoints, is_checkpoint, load))
