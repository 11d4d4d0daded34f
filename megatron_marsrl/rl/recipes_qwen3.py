"""MarsRL recipes for Qwen3-30B-A3B(-Thinking-2507) on 8, 16, 32 and 64 H100-80GB GPUs, with the
engines colocated with the trainer, and on 32 and 64 GPUs split from it.

    marsrl train --recipe qwen3_30b_a3b_h100x16 --nodes 2 --dry-run         # layout + memory, no GPU
    marsrl train --recipe qwen3_30b_a3b_h100x16 model.path=/ckpt/Qwen3-30B-A3B-Thinking-2507 \\
        task.train=/data/train.jsonl                                         # under torchrun, 2 x 8 GPUs

Launch scripts: examples/qwen3_30b_a3b/ (Slurm and plain torchrun). Differences from the MarsRL
paper's set-up, all forced by what this trainer supports today:
  * no context parallelism: a whole sequence (prompt + up to 64k output) is one micro-batch
    on one model replica, so TP=4 (the most the 4 KV heads allow) is needed to split its
    152k-vocabulary logits, and every layer is recomputed in backward;
  * colocated recipes (qwen3_30b_a3b_h100x{8,16,32,64}): one TP8 SGLang engine per node,
    time-shared with the trainer (pipeline.time_shared: the trainer's parameters and state go
    to host memory while the engines generate, the engines release weights and KV cache while
    it trains). Each engine's KV pool (engine.max_total_tokens, 39 x 64k tokens) is what the
    GPU holds next to the engine's weights, SGLang's runtime, the trainer's CUDA context and the
    dry run's reserve (6 GiB of 80 kept free for fragmentation, NCCL buffers and IPC contexts:
    megatron/memory.py reserve_fraction). Their dry runs rank this placement in the agentic
    pipeline first at every size, 2-4x faster than engines resident next to the trainer with
    the overlapping scheduler (at 64 GPUs 3771 s/step against 8021: a resident trainer leaves
    a pool of ~50 sequences per engine instead of ~130, and the step is rollout-bound). Time
    sharing rules out overlap (scheduler.overlap=false): the scheduler's overlap pays in the
    split recipes. Time-shared SGLang engines have not run on a GPU yet (the GPU check ran the
    time-shared trainer with the embedded engine).
  * split recipes (qwen3_30b_a3b_h100x{32,64}_split): on every node GPUs 0-1 train and GPUs
    2-7 hold three TP2 engines, which take each weight sync by broadcast from rank 0
    (update_weights_from_distributed over NCCL). Launch torchrun with --nproc-per-node 2.
    Their dry runs rank this split and pipeline+overlap first of every mode x placement:
    3090 s/step at 64 GPUs (2.99x over sync in the same placement), 5968 s at 32 (2.14x).
  * Mode and placement: the dry run's last table (rl/projection.py) projects every mode in
    every placement that fits and marks what the trainer cannot launch.
  * Engines on other nodes are reached over the network: multi-node runs need
    engine.host=0.0.0.0 and one MARSRL_SGLANG_API_KEY on every node (the launch scripts in
    examples/qwen3_30b_a3b/ set both).

model.path and task.train/eval default to placeholders under /data/...; override them. The
embedded config.json values (model.arch) let `--dry-run` plan without the checkpoint; when
model.path/config.json exists it is read instead. Every figure was checked with the dry run
only (memory estimate of megatron_marsrl.megatron.memory), not on GPUs.
"""
from __future__ import annotations

import dataclasses

from megatron_marsrl.agents.client import SamplingParams
from megatron_marsrl.agents.rollout import RolloutConfig
from megatron_marsrl.algorithms.advantages import AdvantageConfig
from megatron_marsrl.algorithms.losses import PolicyLossConfig
from megatron_marsrl.megatron.optim import OptimConfig
from megatron_marsrl.megatron.parallel import ParallelConfig
from megatron_marsrl.rl.config import (ModelConfig, PipelineConfig, PolicyConfig, RunConfig, TaskConfig,
                                       TrainConfig)
from megatron_marsrl.rl.scheduler import SchedulerConfig
from megatron_marsrl.rollout.factory import RolloutEngineConfig

