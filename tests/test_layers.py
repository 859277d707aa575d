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


def test_only_the_torch_nets_module_imports_torch_at_its_top_and_nobody_imports_it_eagerly():
    """A device without torch (a Raspberry Pi) must still import every edge_sdk module it uses and sketch."""

    def top_level(path: Path) -> set[str]:
        names = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            for sub in [node, *(getattr(node, "body", []) if isinstance(node, ast.Try) else [])]:
                if isinstance(sub, ast.Import):
                    names.update(a.name for a in sub.names)
                elif isinstance(sub, ast.ImportFrom):
                    names.add("." * sub.level + (sub.module or "") + ":" + ",".join(a.name for a in sub.names))
        return names

    found = {str(p.relative_to(ROOT)): top_level(p) for p in sorted((ROOT / "edge_sdk").rglob("*.py"))}
    torch_at_top = sorted(p for p, names in found.items() if any(n.split(":")[0].split(".")[0] == "torch"
                                                                  for n in names))
    assert torch_at_top == ["edge_sdk/training/_torch_nets.py"]
    assert sorted(p for p, names in found.items() if any("_torch_nets" in n for n in names)) == []


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
    """The validators live in edge_sdk/validation.py; no module defines a private copy again."""
    import re

    copies = re.compile(r"^def (_check_int|check_int|_check_positive_int|_positive_int|_check_positive|_positive|"
                        r"_check_k|check_number)\(", re.M)
    found = {str(p.relative_to(ROOT)): copies.findall(p.read_text(encoding="utf-8"))
             for p in sorted([*(ROOT / "edge_sdk").rglob("*.py"), *(ROOT / "server_kit").rglob("*.py")])}
    assert {p: names for p, names in found.items() if names} == {
        "edge_sdk/validation.py": ["check_int", "check_number"],
        # a different contract, kept: two messages ("must be an integer", "must be >= N"), name first
        "server_kit/data/partition.py": ["_check_int"],
        # an argparse type: text in, not a value
        "server_kit/data/split.py": ["_positive_int"],
    }


def test_the_shared_checks_say_what_they_refuse():
    import numpy as np
    import pytest

    from edge_sdk.validation import check_choice, check_int, check_positive, check_positive_int

    assert check_int(np.int64(3), "n", 0) == 3 and type(check_int(np.int64(3), "n", 0)) is int
    for bad in (True, np.bool_(True), 2.0, "2", -1):
        with pytest.raises(ValueError, match=f"^n must be an integer >= 0, got {re.escape(repr(bad))}$"):
            check_int(bad, "n", 0)
    with pytest.raises(ValueError, match=r"^k must be a positive integer, got 0$"):
        check_positive_int(0, "k")
    assert check_positive(np.float32(0.5), "lr") == 0.5
    with pytest.raises(ValueError, match=r"^timeout_s must be a positive number of seconds, got nan$"):
        check_positive(float("nan"), "timeout_s", "number of seconds")
    assert check_choice("sgd", "optimizer", ("adam", "sgd")) == "sgd"
    with pytest.raises(ValueError, match=r"^optimizer must be one of \['adam', 'sgd'\], got 'rmsprop'$"):
        check_choice("rmsprop", "optimizer", ("adam", "sgd"))
    with pytest.raises(ValueError, match=r"^init must be one of \('a', 'b'\), got 'c'$"):
        check_choice("c", "init", ("a", "b"), ("a", "b"))


