"""Advantage estimators and policy losses: pure torch, explicit tensors in, no Megatron."""
