"""Rollout engines: token ids in, token ids + per-token log-probs out, HF-named weight updates.

engine.py      the records and the RolloutEngine protocol every engine implements
hf_engine.py   the embedded in-process engine on transformers generate() (CPU default)
weight_sync.py the engine side of disaggregated weight sync (broadcast to SGLang servers)

Nothing here imports Megatron (tests/rollout/test_imports.py checks it): engines take weights
as HF-named buckets; the Megatron side of the sync is megatron/weight_sync.py.
"""
