"""megatron/attention.py: the sequences of a packed row read back from its mask. The attention
itself is checked end to end: HF parity (test_parity.py, test_gguf.py) and packed against
padded rows (test_packing.py)."""
import pytest
import torch

from megatron_marsrl.megatron import cpu_compat

cpu_compat.apply()  # megatron-core's attention modules import CUDA-only packages without it

from megatron_marsrl.megatron import attention  # noqa: E402
from megatron_marsrl.megatron.attention import causal_blocks, packed_causal_mask  # noqa: E402


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


@pytest.mark.parametrize("lengths", [[5], [3, 1, 4], [7, 2, 9, 1]])
def test_a_packed_mask_carries_its_blocks(lengths, monkeypatch):
    block = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = packed_causal_mask(block)
    assert torch.equal(mask, _packed_mask(lengths))
    expected = causal_blocks(_packed_mask(lengths), sum(lengths))  # read back element by element
    monkeypatch.setattr(attention, "packed_causal_mask", None)  # the carried blocks need no rebuild
    assert causal_blocks(mask, sum(lengths)) == expected
    assert causal_blocks(mask, sum(lengths) + 1) is None  # a mask of another length is not this row's
