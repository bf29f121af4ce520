"""Serving apart from research: nothing `longdoc serve` runs imports the research package; the
from-scratch LMs reach the engine only through the plugin entry point (engine/plugins.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_engine_and_the_server_never_import_research():
    files = sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "server").rglob("*.py"))
    assert len(files) > 40
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m == "research" or m.startswith("research."))
        for path in files
    }
    assert {path: modules for path, modules in offenders.items() if modules} == {}


def test_the_checker_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from research.lms import build\n    import research.plugin\n")
    assert imported_modules(sample) == {"research.lms", "research.plugin"}


def test_the_research_plugin_is_installed_as_an_entry_point():
    from importlib.metadata import entry_points

    from engine.plugins import PLUGIN_GROUP, load_plugins, shipped_models

    assert [entry.value for entry in entry_points(group=PLUGIN_GROUP)] == ["research.plugin:register"]
    load_plugins()
    assert "cacheformer-bytes" in shipped_models()


def test_a_plugin_that_fails_to_load_is_logged_and_skipped(monkeypatch, caplog):
    from engine import plugins

    class Broken:
        name, value = "broken", "nowhere:register"

        def load(self):
            raise ImportError("no module named nowhere")

    monkeypatch.setattr(plugins, "_loaded", False)
    monkeypatch.setattr(plugins, "plugin_errors", [])
    monkeypatch.setattr(plugins, "entry_points", lambda group: [Broken()])
    plugins.load_plugins()
    assert plugins.plugin_errors == ["broken: no module named nowhere"]
    assert "plugin broken (nowhere:register) failed to load" in caplog.text


# the shared layers name no memory: each memory says what it needs (Memory.model_resources) and
# the batched step reaches an adapter's layers through a protocol (engine/models/llama_step.py)
SHARED_LAYERS = ("engine/runtime/registry.py", "engine/runtime/scheduler.py", "engine/models/llama_step.py")
MEMORY_NAMES = re.compile(r"neurocache|kvcache|kv_select|kv_store|lora|textmemory|truncatememory|state_memory", re.IGNORECASE)


def test_the_registry_and_the_scheduler_name_no_memory():
    found = {path: sorted({m.group(0) for m in MEMORY_NAMES.finditer((ROOT / path).read_text())}) for path in SHARED_LAYERS}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_memory_name_check_sees_a_memory_name():
    assert MEMORY_NAMES.search("from engine.memories.neurocache.adapter import LoRALinear")
    assert MEMORY_NAMES.search("isinstance(memory, KVCacheMemory)")


def test_the_server_never_imports_torch_faiss_or_transformers():
    """Every module of server/, the Ray Serve deployments included, in any function: the server
    reaches tensors only through the engine's interface."""
    heavy = ("torch", "faiss", "transformers")
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.split(".")[0] in heavy)
        for path in sorted((ROOT / "server").rglob("*.py"))
    }
    assert {path: modules for path, modules in offenders.items() if modules} == {}


def test_each_memory_is_a_package_of_its_own():
    memories = ROOT / "engine" / "memories"
    for kind in ("text", "kvcache", "neurocache"):
        assert (memories / kind / "__init__.py").is_file() and (memories / kind / "memory.py").is_file()
    flat = sorted(p.name for p in memories.glob("*.py"))
    assert flat == ["__init__.py", "base.py", "truncate.py"]


def test_the_client_package_never_imports_research():
    """`train` and `eval` reach the `longdoc` command through the `longdoc.cli` entry point."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.split(".")[0] == "research")
        for path in sorted((ROOT / "clients").rglob("*.py"))
    }
    assert {path: modules for path, modules in offenders.items() if modules} == {}
