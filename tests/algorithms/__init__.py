"""Tests of megatron_marsrl.algorithms."""
