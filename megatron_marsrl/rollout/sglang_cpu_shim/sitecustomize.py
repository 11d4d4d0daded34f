"""Run by Python at the start of every process whose path holds this directory: on CPU
machines only, an SGLang server and the scheduler and detokenizer processes it spawns, and the
processes of an in-process engine (rollout/sglang_server.py, rollout/sglang_engine.py).

Hides the CUDA-only packages that SGLang's CPU torch-native path never uses
(megatron_marsrl/cuda_only.py): a server started ~1.5 s sooner here (20.6-21.1 s against
22.1-22.6 s, two starts each, the same tokens generated).
"""
try:
    from megatron_marsrl import cuda_only
except ImportError:  # not this project's environment: hide nothing
    pass
else:
    cuda_only.hide()
