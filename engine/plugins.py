"""Model families from outside the engine, plugged in through the `longdoc.plugins` entry points.

A package names a `register()` function under that group in its pyproject.toml; `load_plugins`
calls each once, before any model is resolved. A plugin registers a `ModelFamily` (the folders it
loads) and, with `engine.memories.register_memory`, the memory its models' sessions use. The engine
never imports a plugin by name; research/plugin.py is the one longdoc ships (the from-scratch LMs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.models.loader import LoadedModel

log = logging.getLogger(__name__)

PLUGIN_GROUP = "longdoc.plugins"


@dataclass(frozen=True)
class ModelFamily:
    name: str
    shipped: Callable[[], dict[str, Path]]  # models served by a bare name, and their folders
    recognises: Callable[[Path], bool]  # whether a folder holds one of this family's models
    load: Callable[[str, str, Path, torch.device], LoadedModel]  # (name, source, folder, device)


_families: list[ModelFamily] = []
_lock = threading.RLock()  # a plugin's register() may itself look at the registry
_loaded = False
plugin_errors: list[str] = []  # plugins that failed to load: "name: error", named where a model is not found


def register_family(family: ModelFamily) -> None:
    _families.append(family)


def load_plugins() -> None:
    """Call every installed plugin's `register()`, once per process. A plugin that fails is logged
    and skipped: the engine's own models and memories are served without it."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        for entry in entry_points(group=PLUGIN_GROUP):
            try:
                entry.load()()
            except Exception as exc:
                log.exception("plugin %s (%s) failed to load; serving without it", entry.name, entry.value)
                plugin_errors.append(f"{entry.name}: {exc}")
            else:
                log.debug("plugin %s registered", entry.name)


def model_families() -> list[ModelFamily]:
    """The families registered so far (`load_plugins` registers the installed ones)."""
    return list(_families)


def shipped_models() -> dict[str, Path]:
    """Every plugin model served by a bare name (`--model NAME`), and its folder."""
    return {name: folder for family in model_families() for name, folder in family.shipped().items()}


def family_of(folder: Path) -> ModelFamily | None:
    return next((family for family in model_families() if family.recognises(folder)), None)
