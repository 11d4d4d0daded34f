"""Roles as data, and the role extension point (resolved by import path)."""
from __future__ import annotations

import asyncio
import textwrap

import pytest

from megatron_marsrl.agents import roles
from megatron_marsrl.agents.client import SamplingParams
from megatron_marsrl.agents.roles import CORRECTOR, SOLVER, VERIFIER, Role, RoleSet, resolve_role, role_set
from megatron_marsrl.agents.system import SLOTS, ReasoningSystem, SystemConfig

from .helpers import ScriptedGenerator, prompt_text


def test_builtin_prompts_carry_their_inputs_and_ask_for_the_formats_we_parse():
    solver = prompt_text(SOLVER.prompt({"problem": "P{x}"}))
    assert "P{x}" in solver and "\\boxed{answer}" in solver
    verifier = prompt_text(VERIFIER.prompt({"problem": "P", "solution": "S"}))
    assert "P" in verifier and "S" in verifier and '"Verdict: Correct"' in verifier and '"Verdict: Wrong"' in verifier
    corrector = prompt_text(CORRECTOR.prompt({"problem": "P", "solution": "S", "report": "R"}))
    assert "R" in corrector and "mistaken" in corrector and "\\boxed{answer}" in corrector


def test_missing_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"role 'verifier' needs inputs \['problem', 'solution'\]; "
                                         r"missing \['solution'\]"):
        VERIFIER.prompt({"problem": "P"})


def test_role_checks_callables_and_slot_inputs():
    with pytest.raises(TypeError, match="build_prompt must be callable"):
        Role(name="x", input_keys=(), build_prompt="nope", parse_output=SOLVER.parse_output, reward=SOLVER.reward)
    needy = Role(name="needy", input_keys=("problem", "hint"), build_prompt=SOLVER.build_prompt,
                 parse_output=SOLVER.parse_output, reward=SOLVER.reward)
    with pytest.raises(ValueError, match=r"asks for inputs \['hint'\]"):
        RoleSet(solver=needy)


def test_resolve_builtin_and_unknown():
    assert resolve_role("verifier") is VERIFIER
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        resolve_role("critic")
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_role("megatron_marsrl.agents.roles:NOPE")
    with pytest.raises(TypeError, match="expected a megatron_marsrl.agents.roles.Role"):
        resolve_role("megatron_marsrl.agents.roles:SOLVER_PROMPT")


PLUGIN = textwrap.dedent('''
    import dataclasses
    from megatron_marsrl.agents import roles
    from megatron_marsrl.agents.parsing import ParsedOutput
    from megatron_marsrl.data_types import ParseStatus

    def terse_prompt(inputs):
        return [{"role": "user", "content": "TERSE " + inputs["problem"]}]

    def shout_parser(text, finish_reason):
        return ParsedOutput(value=text.strip().upper(), status=ParseStatus.OK, passed_on=text.strip())

    def always_half(sample, reference_answer):
        return 0.5

    TERSE_SOLVER = dataclasses.replace(roles.SOLVER, name="terse", build_prompt=terse_prompt,
                                       parse_output=shout_parser, reward=always_half)
''')


def test_user_role_by_import_path_drives_the_loop(tmp_path, monkeypatch):
    (tmp_path / "my_roles_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    rs = role_set(solver="my_roles_plugin:TERSE_SOLVER")
    assert rs.solver.name == "terse" and rs.verifier is VERIFIER
    gen = ScriptedGenerator({"solver": ["abc"], "verifier": ["Verdict: Correct"]})
    system = ReasoningSystem(roles=rs, generators={s: gen for s in SLOTS},
                             sampling={s: SamplingParams() for s in SLOTS}, config=SystemConfig(accept_after=1))
    result = asyncio.run(system.run_once("2+2"))
    assert prompt_text(gen.requests[0][1].messages) == "TERSE 2+2"
    assert result.answer == "ABC" and result.outcome == "accepted"
    assert rs.solver.reward(None, "x") == 0.5
    assert "terse" not in roles.BUILTIN_ROLES  # resolving a plugin never registers it globally
