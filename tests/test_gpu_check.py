"""The GPU check for the lent machine (scripts/gpu_check.sh, gpu_carry.sh, gpu_calibrate.py),
tested on CPU for everything that does not need the GPU: syntax, arguments, the stage budgets
against the 560-second limit, the carry against 64 MiB and the project's pins, the fail-fast exit
without a GPU, the calibration's planner side, the LOCAL_RANK device choice, and the CPU
reference comparison of megatron.verify."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu_check.sh"
CARRY = ROOT / "scripts" / "gpu_carry.sh"
CALIBRATE = ROOT / "scripts" / "gpu_calibrate.py"
BASH = shutil.which("bash")
LIMIT_S = 560
CARRY_LIMIT = 64 << 20


def _check(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([BASH, str(CHECK), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**base, **(env or {})}, timeout=timeout)


def _plan(*args: str, env: dict | None = None) -> tuple[list[tuple[str, int]], dict[str, str], str]:
    proc = _check("--plan", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    stages = [(m[1], int(m[2])) for m in re.finditer(r"^stage (\w+) +budget +(\d+) s$", proc.stdout, re.M)]
    fields = dict(re.findall(r"^(out|wheels): (.*)$", proc.stdout, re.M))
    return stages, fields, proc.stdout


@pytest.mark.parametrize("script", [CHECK, CARRY])
def test_scripts_parse(script):
    assert subprocess.run([BASH, "-n", str(script)], capture_output=True).returncode == 0


def test_stage_budgets_fit_the_time_limit():
    stages, _, text = _plan()
    assert [name for name, _ in stages] == ["setup", "parity", "rl", "calibrate", "timeshare"]
    grace = int(re.search(r"including (\d+) s kill grace", text)[1])
    total = int(re.search(r"^total (\d+) s", text, re.M)[1])
    assert total == sum(budget + grace for _, budget in stages)
    assert total < LIMIT_S
    only, _, _ = _plan("--only", "rl")
    assert [name for name, _ in only] == ["setup", "rl"]


def test_out_and_wheels_defaults_and_overrides(tmp_path):
    assert _plan()[1] == {"out": "gpu_check_out", "wheels": "gpu_wheels"}
    assert _plan(env={"OUT": str(tmp_path)})[1]["out"] == str(tmp_path)
    assert _plan("--out", "elsewhere", "--wheels", "w", env={"OUT": str(tmp_path)})[1] == {"out": "elsewhere",
                                                                                          "wheels": "w"}


@pytest.mark.parametrize("args, message", [(["--bogus"], "unknown argument '--bogus'"),
                                           (["--only", "parity,nope"], "unknown stage 'nope'"),
                                           (["--out"], "usage:")])
def test_bad_arguments_are_refused(args, message):
    proc = _check(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def _bin_with(tmp_path: Path, *tools: str) -> str:
    """A PATH directory holding only these tools (so nvidia-smi is absent unless faked)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def test_no_gpu_fails_fast_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _check("--out", str(out), env={"PATH": _bin_with(tmp_path, "dirname")})
    assert proc.returncode == 3
    assert "no CUDA GPU: nvidia-smi not found" in proc.stderr
    assert time.monotonic() - start < 10
    assert not out.exists()


def test_nvidia_smi_without_cuda_torch_fails_fast(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = _bin_with(tmp_path, "dirname", "grep")
    fake = Path(path) / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = _check("--out", str(out), env={"PATH": path, "PYTHON": sys.executable})
    assert proc.returncode == 3
    assert "no CUDA GPU" in proc.stderr and "torch sees no CUDA device" in proc.stderr
    assert not out.exists()


def _carry_pins() -> dict[str, str]:
    proc = subprocess.run([BASH, str(CARRY), "--list"], capture_output=True, text=True, check=True)
    return dict(line.split("==") for line in proc.stdout.split())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def test_carry_pins_agree_with_the_requirements():
    pins = _carry_pins()
    assert {"megatron-core", "math-verify", "tensorboard", "psutil"} <= set(pins)
    project = {}
    for req in ("cpu.txt", "megatron.txt", "gpu.txt"):
        for line in (ROOT / "requirements" / req).read_text().splitlines():
            if m := re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)$", line.strip()):
                project[_norm(m[1])] = m[2]
    for name, version in pins.items():
        assert project.get(_norm(name), version) == version, f"{name}=={version} vs requirements {project[_norm(name)]}"


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        return False
    return True


