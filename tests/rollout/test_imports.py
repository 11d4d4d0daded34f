"""The rollout package never imports Megatron (STYLE.md: rollout code and the trainer share
plain records only): importing every module loads neither megatron.core nor our Megatron
side, and no import statement in it, deferred ones included, names them."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import megatron_marsrl.rollout as rollout

FORBIDDEN = ("megatron.", "megatron_marsrl.megatron", "megatron_marsrl.rl")


def _forbidden(name: str) -> bool:
    return name == "megatron" or any(name.startswith(p) for p in FORBIDDEN)


def test_importing_every_rollout_module_loads_no_megatron():
    code = """
import json, pkgutil, importlib, sys
import megatron_marsrl.rollout as rollout
names = [m.name for m in pkgutil.walk_packages(rollout.__path__, "megatron_marsrl.rollout.")]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m == "megatron" or m.startswith(("megatron.", "megatron_marsrl.megatron",
                                                                              "megatron_marsrl.rl")))
print(json.dumps({"modules": names, "loaded": loaded}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert "megatron_marsrl.rollout.weight_sync" in report["modules"]  # the walk saw the package
    assert len(report["modules"]) >= 10
    assert report["loaded"] == []


def test_no_rollout_source_names_megatron_in_an_import():
    offenders = []
    for path in sorted(Path(rollout.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if _forbidden(n)]
    assert offenders == []
