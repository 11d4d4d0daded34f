"""The CPU environment is reproducible: requirements/cpu.lock names every package scripts/env.sh
installs, agrees with the top-level pins, is part of the environment's key, and is what the
running environment holds."""
import importlib.metadata
import re
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "cpu.lock"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)$")


def normalized(name: str) -> str:
    """A package name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """Package -> version of every requirement line in a pins or lock file; anything that is not an
    exact pin is an error (a lock with a range in it locks nothing)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            match = PIN.match(line)
            assert match, f"{path.name}: {line!r} is not an exact pin"
            out[normalized(match.group(1))] = match.group(2)
    return out


def test_the_lock_holds_every_top_level_pin_at_its_version():
    lock, top = pins(LOCK), pins(ROOT / "requirements" / "cpu.txt")
    assert len(lock) > 3 * len(top)  # the dependencies are there too, not just the pins
    assert {name: lock.get(name) for name in top} == top, "rerun scripts/lock.sh after changing cpu.txt"


def test_the_lock_is_part_of_the_environment_key_and_what_env_sh_installs():
    env_sh = (ROOT / "scripts" / "env.sh").read_text()
    key_line = next(line for line in env_sh.splitlines() if line.startswith("key="))
    assert "requirements/cpu.lock" in key_line
    assert 'install -q -r "$root/requirements/cpu.lock"' in env_sh
    assert "pip\" check" in env_sh


def test_the_running_environment_is_the_lock():
    # the environment's own site-packages only: once setuptools is imported, sys.path also holds
    # its vendored packages (e.g. an older packaging's dist-info)
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {normalized(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    lock = pins(LOCK)
    differ = {name: (version, installed.get(name)) for name, version in lock.items() if installed.get(name) != version}
    assert not differ, f"lock vs installed (rebuild the environment with scripts/env.sh): {differ}"
    # nothing beyond the lock but what env.sh installs on its own: pip, megatron.txt, this package
    extra = set(installed) - set(lock) - {"pip", "megatron-marsrl"} - set(pins(ROOT / "requirements" / "megatron.txt"))
    assert not extra, f"installed but not in the lock: {sorted(extra)}"
    assert installed["pip"] == re.search(r"pip==(\S+)", (ROOT / "scripts" / "env.sh").read_text()).group(1)