# config.json of Qwen/Qwen3-30B-A3B-Thinking-2507 (30,532,122,624 parameters, 3.3B active).
# The original Qwen3-30B-A3B differs only in max_position_embeddings (40960) and rope_theta (1e6),
# neither of which changes the layout or the memory plan.
QWEN3_30B_A3B_THINKING_2507 = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 262144, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

MODEL_PATH = "/data/models/Qwen3-30B-A3B-Thinking-2507"
"""Placeholder: a local HF checkpoint directory (override model.path)."""
TRAIN_DATA = "/data/marsrl/train.jsonl"
"""Placeholder: JSONL problems with reference answers (override task.train)."""
EVAL_DATA = "/data/marsrl/aime2025.jsonl"
"""Placeholder: held-out problems, e.g. AIME 2025 (override task.eval; "" disables evaluation)."""

MAX_OUTPUT_TOKENS = 65536
PROMPT_ALLOWANCE = 4096
ENGINE_TP = 8
TIME_SHARED_KV_TOKENS = 39 * 65536
"""KV pool of a time-shared TP8 engine: 58.5 GiB per GPU, the rollout phase at 73.2 GiB with
the 6 GiB reserve kept (the dry run's fill is ~2.59M tokens)."""


def _marsrl(gpus: int, *, ep: int, offload: float, kv_tokens: int, time_shared: bool) -> TrainConfig:
    """The MarsRL recipe on `gpus` GPUs; only the expert parallelism, the optimizer offload, the
    engine KV pool and the time sharing change (reasons at each caller)."""
    return TrainConfig(
        run=RunConfig(
            steps=200,  # placeholder length: MarsRL gives no step count; one epoch = dataset rows / 128
            output_dir=f"outputs/qwen3_30b_a3b_h100x{gpus}",
            seed=1234,  # any fixed seed: makes data order and input selection reproducible
            checkpoint_every=10,  # a step takes tens of minutes; a checkpoint (~430 GB with Adam state) is costly
            keep_checkpoints=2,  # the newest plus one fallback: ~0.9 TB of disk
            eval_every=20,  # AIME-sized evaluation runs whole S=5 trajectories: keep it occasional
            sync_probe=True,  # a few tokens per sync catch a broken weight update at once
        ),
        model=ModelConfig(
            path=MODEL_PATH,
            dtype="bfloat16",  # bf16 weights and activations; fp32 grads and Adam state (optim.py)
            moe_aux_loss_coeff=0.0,  # MarsRL trains without a load-balancing loss
            arch=dict(QWEN3_30B_A3B_THINKING_2507),
        ),
        task=TaskConfig(
            name="math",  # the MarsRL Solver / Verifier / Corrector prompts and rewards
            train=TRAIN_DATA,
            eval=EVAL_DATA,
            eval_size=30,  # AIME 2025 has 30 problems
        ),
        parallel=ParallelConfig(
            tp=4,  # the most the 4 KV heads allow; one micro-batch's logits: 15 GiB at TP4, 30 at TP2
            pp=1,  # 1F1B would keep pp micro-batches of up to 68k tokens in flight on stage 0
            ep=ep,
            etp=1,  # experts are 768 wide: split them across GPUs (EP), not within (ETP)
            sequence_parallel=True,  # required by Megatron for MoE with TP > 1; splits norms/residuals 4 ways
            distributed_optimizer=True,  # shards Adam state over data-parallel ranks; required for offload
            recompute="full",  # a 68k-token micro-batch saves 115 GiB per GPU with selective recompute, 3 with full
            micro_batch_size=1,  # unused: the scheduler's token budget sizes a micro-batch (one packed row)
        ),
        optim=OptimConfig(
            optimizer="adam",  # AdamW (decoupled weight decay), as MarsRL
            lr=1e-6,  # MarsRL: constant 1e-6
            weight_decay=0.0,  # MarsRL gives none; the reward alone moves the weights
            adam_beta1=0.9,  # AdamW defaults (MarsRL gives none)
            adam_beta2=0.999,
            adam_eps=1e-8,
            clip_grad=1.0,  # the usual global-norm clip of GRPO trainers
            cpu_offload_fraction=offload,
        ),
        engine=RolloutEngineConfig(
            kind="sglang_server",  # SGLang server processes: the GPU engine; weights synced over HTTP
            num_engines=1,  # one engine per node fills it (every node starts its own)
            tp_size=ENGINE_TP,  # 61 GB of bf16 weights / 8 = 7.6 GiB per GPU: the most room left for KV
            ep_size=1,  # plain TP inside the engine, the path the weight-sync tests cover
            dp_size=1,
            base_gpu_id=0,
            gpus_per_node=8,  # H100 nodes of 8 GPUs
            host="127.0.0.1",  # one node; multi-node launches override it (module docstring)
            max_total_tokens=kv_tokens,  # the binding size of the pool (per caller); SGLang sizes it at start
            # only an upper bound: weights + KV + what is resident when SGLang sizes its pool
            # (time-shared: the trainer's CUDA context only; 0.88 x 80 GiB covers 7.2 + 58.5 + 3.5)
            mem_fraction_static=0.88,
            startup_timeout=1200.0,  # loading 61 GB and capturing CUDA graphs takes minutes
            seed=0,
        ),
        rollout=RolloutConfig(
            group_size=8,  # MarsRL: G = 8 samples per same-input group
            inputs_per_stage=2,  # MarsRL: k = 2 outputs of a stage move on
            max_stages=5,  # MarsRL training: Solver, V1, C1, V2, C2
            selection="adaptive",  # MarsRL's best input selection (adaptive > balanced > random)
            format_penalty=0.0,  # MarsRL rewards are binary 1/0
            sampling=SamplingParams(temperature=0.85, top_p=1.0,  # MarsRL rollout sampling
                                    max_tokens=MAX_OUTPUT_TOKENS),  # MarsRL: up to 64k new tokens
        ),
        pipeline=PipelineConfig(
            mode="pipeline",  # MarsRL agentic pipeline: every step advances each open trajectory one stage
            problems_per_step=128,  # MarsRL: 128 prompts x 8 responses per step
            # MarsRL generates 64k outputs as 4 x 16k segments: a sample still running after 16k
            # tokens continues with the next step's weights; its older tokens are masked.
            segment_tokens=16384,
            time_shared=time_shared,  # colocated recipes: trainer and engines take turns on the GPUs
        ),
        scheduler=SchedulerConfig(
            # tokens of one packed row: one 64k output plus a 4k prompt, or any mix of shorter sequences summing to it
            token_budget=MAX_OUTPUT_TOKENS + PROMPT_ALLOWANCE,
            max_sequences=None,  # only the token budget limits packing
            # split recipes: train finished groups while the rest is generated (the point of the
            # scheduler); time-shared ones cannot (the trainer is off the GPU during the rollout)
            overlap=not time_shared,
            round_balance=0.9,  # early rounds: lockstep ranks wait for the largest micro-batch, keep it within 10%
        ),
        policy=PolicyConfig(
            sharing="shared",  # MarsRL: one model plays all three roles
            reference=False,  # no KL term (loss.kl_coef = 0): no reference copy to hold
            max_grad_norm=None,  # skip only non-finite updates; clip_grad bounds the rest
        ),
        advantage=AdvantageConfig(estimator="grpo"),  # MarsRL: (r - mean) / std per same-input group
        loss=PolicyLossConfig(aggregation="seq-mean-token-mean"),  # MarsRL: per-sequence mean of token losses
    )


