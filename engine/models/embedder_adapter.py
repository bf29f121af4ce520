"""A low-rank adapter for the sentence embedder (LoRA: Hu et al., 2021), merged into its weights.

An adapter folder holds `adapter.json` ({"rank", "alpha", "targets"}: the Linear modules it adapts,
by their names in the embedder's model) and `adapter.safetensors` (for each target, `<name>.A`
[rank, in] and `<name>.B` [out, rank]). Merging adds (alpha / rank) · B @ A to each target's
weight once, at load: encoding then costs what the base model costs. With B zero (an adapter
that has learned nothing) the merged model is the base model exactly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.config import EMBEDDER_ADAPTER_FILES

CONFIG, WEIGHTS = EMBEDDER_ADAPTER_FILES
TARGETS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # module names in the model

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_names(model: torch.nn.Module) -> list[str]:
    """The Linear modules of a BERT-style encoder's layers that an adapter adapts, by name."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layer." in name and name.split(".layer.")[1].split(".", 1)[1] in TARGETS
    ]


def save_adapter(folder: Path, config: AdapterConfig, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write `factors` (target name -> (A, B)) and `config` to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in factors.items():
        tensors[f"{name}.A"], tensors[f"{name}.B"] = a.detach().float().contiguous(), b.detach().float().contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    meta = {"rank": config.rank, "alpha": config.alpha, "targets": list(config.targets)}
    (folder / CONFIG).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def adapter_name(folder: Path) -> str:
    """The start of the SHA-256 of the adapter's settings and weights: vectors made with another
    adapter (or another alpha) never pass for this one's, and a copy elsewhere is the same adapter."""
    digest = hashlib.sha256((folder / CONFIG).read_bytes() + (folder / WEIGHTS).read_bytes()).hexdigest()[:12]
    return f"adapter@{digest}"


def merge_adapter(model: torch.nn.Module, folder: Path) -> AdapterConfig:
    """Add the adapter in `folder` to `model`'s weights in place; its targets must all exist there
    with matching shapes (a ValueError says which does not)."""
    meta = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    config = AdapterConfig(int(meta["rank"]), float(meta["alpha"]), tuple(meta["targets"]))
    if config.rank < 1:
        raise ValueError(f"embedder adapter {folder}: rank must be positive")
    tensors = load_file(str(folder / WEIGHTS))
    modules = dict(model.named_modules())
    for name in config.targets:
        module = modules.get(name)
        a, b = tensors.get(f"{name}.A"), tensors.get(f"{name}.B")
        if not isinstance(module, torch.nn.Linear) or a is None or b is None:
            raise ValueError(f"embedder adapter {folder}: {name} does not fit the model")
        if (tuple(a.shape), tuple(b.shape)) != ((config.rank, module.in_features), (module.out_features, config.rank)):
            raise ValueError(f"embedder adapter {folder}: {name} does not fit the model")
        with torch.no_grad():
            delta = config.scale * (b @ a)
            module.weight += delta.to(module.weight.dtype)
    return config
