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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Visibility = int | torch.Tensor  # prefix length, or [n] int64 slots in position order


def visibility_mask(visible: list[Visibility], num_slots: int, device) -> torch.Tensor | None:
    """``[T, num_slots]`` bool mask for :func:`attention_fast` (``None``: one row that sees
    every slot, the plain decoding step)."""
    if len(visible) == 1 and isinstance(visible[0], int) and visible[0] == num_slots:
        return None
    mask = torch.zeros((len(visible), num_slots), dtype=torch.bool)
    for row, vis in enumerate(visible):
        if isinstance(vis, int):
            mask[row, :vis] = True
        else:
            mask[row, vis.cpu()] = True
    return mask.to(device)


def attention_fast(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Batched attention of T rows.

    Args:
        q: ``[T, H, d]`` queries (rotary applied).
        keys, values: ``[G, S, d]`` the cache slots written so far (new rows included).
        mask: ``[T, S]`` bool from :func:`visibility_mask`, or ``None`` (all visible).
        scale: softmax scale (``1 / sqrt(d)``).

    Returns:
        ``[T, H * d]``.
    """
    t, h, d = q.shape
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
    kh, vh = keys.unsqueeze(0), values.unsqueeze(0)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=kh.shape[1] != h
    )
    return out[0].transpose(0, 1).reshape(t, h * d)


#: Exact attention computes a row over its visible keys padded to a multiple of this.
KEY_BLOCK = 64


@dataclass
class KeyGroup:
    """Rows that share a padded key width: ``rows`` ``[R]``, ``index`` ``[R, W]`` slots to
    gather (visible ones first, in position order; filler after), ``valid`` ``[R, W]``."""

    rows: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor


def key_groups(visible: list[Visibility], device) -> list[KeyGroup]:
    """Group rows by ``W = ceil(n / KEY_BLOCK) * KEY_BLOCK`` (n = visible keys), once per
    forward: the same for every layer."""
    slots = [torch.arange(v) if isinstance(v, int) else v.cpu() for v in visible]
    widths = [-(-s.numel() // KEY_BLOCK) * KEY_BLOCK for s in slots]
    groups = []
    for width in sorted(set(widths)):
        rows = [i for i, w in enumerate(widths) if w == width]
        index = torch.zeros((len(rows), width), dtype=torch.long)  # slot 0 as filler
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for j, i in enumerate(rows):
            index[j, : slots[i].numel()] = slots[i]
            valid[j, : slots[i].numel()] = True
        groups.append(
            KeyGroup(torch.tensor(rows, device=device), index.to(device), valid.to(device))
        )
    return groups


def attention_exact(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    groups: list[KeyGroup],
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
        groups: from :func:`key_groups`.
        scale: softmax scale.

    Returns:
        ``[T, H * d]``; scores are softmaxed in float32 (as transformers' eager attention).
    """
    t, h, d = q.shape
    g = keys.shape[0]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    for group in groups:
        r = group.rows.numel()
        k = keys[:, group.index].transpose(0, 1)  # [R, G, W, d]
        v = values[:, group.index].transpose(0, 1)
        qg = q.index_select(0, group.rows).view(r, g, h // g, d)  # [R, G, H/G, d]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [R, G, H/G, W]
        scores = scores.masked_fill(~group.valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out.index_copy_(0, group.rows, torch.matmul(probs, v).view(r, h, d))
    return out.view(t, h * d)
