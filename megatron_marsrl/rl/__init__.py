"""RL training: the run's configuration, data, rollout side, trainer and loop, plus two tools
for the step schedule.

scheduler.py  packs completed groups into training rounds while the rollout still runs
simulate.py   projects the step time of the synchronous and the agentic-pipeline schedules
(both pure Python: no torch, Megatron, SGLang or agents).
"""
