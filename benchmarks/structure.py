"""How the code is put together, counted: the figures a refactoring of the training round is judged by.

Reads the source (nothing is run) and prints, against the goals:

- the project modules the MQTT orchestrator imports (goal: at most 12);
- the public methods of ``Strategy`` (goal: at most 12);
- the tests of compression (``.enabled``) outside the codec modules
  (``edge_sdk/compress/``, ``server_kit/downstream.py``; goal: 0);
- the definitions of decompression (``base + delta`` in float32), of update
  admission (``duplicate-update`` raised) and of the sample cap (goal: 1 each);
- the modules over 500 lines (goal: 0);
- the modules side by side at the root of ``edge_sdk/`` (goal: at most 20);
- the functions that pass a string-keyed result dict (``-> dict[str, Any]``)
  to another module (goal: 0), the documents (a JSON record, a message's
  fields, settings) listed apart with what each is;
- the device: the attributes ``EdgeClient.__init__`` sets, the dispatches by
  method name (``getattr(self, ...)``) and the command handlers registered
  by ``Op``.

Usage::

    .venv/bin/python benchmarks/structure.py

The last line is one JSON object of the figures. The exit status is 1 when a
goal of the round's home slips (the orchestrator's imports, ``.enabled``
outside the codec, a module over 500 lines, the root of ``edge_sdk/``):
``make test`` runs it.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edge_sdk", "server_kit")
CODEC_MODULES = ("edge_sdk/compress/", "server_kit/downstream.py")
#: The goals ``make test`` holds (the exit status is 1 when one slips).
GOALS = {"orchestrator_imports": 12, "enabled_tests": 0, "modules_over_500": 0, "edge_sdk_root_modules": 20}
#: Functions returning ``dict[str, Any]`` that build a document, not a result: what each one is.
DOCUMENTS = {
    "sketch_privacy": "results.json's privacy.sketch record", "privacy_record": "results.json's privacy record",
    "privacy": "results.json's privacy record (a run so far)",
    "build": "a command's fields (the wire)", "parse": "a command's fields read back (the wire)",
    "check_meta": "a message's meta, checked (the wire)", "check_fields": "a message's fields, checked (the wire)",
    "hello_fields": "a hello's fields (the wire)", "sketch_request": "a sketch command's fields (the wire)",
    "read_hello": "a Flower hello record (the wire)", "read_sketch_request": "a Flower record (the wire)",
    "connect_kwargs": "paho's CONNECT options", "parse_params": "--set key=value settings",
    "pretrain_config": "the pre-training's settings table", "sample_params": "an estimator's parameters",
    "child_params": "an estimator's parameters", "orchestrator_args": "an Orchestrator's keyword arguments",
    "classifier_io": "a model.json record (a file)", "read_manifest": "a JSON file read",
    "read_models_json": "a JSON file read", "load_truth": "a JSON file read",
    "clustering_against_truth": "results.json's clustering record", "report": "the Flower run's JSON report",
    "predict": "fedsketch predict's JSON output", "info": "fedsketch info's JSON output",
    "summarize": "a partition's JSON summary", "tally_clients": "a partition's JSON summary",
    "monitor": "a NATS monitoring endpoint's JSON", "snapshot": "an emulated fleet's JSON counters",
    "close": "an emulated fleet's JSON counters", "stats": "a transport's JSON counters",
    "chunk_stats": "a transport's JSON counters", "run_round": "the pre-training's history record",
    "get_params": "an estimator's parameters (scikit-learn)", "build_results": "results.json, whole",
    "hello": "a hello's fields (the wire)", "run": "the Flower run's JSON report",
}
SERIALISERS = ("to_dict", "as_dict", "to_wire", "to_meta", "command_meta", "base_meta", "state", "summary")


def sources() -> dict[str, str]:
    """Every module of the two packages: path relative to the root -> text."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            out[p.relative_to(ROOT).as_posix()] = p.read_text()
    return out


def project_imports(path: str, text: str) -> set[str]:
    """The project modules ``path`` imports (absolute names), relative imports resolved."""
    package = path.rsplit("/", 1)[0].replace("/", ".")
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] in PACKAGES:
                names.add(mod)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
    return names


