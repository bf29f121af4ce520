"""Model loading, settings validation, and the server's independence from torch."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from engine.config import SHIPPED_EMBEDDER_ADAPTER, SMALL_MODEL, GenerationLimits, IngestConfig, SessionLimits
from engine.models.loader import load_model, resolve_dtype, small_model_dir
from server.settings import Settings
from tests.helpers import CACHE_DIR, make_tiny_llama


def test_load_local_folder(tiny_dir):
    loaded = load_model(str(tiny_dir), cache_dir=CACHE_DIR, device="cpu", dtype="float32")
    assert loaded.name == tiny_dir.name and loaded.architecture == "llama"
    assert loaded.dtype == torch.float32 and loaded.context_len == 4096
    assert not loaded.model.training


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_gets_its_last_row_with_plain_strides(tiny_dir, dtype):
    """With `logits_to_keep=1` the head's input is the last row of [1, T, d]: it reaches the head
    as a [1, 1, d] tensor with the strides of a fresh one (torch copies the whole head weight for
    the strided view when the weight is frozen, engine/models/loader.py), and the logits are the
    full pass's last row."""
    loaded = load_model(str(tiny_dir), cache_dir=CACHE_DIR, device="cpu", dtype=dtype)
    model = loaded.model
    for parameter in model.parameters():
        parameter.requires_grad_(False)  # as a Neurocache adapter leaves the served model
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        last = model(input_ids=ids, logits_to_keep=1).logits[0, -1]
        full = model(input_ids=ids).logits[0, -1]
    assert seen[0].shape == (1, 1, model.config.hidden_size)
    assert seen[0].stride() == torch.empty(seen[0].shape).stride()
    torch.testing.assert_close(last, full)  # a 37-row product may sum in another order


def test_default_model_is_converted_to_safetensors(default_dir):
    assert (default_dir / "model.safetensors").is_file()
    config = json.loads((default_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert "quantization_config" not in config
    loaded = load_model(SMALL_MODEL, cache_dir=CACHE_DIR, device="cpu", dtype="float32")
    assert loaded.name == SMALL_MODEL and loaded.tokenizer.chat_template


def test_default_model_stored_in_bf16_is_float32_rounded_and_readable_by_other_users(tmp_path, default_dir):
    """The image stores the default model in bf16 and serves it as another user."""
    folder = small_model_dir(tmp_path, dtype=torch.bfloat16)
    assert "torch.bfloat16" in (folder / "longdoc-converted.txt").read_text()
    halves, wholes = load_file(folder / "model.safetensors"), load_file(default_dir / "model.safetensors")
    assert halves.keys() == wholes.keys()
    for name, whole in wholes.items():
        assert halves[name].dtype == torch.bfloat16 and torch.equal(halves[name], whole.to(torch.bfloat16)), name
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o644}


def test_missing_folder_and_missing_chat_template(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="local Hugging Face model folder"):
        load_model(str(tmp_path / "nothing"), cache_dir=CACHE_DIR)
    folder = make_tiny_llama(tmp_path / "no-template", tiny_dir)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat template"):
        load_model(str(folder), cache_dir=CACHE_DIR, device="cpu")


def test_dtype_resolution():
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.bfloat16, torch.float32)


def test_settings_validate_models_and_read_env(tmp_path, monkeypatch, tiny_dir):
    with pytest.raises(ValidationError, match="neither"):
        Settings(model=[str(tmp_path / "missing")])
    monkeypatch.setenv("LONGDOC_MODEL", f"{SMALL_MODEL},{tiny_dir}")
    monkeypatch.setenv("LONGDOC_MAX_SESSIONS", "7")
    settings = Settings()
    assert settings.model == [SMALL_MODEL, str(tiny_dir)] and settings.max_sessions == 7
    flags = Settings(_cli_parse_args=["--max-sessions", "3", "--model", str(tiny_dir)])
    assert flags.max_sessions == 3 and flags.model == [str(tiny_dir)]
    assert flags.engine_config().sessions.max_sessions == 3
    with pytest.raises(ValidationError):
        Settings(max_queue=0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_sessions", 0, "max_sessions must be positive"),
        ("max_memory_bytes", 0, "server_memory_bytes must be positive"),
        ("session_memory_bytes", -1, "memory_budget_bytes must be positive"),
        ("segment_len", 8, "segment_len must be at least 16"),
        ("default_max_tokens", 2048, "default_max_tokens <= max_new_tokens"),
        ("max_generation_seconds", 0, "max_generation_seconds must be positive"),
        ("dtype", "int4", "unknown dtype"),
    ],
)
def test_engine_limits_are_checked_once_by_the_engine_and_refused_by_settings(field, value, message):
    with pytest.raises(ValidationError, match=message):
        Settings(**{field: value})


def test_settings_defaults_are_the_engines():
    engine = Settings().engine_config()
    assert engine.sessions == replace(SessionLimits(), server_memory_bytes=engine.sessions.server_memory_bytes)
    assert engine.generation == GenerationLimits() and engine.ingest == IngestConfig()


def test_the_embedder_adapter_is_a_setting(tmp_path):
    assert Settings().engine_config().embedder_adapter == SHIPPED_EMBEDDER_ADAPTER
    assert Settings(embedder_adapter="none").engine_config().embedder_adapter is None
    with pytest.raises(ValidationError, match="no adapter.json"):
        Settings(embedder_adapter=str(tmp_path))


def test_server_never_imports_torch():
    code = (
        "import sys; import server.app, server.routes.ask, server.routes.openai, server.metrics; "
        "bad = [m for m in ('torch', 'faiss', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
