"""megatron_marsrl: train Solver / Verifier / Corrector agents with RL on Megatron-core.

Where things live:
  agents/         the multi-agent reasoning system (roles, parsing, inference loop),
                  `marsrl solve` and `marsrl eval`
  rewards/        answer matching and the agents' rewards
  algorithms/     advantages and policy losses (pure torch, no Megatron)
  megatron/       the Megatron actor: model provider, parallel layout, checkpoints
  rollout/        the rollout engines (embedded, SGLang) and their pool
  rl/             RL training: config and recipes, data, the loop and the trainer
  commands/       the `marsrl` subcommands (thin: parse arguments, call the library)
  cli.py          the `marsrl` command
  data_types.py   the plain records the rollout side and the trainer share
  plugins.py      user extensions (roles, rewards, estimators) by import path
  outputs.py      which output directories a run may replace
  net.py          a free local port (rendezvous, servers)
  cuda_only.py    the CUDA-only packages hidden on CPU machines (faster process starts)
"""

__version__ = "0.1.0"
