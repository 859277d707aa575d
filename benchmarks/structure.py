"""How the code is put together, counted: the figures a refactoring of the training round is judged by.

Reads the source (nothing is run) and prints, against the goals:

- the project modules the MQTT orchestrator imports (goal: at most 12);
- the public methods of ``Strategy`` (goal: at most 12);
- the tests of compression (``.enabled``) outside the codec modules
  (``edge_sdk/compress/``, ``server_kit/downstream.py``; goal: 0);
- the definitions of decompression (``base + delta`` in float32), of update
  admission (``duplicate-update`` raised) and of the sample cap (goal: 1 each);
- the modules over 500 lines.

Usage::

    .venv/bin/python benchmarks/structure.py

The last line is one JSON object of the figures.
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
    print(f"orchestrator imports {len(orch)} project modules (goal <= 12)")
    print(f"Strategy has {len(methods)} public methods (goal <= 12): {', '.join(methods)}")
    print(f".enabled outside the codec modules: {sum(enabled.values())} in {len(enabled)} modules (goal 0)"
          + "".join(f"\n  {p}: {n}" for p, n in sorted(enabled.items())))
    print(f"decompression defined in {len(decompress)} place(s): {', '.join(decompress)}")
    print(f"update admission defined in {len(admission)} place(s): {', '.join(admission)}")
    print(f"sample cap defined in {len(caps)} place(s): {', '.join(caps)}")
    print(f"modules over 500 lines: {len(long)}" + "".join(f"\n  {p}: {n}" for p, n in sorted(long.items())))
    print(json.dumps({"orchestrator_imports": len(orch), "strategy_public_methods": len(methods),
                      "enabled_tests": sum(enabled.values()), "enabled_modules": len(enabled),
                      "decompressions": len(decompress), "admissions": len(admission), "sample_caps": len(caps),
                      "modules_over_500": len(long)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
