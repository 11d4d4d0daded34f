"""RL training: `marsrl train` from its configuration to its console.

loop.py              the RL loop: rollout -> rewards -> advantages -> train -> sync -> evaluate
trainer.py           the parts of a step the loop calls by name; rank coordination
messages.py          the typed messages rank 0 sends the other ranks during a step
config.py            the typed configuration of a run (TrainConfig)
recipes.py           named recipes returning a full TrainConfig (recipes_qwen3.py: the H100 ones)
overrides.py         command-line / YAML overrides of config fields
data.py              training and evaluation problems: JSONL files, the arithmetic task, the stream
rollout_side.py      rank 0's engines, agents and evaluation
node_engines.py      the SGLang servers of the other nodes, reached by rank 0 over HTTP
rollout_driver.py    the agents' rollouts in a background thread, handed over group by group
rollout_metrics.py   per-role statistics of a step's samples
train_metrics.py     train metrics with the weight of each micro-batch's value
scheduler.py         packs completed groups into training rounds while the rollout still runs
checkpoint.py        run checkpoints: models, optimizers and trainer state
observe.py           TensorBoard, metrics.jsonl, the per-step lines and the results table
console.py           what the console shows; everything else goes to <run>/train.log
time_share.py        time-shared colocation: trainer offload and engine memory release around phases
dry_run.py           `marsrl train --dry-run`: layout and memory checks without a GPU
simulate.py          projected step time of the synchronous and agentic-pipeline schedules
projection.py        the dry run's step time of every mode x placement that fits memory
sim_calibrate.py     the simulator's rates fitted to a measured run, its step times predicted
bench_real.py        the measured half of `marsrl bench pipeline`
bench_throughput.py  `marsrl bench throughput`: one end-to-end RL step benchmark

scheduler.py and simulate.py are pure Python (no torch, Megatron, SGLang or agents).
"""
