"""The Dockerfile, checked without Docker: NGC base pinned through an ARG, every ARG used in its
scope, version ARGs equal to requirements/gpu.txt (and to the CPU pins they share), entry point
``marsrl``, and the SGLang dependency filter it runs, applied to this machine's SGLang metadata."""
import importlib.metadata
import json
import re
from pathlib import Path

import pytest

from tests.test_environment import normalized, pins as _pins

ROOT = Path(__file__).resolve().parents[1]
IMAGE_TORCH = "2.14.0a0"
"""torch of the NGC base image (26.09: 2.14.0a0+...nv26.09)."""


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """Instructions as (KEYWORD, arguments): continuation lines joined, comments and parser
    directives dropped, each heredoc body appended (after a newline) to its instruction."""
    lines, out = iter(text.splitlines()), []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            nxt = next(lines)
            if not nxt.lstrip().startswith("#"):
                line = line[:-1] + " " + nxt.strip()
        for tag in re.findall(r"<<-?[\"']?(\w+)[\"']?", line):
            body = []
            for body_line in lines:
                if body_line.strip() == tag:
                    break
                body.append(body_line)
            line += "\n" + "\n".join(body)
        keyword, _, args = line.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def _instructions():
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def _args(instructions) -> dict[str, tuple[int, str]]:
    """ARG name -> (index of the instruction, default)."""
    out = {}
    for i, (kw, args) in enumerate(instructions):
        if kw == "ARG":
            name, _, default = args.partition("=")
            assert name not in out, f"ARG {name} declared twice"
            out[name] = (i, default)
    return out


def _version_args_by_package(instructions) -> dict[str, str]:
    """Package -> the ARG its pin uses, from every `name[extras]==${ARG}` in the file."""
    text = "\n".join(args for _, args in instructions)
    found = re.findall(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==\$\{(\w+)\}", text)
    return {normalized(name): arg for name, arg in found}


def test_base_is_ngc_pytorch_pinned_through_an_arg():
    instructions = _instructions()
    froms = [(i, args) for i, (kw, args) in enumerate(instructions) if kw == "FROM"]
    assert len(froms) == 1, "one build stage expected"
    index, image = froms[0]
    match = re.fullmatch(r"nvcr\.io/nvidia/pytorch:\$\{(\w+)\}", image)
    assert match, f"FROM {image}: expected nvcr.io/nvidia/pytorch:${{ARG}}"
    line, tag = _args(instructions)[match.group(1)]
    assert line < index, "the tag ARG must be declared before FROM"
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", tag), f"NGC tag {tag!r} is not a pinned YY.MM-py3 release"
    assert "latest" not in (ROOT / "Dockerfile").read_text().lower()


def test_every_arg_is_used_in_its_scope():
    instructions = _instructions()
    first_from = next(i for i, (kw, _) in enumerate(instructions) if kw == "FROM")
    for name, (line, _) in _args(instructions).items():
        # An ARG declared before FROM is visible only to FROM; one after it, to what follows.
        scope = [instructions[first_from]] if line < first_from else instructions[line + 1:]
        assert any(re.search(rf"\$\{{?{name}\b", args) for _, args in scope), f"ARG {name} is never used"


def test_entrypoint_is_the_marsrl_console_script():
    instructions = _instructions()
    entry = [args for kw, args in instructions if kw == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["marsrl"]
    assert "marsrl = megatron_marsrl.cli:main" in (ROOT / "setup.py").read_text()
    assert any(kw == "RUN" and "pip install ." in args for kw, args in instructions)


def test_version_args_equal_requirements_gpu():
    instructions = _instructions()
    defaults = {name: default for name, (_, default) in _args(instructions).items()}
    by_package = _version_args_by_package(instructions)
    gpu = _pins(ROOT / "requirements" / "gpu.txt")
    assert set(by_package) == set(gpu), "packages pinned in the Dockerfile and in requirements/gpu.txt differ"
    for package, arg in by_package.items():
        assert defaults.get(arg) == gpu[package], f"{package}: ARG {arg}={defaults.get(arg)} vs gpu.txt {gpu[package]}"
    version_args = {name for name in defaults if name.endswith("_VERSION")}
    assert version_args == set(by_package.values()), "a version ARG pins no package"


def test_gpu_pins_agree_with_the_cpu_pins_they_share():
    gpu = _pins(ROOT / "requirements" / "gpu.txt")
    cpu = {**_pins(ROOT / "requirements" / "cpu.txt"), **_pins(ROOT / "requirements" / "megatron.txt")}
    shared = set(gpu) & set(cpu)
    assert {"sglang", "megatron-core", "transformers", "math-verify", "tensorboard"} <= shared
    assert {p: (gpu[p], cpu[p]) for p in shared if gpu[p] != cpu[p]} == {}


def _sglang_filter_script() -> str:
    run = next(args for kw, args in _instructions() if kw == "RUN" and "<<'PY'" in args)
    return run.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]


def test_sglang_dependency_filter_keeps_the_image_torch(tmp_path):
    """Runs the Dockerfile's filter on this machine's sglang metadata (same pinned version):
    no torch-family requirement is installed with dependencies, and nothing installed with
    dependencies requires a torch the image's 2.14.0a0 does not satisfy."""
    from packaging.requirements import Requirement

    try:
        sglang_version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed here")
    assert sglang_version == _pins(ROOT / "requirements" / "gpu.txt")["sglang"]
    exec(_sglang_filter_script().replace("/tmp/", f"{tmp_path}/"), {})  # noqa: S102 - our own file
    deps = [Requirement(line) for line in (tmp_path / "sglang-deps.txt").read_text().splitlines()]
    nodeps = [Requirement(line) for line in (tmp_path / "sglang-nodeps.txt").read_text().splitlines()]
    assert not {"torch", "torchvision", "torchaudio"} & {r.name.lower() for r in deps}
    assert sorted(r.name for r in nodeps) == ["sgl-deep-ep", "sgl-flash-mla", "sglang-kernel"]
    assert "transformers==5.19.0" in {str(r) for r in deps}
    for req in deps:
        try:
            requires = [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
        except importlib.metadata.PackageNotFoundError:
            continue  # a platform-specific requirement not installed on this machine
        bad = [str(r) for r in requires if r.name == "torch" and (r.marker is None or r.marker.evaluate({"extra": ""}))
               and not r.specifier.contains(IMAGE_TORCH, prereleases=True)]
        assert not bad, f"{req.name} requires {bad}: install it with --no-deps in the Dockerfile"