def test_carry_builds_and_fits(tmp_path):
    if not _pypi_reachable():
        pytest.skip("PyPI not reachable: the carry is built where there is network")
    dest = tmp_path / "gpu_wheels"
    proc = subprocess.run([BASH, str(CARRY)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GPU_WHEELS": str(dest)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = sorted(dest.glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) < CARRY_LIMIT
    got = {_norm(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
    assert got == {_norm(n): v for n, v in _carry_pins().items()}
    for w in wheels:  # Python 3.12 on x86_64 Linux: pure, abi3 or cp312 wheels only
        python_tag, abi_tag, platform_tag = w.stem.split("-")[-3:]
        assert python_tag in ("py3", "cp312", "cp36", "cp38", "cp39") and abi_tag in ("none", "abi3", "cp312"), w.name
        assert platform_tag == "any" or "x86_64" in platform_tag, w.name
    assert not (tmp_path / "gpu_wheels.partial").exists()


def test_calibration_estimate_runs_on_cpu(tmp_path):
    out = tmp_path / "estimate.json"
    proc = subprocess.run([sys.executable, str(CALIBRATE), "--estimate-only", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    est, batch = record["estimate"], record["micro_batch"]
    assert batch["micro_batch_tokens"] == batch["sequences"] * batch["tokens_per_sequence"]

    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.memory import count_params

    # World size 1, bf16: every parameter on this GPU, 2 B each, fp32 gradients (4 B), and
    # Adam's fp32 main parameters and moments (12 B).
    params = count_params(ModelArch.from_hf_dict(record["shape"])).total
    assert est["params_gib"] == pytest.approx(params * 2 / 2**30, rel=1e-3)
    assert est["grads_gib"] == pytest.approx(2 * est["params_gib"])
    assert est["optimizer_gib"] == pytest.approx(6 * est["params_gib"])
    assert est["state_gib"] == pytest.approx(est["params_gib"] + est["grads_gib"] + est["optimizer_gib"])
    assert min(est["activations_gib"], est["logits_gib"], est["buffers_gib"]) > 0
    assert est["train_gib"] == pytest.approx(est["allocated_peak_gib"] + est["framework_gib"])
    assert 0 < record["local_attention_scores_gib"] < est["transient_gib"]


def test_calibration_refuses_to_measure_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, str(CALIBRATE)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr


def test_local_rank_picks_the_cuda_device(monkeypatch):
    import torch

    from megatron_marsrl.megatron.parallel import LayoutError, local_cuda_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU, as on the lent machine
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_cuda_device() == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert local_cuda_device() == 0
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(LayoutError, match="LOCAL_RANK=1 but this node has 1 visible CUDA device"):
        local_cuda_device()


@pytest.mark.slow
def test_verify_compares_against_a_cpu_reference(tmp_path):
    """The entry point the GPU check runs, here with Megatron on CPU: one launched rank, both
    dtypes, transformers fp32 on CPU as the reference."""
    out = tmp_path / "parity.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl.megatron.verify", "--families", "qwen3_moe",
                           "--dtypes", "float32,bfloat16", "--out", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    fp32, bf16 = json.loads(out.read_text())
    for record in (fp32, bf16):
        assert record["passed"] and record["reference"] == "transformers fp32 on cpu"
        assert record["device"] == "cpu" and record["layer_spec"] == "local"
        assert record["export_seen"] == record["hf_total"] and not record["export_mismatched"]
    assert fp32["logit_diff"] < 1e-4 < bf16["logit_diff"] < bf16["tolerance"]