def qwen3_30b_a3b_h100x8() -> TrainConfig:
    """1 node: 16 experts per GPU and no second expert-data-parallel rank to shard Adam over,
    so half of the optimizer state lives in host memory. The tightest size: the train phase
    peaks at 71.5 GiB per GPU."""
    return _marsrl(
        8,
        ep=8,  # all experts split over the node's 8 GPUs (NVLink all-to-all)
        # Adam for 3.6B local expert params is 43 GiB per GPU: half on the host puts the train
        # phase at 71.5 GiB (the GPU is the trainer's alone then: the engines released theirs)
        offload=0.5,
        kv_tokens=TIME_SHARED_KV_TOKENS,
        time_shared=True,  # 28664 s/step in the pipeline, against 122166 resident with overlap (dry run)
    )


def qwen3_30b_a3b_h100x16() -> TrainConfig:
    """2 nodes: experts split 16 ways across both nodes; the Adam state fits on the GPUs in the
    train phase."""
    return _marsrl(
        16,
        ep=16,  # 8 experts per GPU: halves the bf16 params and fp32 grads that EP8 would keep
        offload=0.0,  # Adam is 21 GiB per GPU: the train phase peaks at 61.4 GiB with all of it here
        kv_tokens=TIME_SHARED_KV_TOKENS,
        time_shared=True,  # 14433 s/step in the pipeline, against 44877 resident with overlap (dry run)
    )


