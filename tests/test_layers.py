"""Imports go one way (ext -> edge_sdk -> server_kit): no device module names the server package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_edge_sdk_module_imports_server_kit():
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imported(p) if n.split(".")[0] == "server_kit")
                 for p in sorted((ROOT / "edge_sdk").rglob("*.py"))}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_fedsketch_export_comes_from_the_server_side_through_an_entry_point(capsys):
    import pytest

    from edge_sdk.cli import COMMANDS_GROUP, _plugin_commands, main

    plugins = _plugin_commands()
    assert {name: ep.value for name, ep in plugins.items()} == {"export": "server_kit.export:main"}
    assert plugins["export"].group == COMMANDS_GROUP
    with pytest.raises(SystemExit) as done:  # the server's own parser answers, with its own usage
        main(["export", "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: fedsketch export ")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Train and export the shipped model artifacts (ONNX + safetensors + manifest) (fedsketch export --help)" \
        in " ".join(capsys.readouterr().out.split())
