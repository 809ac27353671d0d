"""Attention written by hand, with its two products on :func:`cupykern.matmul`.

``scaled_dot_product(q, k, v, mask=None, scale=None)`` computes
``softmax(q @ k^T * scale + mask) @ v`` (scale defaulting to ``1 / sqrt(E)``) with QK^T
and PV through ``cupykern.matmul`` (batched, with autograd: in float32 under PyTorch's
default precision "highest" our 3xTF32 GEMM, about SGEMM's accuracy, where it is faster
than cuBLAS's SGEMM) and the softmax PyTorch's own. It is the PyTorch formula that
``F.scaled_dot_product_attention`` documents, not a fused (flash) kernel: the scores are
materialized, as in a hand-written attention block. :func:`scaled_dot_product_attention`
takes ``F.scaled_dot_product_attention``'s arguments.

Plugging it into a model. In a hand-written attention block, call it where the block
multiplies and normalizes the scores, or where it calls F.scaled_dot_product_attention::

    from cupykern.torch.attention import scaled_dot_product

    class SelfAttention(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

        def forward(self, x, mask=None):                    # x: (B, T, dim)
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            # was: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.heads) + mask, -1) @ v
            # or:  F.scaled_dot_product_attention(q, k, v, mask)
            y = scaled_dot_product(q, k, v, mask)           # (B, heads, T, C // heads)
            return self.out(y.transpose(1, 2).reshape(B, T, C))

A block that takes its attention function as an attribute (``self.attend =
F.scaled_dot_product_attention``) can be given :func:`scaled_dot_product_attention`
instead. :func:`cupykern.torch.convert` then replaces the block's nn.Linear layers
(``qkv``, ``out`` above) by cupykern's. PyTorch's own ``nn.MultiheadAttention`` /
``nn.TransformerEncoderLayer`` run their attention inside fused PyTorch kernels, which
this helper does not reach.

Masks follow F.scaled_dot_product_attention: a boolean mask marks the positions that
take part (True) and a floating one is added to the scores; both broadcast to (..., L,
S). ``is_causal`` masks the upper triangle (the top-left aligned causal mask). A row
whose every position is masked gives nan, as the PyTorch formula does.
"""
from __future__ import annotations

import math

import torch

from .gemm import matmul

__all__ = ["scaled_dot_product", "scaled_dot_product_attention"]


def scaled_dot_product(q, k, v, mask=None, scale=None, *, is_causal=False, dropout_p=0.0,
                       precision=None):
    """``softmax(q @ k^T * scale + mask) @ v`` with both products on :func:`cupykern.matmul`.

    Args:
        q: (..., L, E) queries; k: (..., S, E) keys; v: (..., S, Ev) values (batch
            dimensions broadcast, as torch.matmul's); torch tensors of one floating dtype.
        mask: optional, broadcastable to (..., L, S): boolean (True: takes part) or
            floating (added to the scores, in their dtype).
        scale: multiplies the scores; None: ``1 / sqrt(E)``.
        is_causal: mask the positions j > i (no ``mask`` with it).
        dropout_p: dropout probability applied to the attention weights (always, as
            F.scaled_dot_product_attention does: pass 0.0 in eval mode).
        precision: the float32 products' precision; None follows
            ``torch.get_float32_matmul_precision()`` (see :func:`cupykern.matmul`).

    Returns (..., L, Ev), with autograd through all of q, k, v (and a floating mask).
    """
    if is_causal and mask is not None:
        raise ValueError("mask: give either mask or is_causal=True, not both (as "
                         "F.scaled_dot_product_attention)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype and _computed_dtype(t) != _computed_dtype(q):
            raise TypeError(f"{name}: dtype {t.dtype} does not match q's dtype {q.dtype} "
                            "(as F.scaled_dot_product_attention)")
    _check_mask(mask, "mask")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # q and k each scaled by sqrt(|scale|) before the product, as PyTorch's own math does:
    # 16-bit q . k can pass float16's maximum where (q . k) * scale does not
    root = math.sqrt(abs(scale))
    s = matmul(q * (-root if scale < 0 else root), k.transpose(-2, -1) * root,
               precision=precision)
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(keep.logical_not(), float("-inf"))
    elif mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(mask.logical_not(), float("-inf"))
        else:
            s = s + mask.to(s.dtype)  # (the scores' dtype, as F.scaled_dot_product_attention)
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0.0:
        p = torch.dropout(p, dropout_p, True)
    return matmul(p, v, precision=precision)


def _computed_dtype(t):
    """The dtype ``t`` is computed in: autocast's, for a floating tensor other than float64
    on a device with autocast on."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev) and t.is_floating_point() and t.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return t.dtype


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """:func:`scaled_dot_product` with ``F.scaled_dot_product_attention``'s signature (its
    math: the same results up to rounding, not its fused kernels), so that a block
    calling that function can call this one. ``enable_gqa``: grouped-query attention,
    the key / value heads (dim -3) repeated to the query's."""
    _check_mask(attn_mask, "attn_mask")
    if enable_gqa:  # (key and value each by its own head count)
        key, value = _query_heads(key, query), _query_heads(value, query)
    return scaled_dot_product(query, key, value, attn_mask, scale, is_causal=is_causal,
                              dropout_p=dropout_p)


def _query_heads(t, query):
    """``t``'s heads (dim -3) repeated to the query's count, each in turn, as
    F.scaled_dot_product_attention's enable_gqa repeats key and value."""
    if t.dim() >= 3 and query.dim() >= 3 and t.shape[-3] != query.shape[-3]:
        return t.repeat_interleave(query.shape[-3] // t.shape[-3], dim=-3)
    return t


def _check_mask(mask, name):
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name}: expected a boolean or floating mask, got dtype {mask.dtype} "
                        "(as F.scaled_dot_product_attention)")
