"""Model provider: build the Megatron model for a HF architecture under a parallel layout.

Model class: megatron-core 0.19 marks GPTModel deprecated and its migration guide points to
HybridModel (a layer-pattern model whose attention, MLP and MoE are separate layers). We still
build GPTModel, deliberately: HybridModel's stack spec in 0.19 hard-wires Transformer Engine
modules (TENorm as the final norm inside HybridStack, TE linear layers in every layer spec, with
comments saying the non-TE spec "had problems"), so it cannot be built on a machine without TE,
and our CPU development/CI path must run the same model class as the GPU. GPTModel keeps local
(pure-torch) and TE specs, receives critical fixes in 0.19, and its parameter names are the ones
our HF mapping targets. All construction goes through :func:`build_model`, the one place to
switch once HybridModel gains a working local spec.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.hf_mapping import padded_vocab_size
from megatron_marsrl.megatron.parallel import ParallelConfig


def have_transformer_engine() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(arch: ModelArch, parallel: ParallelConfig, *, dtype: torch.dtype = torch.float32,
                       moe_aux_loss_coeff: float = 0.0):
    """The Megatron TransformerConfig that reproduces ``arch`` exactly under ``parallel``."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.effective_sequence_parallel(arch),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        # Fused kernels are CUDA-only. Two of Megatron's defaults need Apex, which the GPU image
        # may lack and TE layers never use: the masked-softmax kernel (local attention; it would
        # also ignore packed block masks) and the persistent layer norm (Megatron's torch norm
        # asserts it off).
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=on_gpu,
        deallocate_pipeline_outputs=False,
        variable_seq_lengths=True,
        # The default "allgather" dispatcher rejects variable_seq_lengths, even for dense models.
        moe_token_dispatcher_type="alltoall",
    )
    if parallel.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif parallel.recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # HF Qwen3-MoE: softmax over all experts, then top-k; renormalise iff norm_topk_prob.
            # Megatron: pre_softmax=False is top-k then softmax over the k (== renormalised);
            # pre_softmax=True is softmax then top-k without renormalising.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
            moe_layer_freq=[1 if m else 0 for m in arch.moe_layers],
        )
    return TransformerConfig(**kwargs)


def layer_spec(arch: ModelArch, config):
    """Per-layer module specs (dense and MoE layers may be mixed), TE when available; without TE
    the core attention is `attention.SequenceAttention` (fused, per packed sequence)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=have_transformer_engine(),
                                      normalization="RMSNorm")
    if not have_transformer_engine():
        import copy

        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from megatron_marsrl.megatron.attention import SequenceAttention

        spec = copy.deepcopy(spec)  # not megatron-core's cached spec; its layers may share one object
        for layer in spec.layer_specs:
            attention = layer.submodules.self_attention.submodules
            if attention.core_attention not in (DotProductAttention, SequenceAttention):
                raise TypeError(f"megatron-core's local layer spec has core attention {attention.core_attention}, "
                                "not DotProductAttention: review megatron/attention.py for this version")
            attention.core_attention = SequenceAttention
    return spec


def build_model(arch: ModelArch, parallel: ParallelConfig, *, dtype: torch.dtype = torch.float32,
                moe_aux_loss_coeff: float = 0.0):
    """Build this rank's pipeline stage of the model (process groups must be initialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(arch, parallel, dtype=dtype, moe_aux_loss_coeff=moe_aux_loss_coeff)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, config),
        vocab_size=padded_vocab_size(arch.vocab_size, parallel.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    model.marsrl_vocab_size = arch.vocab_size  # rows beyond it are TP padding (forward.py masks them)
    if not have_transformer_engine():
        # Local-spec norms (torch.nn.RMSNorm) are created in fp32 whatever params_dtype says;
        # Megatron's mixed-precision optimizer and checkpoints expect one dtype.
        for param in model.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
