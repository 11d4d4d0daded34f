"""Tests of megatron_marsrl.rewards."""
