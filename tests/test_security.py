"""What a tampered file, a careless flag or an exposed port can and cannot do: nothing from disk
or the network is unpickled, `--force` deletes only our own outputs, SGLang servers off
loopback need an API key, checkpoint loads are strict, temporary directories go away and a
reused run directory never mixes two runs' metrics."""
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_marsrl import outputs

ROOT = Path(__file__).resolve().parents[1]


def _marsrl(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _foreign(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "precious.txt").write_text("keep me")
    return path


# ---- --force and the output marker ----------------------------------------------------------
def test_force_never_deletes_a_foreign_directory(tiny_hf, tmp_path):
    out = _foreign(tmp_path / "theirs")
    code, log = _marsrl("convert", "hf-to-mcore", "--input", tiny_hf("llama"), "--output", out, "--force")
    assert code == 2 and "was not written by marsrl" in log and outputs.MARKER in log
    assert (out / "precious.txt").read_text() == "keep me"


def test_selfcheck_refuses_a_foreign_working_directory(tmp_path):
    out = _foreign(tmp_path / "theirs")
    code, log = _marsrl("selfcheck", "--out", out)
    assert code == 2 and "was not written by marsrl" in log
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_our_own_output_is_replaced_and_a_foreign_one_survives(tmp_path):
    from megatron_marsrl.megatron.hf_checkpoint import _finish_hf_dir

    def staged(text):
        tmp = tmp_path / f".staged-{text}"
        tmp.mkdir()
        (tmp / "model-00001-of-00001.safetensors").write_text(text)
        return tmp

    ours = tmp_path / "hf"
    _finish_hf_dir(staged("first"), ours, ["model-00001-of-00001.safetensors"], {}, {"a": 1}, None)
    assert outputs.is_ours(ours) and (ours / "model.safetensors").read_text() == "first"
    outputs.check_replaceable(ours, force=True)
    with pytest.raises(FileExistsError, match="pass --force"):
        outputs.check_replaceable(ours, force=False)
    _finish_hf_dir(staged("second"), ours, ["model-00001-of-00001.safetensors"], {}, {"a": 1}, None)
    assert (ours / "model.safetensors").read_text() == "second"

    theirs = _foreign(tmp_path / "theirs")
    with pytest.raises(FileExistsError, match="was not written by marsrl"):
        _finish_hf_dir(staged("third"), theirs, ["model-00001-of-00001.safetensors"], {}, {"a": 1}, None)
    assert sorted(p.name for p in theirs.iterdir()) == ["precious.txt"]


def test_protected_paths_are_never_replaced(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    outputs.check_replaceable(empty, force=False)  # an empty directory is fine
    outputs.check_replaceable(tmp_path / "new", force=False)
    monkeypatch.chdir(empty)
    outputs.mark(empty, "test")
    for path in (Path("/"), Path.home(), empty, Path("."), tmp_path):  # /, home, cwd, a parent of cwd
        with pytest.raises(FileExistsError):
            outputs.check_replaceable(path, force=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        outputs.check_replaceable(tmp_path / "file", force=True)


# ---- API key of SGLang servers ------------------------------------------------------------------
def test_non_loopback_engine_host_needs_an_api_key(monkeypatch, tiny_hf):
    from megatron_marsrl.rollout.factory import RolloutEngineConfig
    from megatron_marsrl.net import is_loopback
    from megatron_marsrl.rollout.sglang_server import API_KEY_ENV, SGLangServerConfig

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("node7")
    RolloutEngineConfig(kind="sglang_server", host="127.0.0.1")
    for host in ("0.0.0.0", "10.1.2.3", "node7"):
        with pytest.raises(ValueError, match=API_KEY_ENV):
            RolloutEngineConfig(kind="sglang_server", host=host)
        with pytest.raises(ValueError, match="api_key"):
            SGLangServerConfig(model_path=tiny_hf("qwen3"), host=host)
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    RolloutEngineConfig(kind="sglang_server", host="0.0.0.0")
    assert "s3cret" not in repr(SGLangServerConfig(model_path=tiny_hf("qwen3"), host="0.0.0.0", api_key="s3cret"))


def test_every_request_carries_the_api_key(tiny_hf, monkeypatch):
    import torch

    from megatron_marsrl.rollout.sglang_server import SGLangServer, SGLangServerConfig

    monkeypatch.setattr(torch.multiprocessing, "set_sharing_strategy", lambda strategy: None)  # no global change

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            seen.append((self.path, self.headers.get("Authorization")))
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        server = SGLangServer(SGLangServerConfig(model_path=tiny_hf("qwen3"), api_key="s3cret"))
        server.url = f"http://127.0.0.1:{http.server_address[1]}"
        assert server.healthy(timeout=5)
        server.update_weights([], version=1)  # pause, begin, end, flush_cache, continue
        server.abort_all()
    finally:
        http.shutdown()
    paths = [p for p, _ in seen]
    assert paths[:2] == ["/health_generate", "/pause_generation"] and "/flush_cache" in paths and "/abort_request" in paths
    assert {auth for _, auth in seen} == {"Bearer s3cret"}


# ---- RNG state: no pickle ---------------------------------------------------------------------
def test_rng_state_round_trips_without_pickle(tmp_path):
    import random

    import numpy as np
    import torch

    from megatron_marsrl.rl import checkpoint

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # cached Gaussians are part of the state
    checkpoint.save_rng(tmp_path / checkpoint.RNG_FILE)
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.load_rng(tmp_path)
    assert (random.random(), random.gauss(0, 1), np.random.standard_normal(), torch.rand(3).tolist()) == expected


class _Payload:
    """Unpickling this creates a file: what a tampered rng.pt could do with weights_only=False."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_legacy_rng_file_loads_safely_and_a_tampered_one_runs_nothing(tmp_path):
    import random

    import numpy as np
    import torch

    from megatron_marsrl.rl import checkpoint

    random.seed(5), np.random.seed(5)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp_path / checkpoint.LEGACY_RNG_FILE)  # what older checkpoints hold
    expected = (random.random(), np.random.random())
    random.seed(0), np.random.seed(0)
    checkpoint.load_rng(tmp_path)
    assert (random.random(), np.random.random()) == expected

    pwned = tmp_path / "pwned"
    torch.save({"python": _Payload(str(pwned))}, tmp_path / checkpoint.LEGACY_RNG_FILE)
    with pytest.raises(ValueError, match="cannot be read safely"):
        checkpoint.load_rng(tmp_path)
    assert not pwned.exists()


_PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib"}


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """Calls in ``source`` that can run code from the bytes they read: pickle-family loads and
    Unpicklers, torch.load without weights_only=True, numpy load with allow_pickle=True, yaml
    loads that are not safe ones, and any weights_only=False."""
    import ast

    def const(call, name):
        return next((k.value.value for k in call.keywords if k.arg == name and isinstance(k.value, ast.Constant)), None)

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        where = f"{filename}:{node.lineno}"
        if owner in _PICKLERS and attr in ("load", "loads", "Unpickler"):
            found.append(f"{where}: {owner}.{attr}")
        elif owner == "torch" and attr == "load" and const(node, "weights_only") is not True:
            found.append(f"{where}: torch.load without weights_only=True")
        elif owner in ("np", "numpy") and attr == "load" and const(node, "allow_pickle") is True:
            found.append(f"{where}: numpy load with allow_pickle=True")
        elif owner == "yaml" and (attr in ("unsafe_load", "full_load", "load_all")
                                  or attr == "load" and "Safe" not in ast.unparse(node)):
            found.append(f"{where}: yaml.{attr}")
        if any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is False
               for k in node.keywords):
            found.append(f"{where}: weights_only=False")
    return found


def test_no_unsafe_loads_in_the_package():
    found = [hit for path in sorted((ROOT / "megatron_marsrl").rglob("*.py"))
             for hit in unsafe_loads(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "calls that can unpickle what they read:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "pickle.load(f)", "pickle.loads(b)", "cloudpickle.loads(b)", "pickle.Unpickler(f).load()",
    "torch.load(p)", "torch.load(p, map_location='cpu')", "torch.load(p, weights_only=False)",
    "np.load(p, allow_pickle=True)", "yaml.load(s, Loader=yaml.Loader)", "yaml.unsafe_load(s)",
    "x = f(weights_only=False)"])
def test_the_unsafe_load_scan_finds_each_kind(line):
    assert unsafe_loads(line), line


@pytest.mark.parametrize("line", ["torch.load(p, weights_only=True)", "np.load(p)", "yaml.safe_load(s)",
                                  "yaml.load(s, Loader=yaml.SafeLoader)", "json.load(f)"])
def test_the_unsafe_load_scan_passes_safe_loads(line):
    assert unsafe_loads(line) == [], line


# ---- strict checkpoint loading -----------------------------------------------------------------
def _save_model(hf_dir: str, ckpt: str) -> None:
    from megatron_marsrl.megatron.dist_checkpoint import save_checkpoint
    from megatron_marsrl.megatron.verify import build_from_hf

    _, _, model = build_from_hf(hf_dir, {})
    save_checkpoint(ckpt, model, meta={})


def _load_model(hf_dir: str, ckpt: str) -> str:
    from megatron_marsrl.megatron.dist_checkpoint import CheckpointMismatchError, load_checkpoint
    from megatron_marsrl.megatron.verify import build_from_hf

    _, _, model = build_from_hf(hf_dir, {})
    try:
        load_checkpoint(ckpt, model)
    except CheckpointMismatchError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
def test_a_missing_checkpoint_key_is_an_error_naming_it(tiny_hf, tmp_path):
    from megatron_marsrl.megatron.launch import launch

    launch("tests.test_security:_save_model", 1, {"hf_dir": tiny_hf("llama"), "ckpt": str(tmp_path / "llama")})
    # Qwen3 = Llama + q/k norms, same shapes otherwise: the norms are missing from the checkpoint.
    message = launch("tests.test_security:_load_model", 1,
                     {"hf_dir": tiny_hf("qwen3"), "ckpt": str(tmp_path / "llama")})[0]
    assert "missing from the checkpoint" in message and "q_layernorm" in message and "k_layernorm" in message
    assert outputs.is_ours(tmp_path / "llama")


# ---- temporary directories, reused run directories --------------------------------------------------
def test_launch_removes_its_temporary_directory(tmp_path, monkeypatch):
    from megatron_marsrl.megatron.launch import LaunchError, launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launch("json:dumps", 1, {"obj": [1, 2]}) == ["[1, 2]"]
    with pytest.raises(LaunchError):
        launch("json:loads", 1, {"s": "{not json"})
    assert list(tmp_path.iterdir()) == []


def test_a_reused_run_directory_starts_fresh_metrics(tmp_path):
    from megatron_marsrl.rl.observe import Observer

    run = tmp_path / "run"
    first = Observer(run, total_steps=3, start_step=0, progress=False)
    first.log(1, {"loss": 1.0})
    first.log(2, {"loss": 2.0})
    first.close()  # stopped before its first checkpoint; the same run directory is used again
    second = Observer(run, total_steps=3, start_step=0, progress=False)
    second.log(1, {"loss": 10.0})
    second.close()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "loss": 10.0}]
    assert len((run / "metrics.1.jsonl").read_text().splitlines()) == 2
    assert (run / "tensorboard.1").is_dir() and len(os.listdir(run / "tensorboard")) == 1


def test_wildcard_hosts_are_told_from_loopback_and_named_hosts():
    from megatron_marsrl.net import is_wildcard

    assert is_wildcard("0.0.0.0") and is_wildcard("::")
    assert not is_wildcard("127.0.0.1") and not is_wildcard("10.1.2.3") and not is_wildcard("node7")
