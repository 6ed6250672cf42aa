"""Attention of the native runtime over a sequence's KV cache.

Visibility of one new row is either a *prefix* of the cache slots (``n``: slots
``0 .. n - 1``: prefill, decoding, chain verification) or an explicit slot list (a token
tree node: the prefix plus its ancestors and itself).

* :func:`attention_fast`: all rows at once with ``scaled_dot_product_attention`` and a
  boolean mask.
* :func:`attention_exact`: every row through the same small products over its own
  visible keys (gathered in position order, padded to a fixed block), so a row's output
  depends only on the keys it sees: a token gets the same bits decoded alone, verified in
  a chain, in a tree, or next to other sequences. (One batched softmax(QK^T)V cannot
  promise that: its products change their blocking with the number of rows and keys.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Visibility = int | torch.Tensor  # prefix length, or [n] int64 slots in position order


def attention_fast(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: list[Visibility],
    scale: float,
) -> torch.Tensor:
    """Batched attention of T rows.

    Args:
        q: ``[T, H, d]`` queries (rotary applied).
        keys, values: ``[G, S, d]`` the cache slots written so far (new rows included).
        visible: per row, what it sees (see the module docstring).
        scale: softmax scale (``1 / sqrt(d)``).

    Returns:
        ``[T, H * d]``.
    """
    t, h, d = q.shape
    s = keys.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
    kh, vh = keys.unsqueeze(0), values.unsqueeze(0)
    if t == 1 and isinstance(visible[0], int) and visible[0] == s:
        mask = None
    else:
        mask = torch.zeros((t, s), dtype=torch.bool, device=q.device)
        for row, vis in enumerate(visible):
            if isinstance(vis, int):
                mask[row, :vis] = True
            else:
                mask[row, vis] = True
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=kh.shape[1] != h
    )
    return out[0].transpose(0, 1).reshape(t, h * d)


#: Exact attention computes a row over its visible keys padded to a multiple of this.
KEY_BLOCK = 64


def attention_exact(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: list[Visibility],
    scale: float,
) -> torch.Tensor:
    """Attention whose result for a row depends only on the keys that row sees.

    Each row's visible keys are gathered in position order and padded (masked) to
    ``W = ceil(n / KEY_BLOCK) * KEY_BLOCK`` columns, n = number of visible keys (its
    position + 1). Rows with the same ``W`` are computed together as a batch of identical
    small products (one ``[H/G, d] x [d, W]`` score product and one ``[H/G, W] x [W, d]``
    value product per row and key-value head), so a row's arithmetic is the same whether
    it is decoded alone or verified with others, in a chain or a tree. Masked columns hold
    finite values and get probability exactly 0.

    Args:
        q: ``[T, H, d]``.
        keys, values: ``[G, C, d]`` the layer's cache buffers (slots written so far
            included).
        visible: per row, a prefix length or the slots it sees (position order).
        scale: softmax scale.

    Returns:
        ``[T, H * d]``; scores are softmaxed in float32 (as transformers' eager attention).
    """
    t, h, d = q.shape
    g = keys.shape[0]
    slots = [torch.arange(v) if isinstance(v, int) else v.cpu() for v in visible]
    widths = [-(-s.numel() // KEY_BLOCK) * KEY_BLOCK for s in slots]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    for width in sorted(set(widths)):
        rows = [i for i, w in enumerate(widths) if w == width]
        index = torch.zeros((len(rows), width), dtype=torch.long)  # slot 0 as filler
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for j, i in enumerate(rows):
            index[j, : slots[i].numel()] = slots[i]
            valid[j, : slots[i].numel()] = True
        index, valid = index.to(q.device), valid.to(q.device)
        k = keys[:, index].permute(1, 0, 2, 3)  # [R, G, W, d]
        v = values[:, index].permute(1, 0, 2, 3)
        qg = q[rows].view(len(rows), g, h // g, d)  # [R, G, H/G, d]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [R, G, H/G, W]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[rows] = torch.matmul(probs, v).view(len(rows), h, d)
    return out.view(t, h * d)