def test_public_faces_are_pinned_sorted_and_cheap_to_import():
    import subprocess
    import sys

    import edge_sdk
    import server_kit

    assert edge_sdk.__all__ == sorted(edge_sdk.__all__, key=str)
    assert server_kit.__all__ == sorted(server_kit.__all__)
    assert set(server_kit.__all__) == {
        "ClientInfo", "ClusteredFedAvg", "EmbeddedBroker", "EmulatedFleet", "FedAvg", "FedCRefCoordinator",
        "FedCRefServer", "MosquittoBroker", "Orchestrator", "STRATEGIES", "ServerConfig", "Simulator",
        "SketchClustered", "SketchClustering", "Strategy", "clustering_scores", "make_strategy", "plot_search",
        "run_fedcref", "write_report"}
    assert {"EdgeClient", "NetworkLoop", "SERVER_ID", "OnnxEncoder", "Sketcher", "MqttTransport"} <= set(
        edge_sdk.__all__)
    code = ("import sys, edge_sdk, server_kit\n"
            "heavy = [m for m in ('torch', 'sklearn', 'scipy', 'matplotlib') if m in sys.modules]\n"
            "[getattr(edge_sdk, n) for n in edge_sdk.__all__]\n"
            "print(heavy, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["[]", "False"], out.stdout + out.stderr  # neither import pulls a heavy package
    for name in server_kit.__all__:
        assert getattr(server_kit, name) is not None
    with __import__("pytest").raises(AttributeError, match="module 'server_kit' has no attribute 'nope'"):
        server_kit.nope  # noqa: B018


def test_the_methods_of_the_literature_live_in_one_package_and_nowhere_else():
    import importlib

    import pytest

    from server_kit.strategies import LAZY_STRATEGIES

    assert {m for m, _ in LAZY_STRATEGIES.values()} == {
        f"server_kit.strategies.{m}" for m in ("ifca", "ladd", "ocfl", "cfl", "briggs", "kmeans_weights", "flis")}
    # the package was never released: no second path to the same module (a newcomer sees one cfl.py)
    for old in ("server_kit.ifca", "server_kit.ladd", "server_kit.ocfl", "server_kit.cfl", "server_kit.briggs",
                "server_kit.kmeans_weights", "server_kit.flis", "server_kit.update_clustered",
                "server_kit.strategy", "server_kit.orchestrator", "server_kit.simulate", "server_kit.fedcref_mqtt",
                "edge_sdk.fedcref_mqtt", "edge_sdk.netloop"):
        with pytest.raises(ModuleNotFoundError, match=f"No module named '{re.escape(old)}'"):
            importlib.import_module(old)


# a module or function over the bar carries its reason on the line above it
_REASON = "# Long on purpose:"


def test_no_library_module_over_500_lines_nor_function_over_80_without_a_reason():
    too_long = []
    for path in sorted([*(ROOT / "edge_sdk").rglob("*.py"), *(ROOT / "server_kit").rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        where = str(path.relative_to(ROOT))
        if len(lines) > 500 and not any(line.startswith(_REASON) for line in lines[:5]):
            too_long.append(f"{where}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                size = node.end_lineno - node.lineno + 1
                if size > 80 and not lines[first - 2].strip().startswith(_REASON):
                    too_long.append(f"{where}:{node.name}: {size} lines")
    assert too_long == []


def _architecture() -> str:
    return (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")


def test_the_rooms_of_architecture_name_every_module_and_only_modules_that_exist():
    """ARCHITECTURE's rooms list every module of both packages (``__init__.py`` aside), each where it is."""
    block = _architecture().split("## The rooms", 1)[1].split("```", 2)[1]
    listed: set[str] = set()
    missing = []
    pkg, sub = None, ""
    for line in block.splitlines():
        top = re.match(r"^(edge_sdk|server_kit)/\s*$", line)
        if top:
            pkg, sub = top.group(1), ""
            continue
        room = re.match(r"^  (\w+)/\s", line)
        if room:
            sub = room.group(1) + "/"
        elif re.match(r"^  \S", line):
            sub = ""
        for name in re.findall(r"(?<![\w/])([\w*]+\.py)\b", line):
            hits = sorted((ROOT / pkg / sub).glob(name)) if pkg else []
            if not hits:
                missing.append(f"{pkg}/{sub}{name}")
            listed.update(h.relative_to(ROOT).as_posix() for h in hits)
    modules = {p.relative_to(ROOT).as_posix() for pk in ("edge_sdk", "server_kit") for p in (ROOT / pk).rglob("*.py")
               if p.name not in ("__init__.py", "_version.py")}
    assert missing == []
    assert sorted(modules - listed) == []


def test_every_path_and_name_the_architecture_tables_give_exists():
    """Each `path` and `path: name` of ARCHITECTURE (before its worked example) names a file, and a name in it."""
    text = _architecture().split("## How to add a strategy", 1)[0]
    refs = re.findall(r"`((?:edge_sdk|server_kit|ext|benchmarks|tests|deploy|examples)/[\w/.\-]*)(?::\s*([\w.]+))?`",
                      text)
    assert len(refs) > 100
    wrong = []
    for path, name in refs:
        where = ROOT / path
        if not where.exists():
            wrong.append(f"{path}: no such file")
        elif name and where.suffix == ".py" and name not in _defined(where):
            wrong.append(f"{path}: defines no {name}")
    assert wrong == []


def _defined(path: Path) -> set[str]:
    """The functions, classes, methods (``Class.method``) and assigned names a module defines."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            if isinstance(node, ast.ClassDef):
                out.update(f"{node.name}.{n.name}" for n in node.body
                           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out
