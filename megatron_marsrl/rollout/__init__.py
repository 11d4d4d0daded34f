"""Rollout engines: token ids in, token ids + per-token log-probs out, HF-named weight updates.

engine.py      the records and the RolloutEngine protocol every engine implements
hf_engine.py   the embedded in-process engine on transformers generate() (CPU default)
weight_sync.py Megatron -> engine weight sync in bounded buckets, with a log-prob probe

Nothing here imports the agents; the Megatron side is only touched in weight_sync.py.
"""
