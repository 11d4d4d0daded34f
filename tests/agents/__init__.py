"""Tests of megatron_marsrl.agents."""
