"""The Megatron actor: model provider, parallel layout, HF/torch_dist checkpoints, log-probs.

Nothing here imports the agents or SGLang. Import ``megatron_marsrl.megatron.cpu_compat``
effects happen only through :func:`megatron_marsrl.megatron.parallel.init_parallel`.
"""
