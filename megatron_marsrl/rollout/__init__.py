"""Rollout engines: token ids in, token ids + per-token log-probs out, HF-named weight updates.

engine.py          the records and the RolloutEngine protocol every engine implements
factory.py         RolloutEngineConfig and start_engines: which engines run, and where
hf_engine.py       the embedded in-process engine on transformers generate() (CPU default)
sglang_engine.py   sglang.Engine in this process (on CPU with the stand-ins of sglang_cpu_shim/)
sglang_server.py   SGLang server processes behind an HTTP client (GPU default)
batcher.py         the dynamic batcher of the engines that generate one batch at a time
pool.py            several engines behind one async interface (balancing, retries, restarts)
chat.py            the agents' Generator protocol over these engines, tokenizing on our side
fp8.py             FP8 rollout: its start-up checks and SGLang arguments
routed_experts.py  the experts each token was routed to, for MoE routing replay
weight_sync.py     the engine side of disaggregated weight sync (broadcast to SGLang servers)

Only chat.py imports the agents (their client types). Nothing here imports Megatron
(tests/rollout/test_imports.py checks it): engines take weights as HF-named buckets; the
Megatron side of the sync is megatron/weight_sync.py.
"""
