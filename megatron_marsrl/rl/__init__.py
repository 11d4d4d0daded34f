"""RL step machinery that is not model code.

scheduler.py  packs completed groups into training rounds while the rollout still runs
simulate.py   projects the step time of the synchronous and the agentic-pipeline schedules

Nothing here imports Megatron, SGLang or the agents.
"""
