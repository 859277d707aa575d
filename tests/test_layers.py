"""Imports go one way (ext -> edge_sdk -> server_kit): no device module names the server package."""

from __future__ import annotations

import ast
import re
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


def test_one_definition_of_each_setting_check():
    """The validators live in edge_sdk/_validation.py; no module defines a private copy again."""
    import re

    copies = re.compile(r"^def (_check_int|check_int|_check_positive_int|_positive_int|_check_positive|_positive|"
                        r"_check_k|check_number)\(", re.M)
    found = {str(p.relative_to(ROOT)): copies.findall(p.read_text(encoding="utf-8"))
             for p in sorted([*(ROOT / "edge_sdk").rglob("*.py"), *(ROOT / "server_kit").rglob("*.py")])}
    assert {p: names for p, names in found.items() if names} == {
        "edge_sdk/_validation.py": ["check_int", "check_number"],
        # a different contract, kept: two messages ("must be an integer", "must be >= N"), name first
        "server_kit/data/partition.py": ["_check_int"],
        # an argparse type: text in, not a value
        "server_kit/data/split.py": ["_positive_int"],
    }


def test_the_shared_checks_say_what_they_refuse():
    import numpy as np
    import pytest

    from edge_sdk._validation import check_int, check_positive, check_positive_int

    assert check_int(np.int64(3), "n", 0) == 3 and type(check_int(np.int64(3), "n", 0)) is int
    for bad in (True, np.bool_(True), 2.0, "2", -1):
        with pytest.raises(ValueError, match=f"^n must be an integer >= 0, got {re.escape(repr(bad))}$"):
            check_int(bad, "n", 0)
    with pytest.raises(ValueError, match=r"^k must be a positive integer, got 0$"):
        check_positive_int(0, "k")
    assert check_positive(np.float32(0.5), "lr") == 0.5
    with pytest.raises(ValueError, match=r"^timeout_s must be a positive number of seconds, got nan$"):
        check_positive(float("nan"), "timeout_s", "number of seconds")
