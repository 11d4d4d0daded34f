"""Command-line / YAML overrides of config dataclass trees: small local configs and the repo's own."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Literal

import pytest

from megatron_marsrl.agents.client import SamplingParams
from megatron_marsrl.agents.rollout import RolloutConfig
from megatron_marsrl.algorithms.losses import DMMPTConfig, PolicyLossConfig, TISConfig
from megatron_marsrl.megatron.optim import OptimConfig
from megatron_marsrl.megatron.parallel import LayoutError, ParallelConfig
from megatron_marsrl.rl.overrides import (OverrideError, apply_mapping, apply_overrides, apply_yaml,
                                          config_to_dict, load_yaml)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(kw_only=True)
class Inner:
    """A nested section with its own validation."""

    k: int = 1
    """Must be positive."""
    ratio: float = 0.5
    """Any float."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")


@dataclass(frozen=True, kw_only=True)
class Leaf:
    """A frozen section."""

    name: str = "x"
    """Any text."""


@dataclass(kw_only=True)
class Local:
    """One field of every supported kind."""

    n: int = 3
    lr: float = 1e-3
    flag: bool = False
    label: str = "a"
    maybe: int | None = None
    dims: tuple[int, ...] = (1, 2)
    words: list[str] = field(default_factory=list)
    pair: tuple[int, str] = (0, "")
    mode: Literal["fast", "slow"] = "fast"
    color: Color = Color.RED
    extra: dict = field(default_factory=lambda: {"depth": 2})
    inner: Inner = field(default_factory=lambda: Inner(k=5))
    opt: Inner | None = None
    leaf: Leaf = field(default_factory=Leaf)
    derived: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.derived = self.n * 2
        if self.flag and self.n > 10:
            raise ValueError("flag needs n <= 10")


