"""A served model's measured defaults: `engine/models/manifests/<model name>.json` for the models
longdoc ships, or `longdoc.json` in a local model folder.

    {"default_memory": "text", "memory_options": {"text": {"top_k": 1}}, "chosen_by": "<the command>", ...}

The default memory of a session made without one is the manifest's, chosen on the QA benchmark
(docs/studies/retrieval.md), never written into the code. `memory_options` are a memory's default options
on this model, chosen on the development questions: a session's own options override them, key by key.
`generation` is the sampling OpenAI chat requests get when they leave it out (`temperature`,
`top_p`): the decoding the model's figures were measured with. They are checked when the model loads: options a memory refuses, or those of a memory the server
does not have, are logged and left out (engine/runtime/registry.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.interface import MAX_TEMPERATURE

log = logging.getLogger(__name__)

SHIPPED_MANIFESTS = Path(__file__).resolve().parent / "manifests"
FALLBACK_MEMORY = "text"  # a model nobody has measured: exact excerpts, no adapter needed


def manifest_of(name: str, source: str) -> dict:
    """The model folder's own manifest, else the shipped one, else {} (an unreadable one is logged)."""
    folder = Path(source).expanduser()
    for path in ([folder / "longdoc.json"] if folder.is_dir() else []) + [SHIPPED_MANIFESTS / f"{name}.json"]:
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
                if isinstance(manifest, dict):
                    return manifest
            except (OSError, ValueError):
                pass
            log.warning("ignoring the unreadable model manifest %s", path)
    return {}


CPU_QUANTIZE_MODES = ("none", "int8", "int4")  # what a manifest may name: modes over the model's own dtype


def cpu_quantize(manifest: dict) -> str:
    """The weight-only mode a manifest names for CPUs (`cpu_quantize`, chosen on the QA benchmark),
    else none (an unknown one is logged)."""
    mode = manifest.get("cpu_quantize", "none")
    if mode not in CPU_QUANTIZE_MODES:
        log.warning("ignoring the model manifest's cpu_quantize %r", mode)
        return "none"
    return str(mode)


def default_memory(manifest: dict) -> str:
    """The memory a manifest names for sessions made without one."""
    return str(manifest.get("default_memory", FALLBACK_MEMORY))


def _sampling_ok(key: str, value: object) -> bool:
    """The API's own bounds: 0 <= temperature <= MAX_TEMPERATURE, 0 < top_p <= 1."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    if key == "temperature":
        return 0.0 <= value <= MAX_TEMPERATURE
    return key == "top_p" and 0.0 < value <= 1.0


def generation_defaults(manifest: dict) -> dict[str, float]:
    """The sampling a manifest sets for OpenAI requests that leave it out (`temperature`, `top_p`),
    as vLLM takes a model's generation config; a value out of range or not a number is logged and
    left out."""
    values = manifest.get("generation", {})
    if not isinstance(values, dict):
        log.warning("ignoring the model manifest's generation: not an object")
        return {}
    kept = {}
    for key, value in values.items():
        if _sampling_ok(key, value):  # an unknown key is never ok
            kept[key] = float(value)
        else:
            log.warning("ignoring the model manifest's generation %s=%r", key, value)
    return kept


def memory_options(manifest: dict) -> dict[str, dict]:
    """Per memory kind, the options a manifest sets on its model ({} when it sets none)."""
    options = manifest.get("memory_options", {})
    if not isinstance(options, dict):
        log.warning("ignoring the model manifest's memory_options: not an object")
        return {}
    return {kind: dict(value) for kind, value in options.items() if isinstance(value, dict)}
