"""Core attention of the local (non-Transformer-Engine) layer spec: one fused attention per
packed sequence instead of one [heads, T, T] score matrix per packed row.

Megatron's local `DotProductAttention` materialises the scores of the whole row (baddbmm), masks
them, takes an fp32 softmax and multiplies back (bmm): for a packed micro-batch of T tokens that
is O(T^2) time and memory even though each sequence attends only to itself (forward.py builds a
block-diagonal causal mask). On 2 CPU cores with SmolLM2-135M it was ~20% of a training
micro-batch of 800 tokens and grows with T^2. `SequenceAttention` reads the blocks back from the
mask (checked exactly; any other mask takes torch SDPA with the mask) and runs
`scaled_dot_product_attention(is_causal=True)` on each, so a micro-batch costs the sum of its
sequences' squares. The mask forward.py builds carries its blocks, so each layer reads them
instead of rebuilding and comparing the [T, T] mask (at T ~2,000 that took ~17 ms per layer on
2 cores, more than the mask itself). It has no parameters of its own: checkpoints and the HF
mapping are unchanged. Features the subclass does not cover (packed_seq_params, attention bias, non-vanilla
softmax, attention dropout in training) go to Megatron's own forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


_BLOCKS = "marsrl_causal_blocks"
"""The attribute of a `packed_causal_mask` result that holds its sequences' [start, end)."""


def packed_causal_mask(block: torch.Tensor) -> torch.Tensor:
    """The mask of a packed row whose position i belongs to sequence ``block[i]``: causal within
    each sequence, nothing across (Megatron's convention: bool, True = masked out), [1, 1, T, T].
    ``block`` is non-decreasing (sequences one after another); the mask carries their
    [start, end) for `causal_blocks`."""
    causal = torch.ones(block.numel(), block.numel(), dtype=torch.bool, device=block.device).tril()
    mask = ~(causal & (block[:, None] == block[None, :]))[None, None]
    edges = [0, *(torch.nonzero(block.diff()).flatten() + 1).tolist(), block.numel()]
    setattr(mask, _BLOCKS, list(zip(edges[:-1], edges[1:])))
    return mask


def causal_blocks(mask: torch.Tensor | None, length: int) -> list[tuple[int, int]] | None:
    """[start, end) of each sequence when ``mask`` (Megatron's convention: bool, True = masked
    out, [1, 1, length, length]) is block-diagonal causal; the whole row for None (Megatron's
    default causal mask); None for any other mask. A mask made by `packed_causal_mask` answers
    from the blocks it carries; any other is read and checked element by element."""
    if mask is None:
        return [(0, length)]
    if mask.dtype != torch.bool or mask.shape != (1, 1, length, length):
        return None
    if hasattr(mask, _BLOCKS):
        return getattr(mask, _BLOCKS)
    # a sequence starts where a position may not see the one before it
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device=mask.device),
                        torch.nonzero(mask[0, 0].diagonal(-1)).flatten() + 1])
    bounds = torch.cat([starts, starts.new_tensor([length])])
    block = torch.repeat_interleave(torch.arange(starts.numel(), device=mask.device), bounds.diff())
    if not torch.equal(mask, packed_causal_mask(block)):
        return None
    edges = bounds.tolist()
    return list(zip(edges[:-1], edges[1:]))


class SequenceAttention(DotProductAttention):
    """`DotProductAttention` with torch's fused attention, per packed sequence (module doc)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        unsupported = (packed_seq_params is not None or attention_bias is not None
                       or self.config.softmax_type != "vanilla"
                       or (self.training and self.config.attention_dropout > 0))
        if unsupported:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        length, batch = query.shape[0], query.shape[1]
        dtype = query.dtype
        # [s, b, heads, d] -> [b, heads, s, d]; on CPU fp32 math is faster than bf16 for these
        # small blocks (torch 2.14, AVX-512 bf16) and matches the fp32 softmax Megatron takes
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if q.device.type == "cpu":
            q, k, v = q.float(), k.float(), v.float()
        gqa = q.shape[1] != k.shape[1]
        blocks = causal_blocks(attention_mask, length) if batch == 1 or attention_mask is None else None
        if blocks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        else:
            out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                            scale=self.softmax_scale, enable_gqa=gqa)
                             for a, b in blocks], dim=2)
        # [b, heads, s, d] -> [s, b, heads * d]
        return out.to(dtype).permute(2, 0, 1, 3).reshape(length, batch, -1)
