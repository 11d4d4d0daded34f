"""The `marsrl` console command and the benchmark script, run as a user would."""
import json
import subprocess
import sys
from pathlib import Path

import megatron_marsrl

ROOT = Path(__file__).resolve().parents[1]


def _marsrl(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_version_and_help():
    code, out = _marsrl("--version")
    assert code == 0 and megatron_marsrl.__version__ in out
    code, out = _marsrl("--help")
    assert code == 0
    for sub in ("selfcheck", "convert", "bench", "solve", "eval"):
        assert sub in out


def test_subcommand_help_lists_its_own_options():
    code, out = _marsrl("convert", "hf-to-mcore", "--help")
    assert code == 0 and "--input" in out and "--etp" in out


def test_unknown_subcommand_is_an_error():
    code, out = _marsrl("frobnicate")
    assert code == 2 and "invalid choice" in out


def test_bench_convert_prints_and_records_figures(tmp_path):
    out_json = tmp_path / "bench.json"
    code, out = _marsrl("bench", "convert", "--size-mb", 40, "--repeats", 1, "--json", out_json)
    assert code == 0, out
    result = json.loads(out_json.read_text())
    assert result["bytes"] > 20e6
    assert set(result["phases"]) == {"raw", "load", "export", "save"}
    for row in result["phases"].values():
        assert row["seconds"] > 0 and row["gb_per_s"] > 0
    assert "x raw" in out


def test_selfcheck_main_job_passes(tmp_path):
    code, out = _marsrl("selfcheck", "--out", tmp_path / "selfcheck")
    assert code == 0, out[-3000:]
    assert "bit-exact: True" in out and "PASSED" in out
    assert (tmp_path / "selfcheck" / "mcore" / "marsrl_checkpoint.json").is_file()
