"""Checkpoints of the from-scratch LMs: safetensors weights + a JSON config, loaded strictly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from research.lms import build
from research.lms.lm_common import LanguageModel

CHECKPOINT_FORMAT = "longdoc-lm-v1"


def is_checkpoint(folder: Path) -> bool:
    try:
        return json.loads((folder / "config.json").read_text()).get("format") == CHECKPOINT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_checkpoint(model: LanguageModel, folder: Path, **manifest: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    meta = {"format": CHECKPOINT_FORMAT, "arch": model.arch, "config": model.config.to_dict(), "manifest": manifest}
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_checkpoint(folder: Path, device: str | torch.device = "cpu") -> LanguageModel:
    """Strict: the architecture is rebuilt from the JSON and every tensor must match it exactly."""
    meta = json.loads((folder / "config.json").read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder} is not a {CHECKPOINT_FORMAT} checkpoint")
    model = build(meta["arch"], **meta["config"])
    state = load_file(folder / "model.safetensors")
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()
