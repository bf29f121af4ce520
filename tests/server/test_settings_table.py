"""Each engine setting is written once: engine/config.py's `ENGINE_SETTINGS` table (flag, engine
field, description), the field's own default and bound; the server's settings and `longdoc serve`
flags are built from it."""

from __future__ import annotations

import ast
import operator
from dataclasses import fields
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.config import DERIVED_FIELDS, ENGINE_SETTINGS, EngineConfig, field_default
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def engine_fields() -> set[str]:
    """Every leaf field of EngineConfig, as "section.name" or "name"."""
    paths: set[str] = set()
    for spec in fields(EngineConfig):
        section = field_default(spec.name)
        if hasattr(section, "__dataclass_fields__"):
            paths.update(f"{spec.name}.{leaf.name}" for leaf in fields(section))
        else:
            paths.add(spec.name)
    return paths


def test_every_engine_field_is_set_by_one_flag_or_derived():
    flagged = [row.field for row in ENGINE_SETTINGS]
    assert len(flagged) == len(set(flagged))  # one flag a field
    assert not set(flagged) & set(DERIVED_FIELDS)
    assert set(flagged) | set(DERIVED_FIELDS) == engine_fields()


def test_the_settings_take_default_and_description_from_the_table():
    for row in ENGINE_SETTINGS:
        info = Settings.model_fields[row.flag]
        assert info.default == field_default(row.field), row.flag
        assert info.description == row.description, row.flag


def test_the_settings_write_no_engine_default_themselves():
    """In server/settings.py, each of the table's flags is assigned `engine_setting(flag)`, nothing else."""
    tree = ast.parse((ROOT / "server" / "settings.py").read_text())
    settings = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings")
    assigned = {
        node.target.id: node.value
        for node in settings.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    for row in ENGINE_SETTINGS:
        value = assigned[row.flag]
        assert isinstance(value, ast.Call) and ast.unparse(value) == f"engine_setting({row.flag!r})", row.flag


def test_each_flag_reaches_its_engine_field():
    settings = Settings()
    config = settings.engine_config()
    for row in ENGINE_SETTINGS:
        expected = getattr(settings, row.flag)
        expected = expected.expanduser() if row.flag == "cache_dir" else expected
        assert operator.attrgetter(row.field)(config) == expected, row.flag


def test_a_flag_sets_its_field_and_its_bound_is_the_engines():
    flags = Settings(_cli_parse_args=["--session-ttl-seconds", "12", "--prefill-chunk", "0"])
    assert flags.engine_config().sessions.idle_ttl_seconds == 12.0
    assert flags.engine_config().generation.prefill_chunk == 0
    with pytest.raises(ValidationError, match="prefill_chunk must be 0"):
        Settings(prefill_chunk=-1)


def test_longdoc_serve_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        Settings(_cli_parse_args=["--help"], _cli_prog_name="longdoc serve")
    shown = capsys.readouterr().out
    for row in ENGINE_SETTINGS:
        assert "--" + row.flag.replace("_", "-") in shown, row.flag
