"""Tests of megatron_marsrl.rl."""