def public_methods(text: str, cls: str) -> list[str]:
    """The public methods and properties of class ``cls`` defined in ``text``."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return sorted(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and not n.name.startswith("_"))
    raise SystemExit(f"class {cls} not found")


def dict_results(src: dict[str, str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Public functions returning ``dict[str, Any]`` called from another module: results, and documents."""
    defined: dict[str, list[str]] = {}
    for path, text in src.items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.FunctionDef) and node.returns is not None and not node.name.startswith("_")
                    and node.name not in SERIALISERS
                    and re.fullmatch(r"(dict|Mapping)\[str, Any\]( \| None)?", ast.unparse(node.returns))):
                defined.setdefault(node.name, []).append(path)
    results, documents = {}, {}
    for name, where in sorted(defined.items()):
        callers = [p for p, t in src.items() if p not in where and re.search(rf"\b{name}\(", t)]
        if not callers:
            continue
        if name in DOCUMENTS:
            documents[name] = DOCUMENTS[name]
        else:
            results[name] = where
    return results, documents


def device(src: dict[str, str]) -> tuple[int, int, int]:
    """Attributes ``EdgeClient.__init__`` sets, dispatches by method name in the device, handlers by ``Op``."""
    init_attrs = 0
    for node in ast.walk(ast.parse(src["edge_sdk/client/edge_client.py"])):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            init_attrs = len({ast.unparse(t) for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                              if ast.unparse(t).startswith("self.")})
    device_src = [t for p, t in src.items() if p.startswith("edge_sdk/client")]
    by_name = sum(len(re.findall(r"getattr\(self, ", t)) for t in device_src)
    handlers = sum(len(re.findall(r"@handles\(Op\.", t)) for t in device_src)
    return init_attrs, by_name, handlers


def main() -> int:
    src = sources()
    orch = project_imports("server_kit/drivers/orchestrator.py", src["server_kit/drivers/orchestrator.py"])
    methods = public_methods(src["server_kit/strategies/base.py"], "Strategy")
    enabled = {p: len(re.findall(r"\.enabled\b", t)) for p, t in src.items()
               if not p.startswith(CODEC_MODULES) and re.search(r"\.enabled\b", t)}
    decompress = [p for p, t in src.items() if re.search(r"np\.add\(\w+\[n\], [\w.]+\[n\], dtype=np\.float32\)", t)]
    admission = [p for p, t in src.items() if 'ProtocolError("duplicate-update"' in t]
    caps = [p for p, t in src.items() if re.search(r"capped at the %d it registered", t)]
    long = {p: t.count("\n") for p, t in src.items() if t.count("\n") > 500}
    root = sorted(p for p in src if p.count("/") == 1 and p.startswith("edge_sdk/") and not p.endswith("__init__.py"))
    print(f"orchestrator imports {len(orch)} project modules (goal <= 12)")
    print(f"Strategy has {len(methods)} public methods (goal <= 12): {', '.join(methods)}")
    print(f".enabled outside the codec modules: {sum(enabled.values())} in {len(enabled)} modules (goal 0)"
          + "".join(f"\n  {p}: {n}" for p, n in sorted(enabled.items())))
    print(f"decompression defined in {len(decompress)} place(s): {', '.join(decompress)}")
    print(f"update admission defined in {len(admission)} place(s): {', '.join(admission)}")
    print(f"sample cap defined in {len(caps)} place(s): {', '.join(caps)}")
    print(f"modules over 500 lines: {len(long)}" + "".join(f"\n  {p}: {n}" for p, n in sorted(long.items())))
    print(f"modules at the root of edge_sdk/: {len(root)} (goal <= 20)")
    results, documents = dict_results(src)
    print(f"string-keyed result dicts passed between modules: {len(results)} (goal 0)"
          + "".join(f"\n  {n}: {', '.join(w)}" for n, w in results.items()))
    print(f"  documents apart ({len(documents)}): " + "; ".join(f"{n} ({why})" for n, why in documents.items()))
    init_attrs, by_name, handlers = device(src)
    print(f"device: EdgeClient.__init__ sets {init_attrs} attributes; {by_name} dispatches by method name; "
          f"{handlers} command handlers registered by Op")
    figures = {"orchestrator_imports": len(orch), "strategy_public_methods": len(methods),
               "enabled_tests": sum(enabled.values()), "enabled_modules": len(enabled),
               "decompressions": len(decompress), "admissions": len(admission), "sample_caps": len(caps),
               "modules_over_500": len(long), "edge_sdk_root_modules": len(root), "dict_results": len(results),
               "documents": len(documents), "client_init_attributes": init_attrs, "dispatch_by_name": by_name,
               "handlers_by_op": handlers}
    slipped = {k: figures[k] for k, most in GOALS.items() if figures[k] > most}
    if slipped:
        print("goals slipped: " + ", ".join(f"{k} {v} (goal <= {GOALS[k]})" for k, v in slipped.items()),
              file=sys.stderr)
    print(json.dumps({**figures, "slipped": sorted(slipped)}))
    return 1 if slipped else 0


if __name__ == "__main__":
    sys.exit(main())
