"""megatron_marsrl: train Solver / Verifier / Corrector agents with RL on Megatron-core.

Where things live:
  megatron_marsrl/agents/      the multi-agent reasoning system (roles, parsing, inference loop)
  megatron_marsrl/algorithms/  advantages and policy losses (pure torch, no Megatron)
  megatron_marsrl/megatron/    the Megatron actor: model provider, parallel layout, checkpoints
  megatron_marsrl/cli.py       the `marsrl` command
"""

__version__ = "0.1.0"