def qwen3_30b_a3b_h100x32() -> TrainConfig:
    """4 nodes: experts split 32 ways; the whole optimizer fits on the GPUs."""
    return _marsrl(
        32,
        ep=32,  # 4 experts per GPU: trainer state 18 GiB per GPU
        offload=0.0,  # Adam for 0.9B local expert params is 10 GiB: no host round trips needed
        kv_tokens=TIME_SHARED_KV_TOKENS,
        time_shared=True,  # 7329 s/step in the pipeline, against 22472 resident with overlap (dry run)
    )


def qwen3_30b_a3b_h100x64() -> TrainConfig:
    """8 nodes: experts split 64 ways, the least trainer state per GPU."""
    return _marsrl(
        64,
        ep=64,  # 2 experts per GPU: trainer state 10 GiB per GPU
        offload=0.0,  # everything fits on the GPUs
        kv_tokens=TIME_SHARED_KV_TOKENS,
        time_shared=True,  # 3771 s/step in the pipeline, against 8021 resident with overlap (dry run)
    )


def _split(config: TrainConfig, gpus: int) -> TrainConfig:
    """`config` in the split placement: on every node GPUs 0-1 train and three TP2 engines take
    GPUs 2-7 (three quarters of the GPUs generate; the split the projection ranks first)."""
    engine = dataclasses.replace(
        config.engine,
        placement="split",  # engine-only GPUs; weights by broadcast from rank 0 (NCCL)
        tp_size=2,  # 61 GB / 2 = 28.4 GiB of weights per GPU; three engines fit the six GPUs
        num_engines=3,
        base_gpu_id=2,  # GPUs 0-1 train: torchrun --nproc-per-node 2
        mem_fraction_static=0.86,  # nothing else on these GPUs; max_total_tokens binds just below it
    )
    return dataclasses.replace(config, engine=engine,
                               run=dataclasses.replace(config.run, output_dir=f"outputs/qwen3_30b_a3b_h100x{gpus}_split"))


def qwen3_30b_a3b_h100x32_split() -> TrainConfig:
    """4 nodes split 2 + 6: the trainer has 8 GPUs (the 8-GPU layout and its host Adam), 12 TP2
    engines have the other 24."""
    return _split(_marsrl(32, ep=8, offload=1.0, time_shared=False,
                          kv_tokens=851968),  # 13 x 64k per TP2 engine: an engine-only GPU at 72.4 GiB (dry run)
                  32)


def qwen3_30b_a3b_h100x64_split() -> TrainConfig:
    """8 nodes split 2 + 6: the trainer has 16 GPUs (the 16-GPU layout), 24 TP2 engines have 48."""
    return _split(_marsrl(64, ep=16, offload=0.75, time_shared=False,
                          kv_tokens=851968),  # 13 x 64k per TP2 engine: an engine-only GPU at 72.4 GiB (dry run)
                  64)


QWEN3_RECIPES = {
    "qwen3_30b_a3b_h100x8": qwen3_30b_a3b_h100x8,
    "qwen3_30b_a3b_h100x16": qwen3_30b_a3b_h100x16,
    "qwen3_30b_a3b_h100x32": qwen3_30b_a3b_h100x32,
    "qwen3_30b_a3b_h100x64": qwen3_30b_a3b_h100x64,
    "qwen3_30b_a3b_h100x32_split": qwen3_30b_a3b_h100x32_split,
    "qwen3_30b_a3b_h100x64_split": qwen3_30b_a3b_h100x64_split,
}
"""Recipe name -> function, registered in megatron_marsrl.rl.recipes.RECIPES."""
