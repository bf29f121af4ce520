"""Neurocache adapter files: `adapter.safetensors` + `adapter.json` (every hyper-parameter, LoRA
settings and a fingerprint of the base model). Loading is strict and says what does not match."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, cast

from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.memories.neurocache.adapter import Neurocache, NeurocacheConfig, shapes_digest

ADAPTER_FORMAT = "longdoc-neurocache-adapter-v1"
WEIGHTS, META = "adapter.safetensors", "adapter.json"


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def fingerprint(model: nn.Module, tokenizer: PreTrainedTokenizerBase, base_shapes: str | None = None) -> dict[str, Any]:
    """What an adapter must match: architecture, sizes, parameter structure and tokenizer."""
    config = cast(PretrainedConfig, model.config)
    return {
        "architecture": config.model_type,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "parameter_shapes": base_shapes or shapes_digest(model),
        "tokenizer": tokenizer_digest(tokenizer),
    }


def save_adapter(neurocache: Neurocache, tokenizer: PreTrainedTokenizerBase, folder: Path, **manifest: Any) -> None:
    """Write the adapter; `manifest` (command, data, steps, seed, eval figures…) goes into the JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous().cpu() for k, v in neurocache.adapter_state_dict().items()}
    save_file(state, folder / WEIGHTS)
    meta = {
        "format": ADAPTER_FORMAT,
        "neurocache": neurocache.config.to_dict(),
        "base": fingerprint(neurocache.model[0], tokenizer, neurocache.base_shapes),
        "manifest": manifest,
    }
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(folder: Path) -> dict[str, Any]:
    path = folder / META
    if not path.is_file() or not (folder / WEIGHTS).is_file():
        raise FileNotFoundError(f"{folder} holds no Neurocache adapter ({META} and {WEIGHTS})")
    meta = json.loads(path.read_text())
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{path} is not a {ADAPTER_FORMAT} file")
    return meta


def load_adapter(model: nn.Module, tokenizer: PreTrainedTokenizerBase, folder: Path) -> Neurocache:
    """Adapt `model` (not yet adapted) in place with the adapter in `folder`, strictly."""
    meta = read_meta(folder)
    expected, actual = meta["base"], fingerprint(model, tokenizer)
    wrong = [f"{k}: adapter has {expected.get(k)!r}, model has {actual[k]!r}" for k in actual if expected.get(k) != actual[k]]
    if wrong:
        raise ValueError(f"adapter {folder} was trained for another base model: " + "; ".join(wrong))
    neurocache = Neurocache(model, NeurocacheConfig.from_dict(meta["neurocache"]))
    state = load_file(folder / WEIGHTS, device=str(next(model.parameters()).device))
    neurocache.load_adapter_state_dict(
        {k: v.to(next(model.parameters()).dtype) if v.is_floating_point() else v for k, v in state.items()}
    )
    return neurocache
