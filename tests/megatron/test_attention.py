"""megatron/attention.py: the sequences of a packed row read back from its mask. The attention
itself is checked end to end: HF parity (test_parity.py, test_gguf.py) and packed against
padded rows (test_packing.py)."""
import pytest
import torch

from megatron_marsrl.megatron import cpu_compat

cpu_compat.apply()  # megatron-core's attention modules import CUDA-only packages without it

from megatron_marsrl.megatron.attention import causal_blocks  # noqa: E402


def _packed_mask(lengths):
    """forward.py's mask of a packed row: block-diagonal causal, True = masked out."""
    block = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = block.numel()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return ~(causal & (block[:, None] == block[None, :]))[None, None]


@pytest.mark.parametrize("lengths", [[5], [3, 1, 4], [1, 1, 1], [7, 2, 9, 1]])
def test_blocks_are_read_back_from_the_mask(lengths):
    edges = torch.tensor([0, *lengths]).cumsum(0).tolist()
    assert causal_blocks(_packed_mask(lengths), sum(lengths)) == list(zip(edges[:-1], edges[1:]))


def test_other_masks_are_not_taken_for_blocks():
    mask = _packed_mask([3, 4])
    assert causal_blocks(None, 7) == [(0, 7)]
    leaky = mask.clone()
    leaky[0, 0, 5, 1] = False  # sequence 2 sees a token of sequence 1
    assert causal_blocks(leaky, 7) is None
    full = torch.zeros(1, 1, 7, 7, dtype=torch.bool)  # bidirectional
    assert causal_blocks(full, 7) is None
    assert causal_blocks(mask.expand(2, 1, 7, 7), 7) is None  # one mask per row: not a packed row