@dataclass(kw_only=True)
class Repo:
    """The repo's real component configs under one root."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)


def test_scalars_sequences_and_literals_parse_by_type():
    c = apply_overrides(Local(), ["n=7", "lr=2e-5", "flag=yes", "label=hello world", "maybe=4",
                                  "dims=3,4,5", "words=[a, 'b,c']", "pair=9,z", "mode=slow", "color=blue"])
    assert (c.n, c.lr, c.flag, c.label, c.maybe) == (7, 2e-5, True, "hello world", 4)
    assert (c.dims, c.words, c.pair, c.mode, c.color) == ((3, 4, 5), ["a", "b,c"], (9, "z"), "slow", Color.BLUE)
    assert c.derived == 14  # __post_init__ ran again
    for text, value in [("true", True), ("1", True), ("On", True), ("false", False), ("0", False), ("no", False)]:
        assert apply_overrides(Local(), [f"flag={text}"]).flag is value
    assert apply_overrides(Local(maybe=3), ["maybe=null"]).maybe is None
    assert apply_overrides(Local(), ["label=none"]).label == "none"  # plain str: no None
    assert apply_overrides(Local(), ["dims="]).dims == ()
    assert apply_overrides(Local(), ["color=RED"]).color is Color.RED


def test_returns_a_new_config_and_leaves_the_input_alone():
    base = Local()
    new = apply_overrides(base, ["inner.k=2", "leaf.name=y"])
    assert (base.inner.k, base.leaf.name) == (5, "x") and (new.inner.k, new.leaf.name) == (2, "y")
    assert new.inner.ratio == 0.5 and new is not base
    assert apply_overrides(base, []) == base


@pytest.mark.parametrize("override,pattern", [
    ("n=three", r"'n=three'.*n expects int, got 'three'"),
    ("lr=fast", r"lr expects float"),
    ("flag=maybe", r"flag expects bool, got 'maybe'"),
    ("dims=1,x", r"dims expects tuple\[int, \.\.\.\], got '1,x'"),
    ("pair=1,2,3", r"pair expects tuple\[int, str\]"),
    ("mode=medium", r"mode expects Literal\['fast', 'slow'\]"),
    ("color=green", r"color expects Color"),
    ("maybe=x", r"maybe expects int \| None"),
    ("inner.k=1.5", r"inner\.k expects int"),
    ("n", r"expected 'dotted.path=value'"),
    ("=3", r"expected 'dotted.path=value'"),
])
def test_type_errors_name_field_type_and_text(override, pattern):
    with pytest.raises(OverrideError, match=pattern):
        apply_overrides(Local(), [override])


def test_unknown_keys_suggest_close_matches_and_list_fields():
    with pytest.raises(OverrideError, match=r"unknown field inner\.kk in Inner \(did you mean 'k'\?\); "
                                            r"valid fields: k, ratio"):
        apply_overrides(Local(), ["inner.kk=1"])
    with pytest.raises(OverrideError, match=r"unknown field zzz in Local; valid fields: n, lr, flag") as err:
        apply_overrides(Local(), ["zzz=1"])
    assert "derived" not in str(err.value)  # init=False fields cannot be set
    with pytest.raises(OverrideError, match=r"n is int, not a config section"):
        apply_overrides(Local(), ["n.x=1"])


def test_validation_reruns_and_names_the_override():
    with pytest.raises(OverrideError, match=r"'inner\.k=0'.*invalid inner \(Inner\): k must be >= 1") as err:
        apply_overrides(Local(), ["n=4", "inner.k=0"])
    assert "'n=4'" not in str(err.value)  # only the overrides that touched the failing section
    assert isinstance(err.value.__cause__, ValueError)
    with pytest.raises(OverrideError, match=r"overrides 'flag=true', 'n=11': invalid config \(Local\): flag needs"):
        apply_overrides(Local(), ["flag=true", "n=11"])
    # Validation sees the final values only, not a half-applied state.
    assert apply_overrides(Local(flag=True), ["n=20", "flag=false"]).n == 20


def test_optional_sections_enable_disable_reset():
    assert apply_overrides(Local(), ["opt={}"]).opt == Inner()
    assert apply_overrides(Local(), ["opt=default"]).opt == Inner()
    assert apply_overrides(Local(), ["opt.k=4"]).opt == Inner(k=4)  # setting a field turns it on
    assert apply_overrides(Local(), ["opt={k: 3, ratio: 0.25}"]).opt == Inner(k=3, ratio=0.25)
    on = Local(opt=Inner(k=9))
    assert apply_overrides(on, ["opt={}"]).opt == Inner(k=9)  # already on: kept
    assert apply_overrides(on, ["opt=null"]).opt is None
    assert apply_overrides(on, ["opt=default", "opt.ratio=2"]).opt == Inner(ratio=2.0)
    assert apply_overrides(Local(), ["opt.k=4", "opt=null"]).opt is None  # later wins
    assert apply_overrides(Local(), ["opt=null", "opt.k=4"]).opt == Inner(k=4)
    # "default" is the field's own default (Inner(k=5) here), not the class default.
    assert apply_overrides(Local(inner=Inner(k=2)), ["inner=default"]).inner == Inner(k=5)
    with pytest.raises(OverrideError, match="inner .Inner. is not optional"):
        apply_overrides(Local(), ["inner=null"])
    with pytest.raises(OverrideError, match="opt is a Inner section"):
        apply_overrides(Local(), ["opt=3"])


def test_dict_fields():
    assert apply_overrides(Local(), ["extra.width=64"]).extra == {"depth": 2, "width": 64}
    assert apply_overrides(Local(), ["extra={width: 8}"]).extra == {"width": 8}
    assert apply_overrides(Local(), ["extra={width: 8}", "extra.depth=1"]).extra == {"width": 8, "depth": 1}


def test_repo_configs():
    c = apply_overrides(Repo(), ["optim.lr=1e-5", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "parallel.recompute=full", "loss.tis.cap=3", "loss.dmmpt={}",
                                 "rollout.sampling.temperature=1.0", "rollout.sampling.stop=[</s>, 'a,b']",
                                 "rollout.selection=random"])
    assert c.optim == OptimConfig(lr=1e-5)
    assert c.parallel == ParallelConfig(tp=2, sequence_parallel=True, recompute="full")
    assert c.loss.tis == TISConfig(cap=3.0) and c.loss.dmmpt == DMMPTConfig()
    assert c.rollout.sampling == SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16384, stop=("</s>", "a,b"))
    assert c.rollout.selection == "random"
    off = apply_overrides(c, ["loss.tis=null", "parallel.recompute=none", "parallel.etp=2"])
    assert off.loss.tis is None and off.parallel.recompute is None and off.parallel.etp == 2
    with pytest.raises(OverrideError, match=r"'parallel.sequence_parallel=true'.*needs tp > 1") as err:
        apply_overrides(Repo(), ["parallel.sequence_parallel=true"])
    assert isinstance(err.value.__cause__, LayoutError)
    with pytest.raises(OverrideError, match=r"invalid loss.tis \(TISConfig\): tis cap must be >= 1"):
        apply_overrides(Repo(), ["loss.tis.cap=0.5"])
    with pytest.raises(OverrideError, match=r"rollout.sampling.top_p.*top_p must be in"):
        apply_overrides(Repo(), ["rollout.sampling.top_p=0"])
    with pytest.raises(OverrideError, match=r"did you mean 'tis'"):
        apply_overrides(Repo(), ["loss.tiss.cap=2"])


def test_config_to_dict_is_json_and_round_trips():
    c = apply_overrides(Repo(), ["loss.tis.cap=3", "rollout.sampling.stop=a,b", "parallel.tp=4"])
    plain = config_to_dict(c)
    assert json.loads(json.dumps(plain)) == plain
    assert plain["loss"]["tis"] == {"cap": 3.0, "mismatch_threshold": None}
    assert plain["rollout"]["sampling"]["stop"] == ["a", "b"]
    assert apply_mapping(Repo(), plain) == c
    local = config_to_dict(Local(opt=Inner()))
    assert local["color"] == "red" and "derived" not in local
    assert apply_mapping(Local(), local) == Local(opt=Inner())
    with pytest.raises(TypeError, match=r"config.extra.fn: builtin_function_or_method is not JSON"):
        config_to_dict(Local(extra={"fn": print}))


def test_yaml_files(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1e-5\nloss:\n  tis: {}\n  dmmpt:\n    prob_threshold: 0.9\n"
                    "parallel.tp: 2\nrollout:\n  sampling:\n    stop: [a, b]\n")
    c = apply_yaml(Repo(), path)
    assert c.optim.lr == 1e-5 and c.parallel.tp == 2  # YAML reads 1e-5 as text: parsed as float
    assert c.loss.tis == TISConfig() and c.loss.dmmpt == DMMPTConfig(prob_threshold=0.9)
    assert c.rollout.sampling.stop == ("a", "b")
    assert apply_mapping(c, {"loss": {"tis": None}}).loss.tis is None
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(tmp_path / "empty.yaml") == {}


@pytest.mark.parametrize("text,pattern", [
    ("optim:\n  lr: [1\n", r"bad.yaml: not valid YAML"),
    ("- a\n- b\n", r"bad.yaml: must hold a mapping.*list"),
    ("optim:\n  lr: fast\n", r"bad.yaml: optim.lr expects float, got 'fast'"),
    ("optim:\n  lrr: 1\n", r"bad.yaml: unknown field optim.lrr.*did you mean 'lr'"),
    ("parallel:\n  tp: true\n", r"bad.yaml: parallel.tp expects int, got True"),
    ("loss:\n  tis:\n    cap: 0.1\n", r"bad.yaml: invalid loss.tis"),
])
def test_yaml_errors_name_the_file(tmp_path, text, pattern):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(OverrideError, match=pattern):
        apply_yaml(Repo(), path)


def test_yaml_missing_file(tmp_path):
    with pytest.raises(OverrideError, match=r"nope.yaml does not exist"):
        load_yaml(tmp_path / "nope.yaml")
