"""Attention of the native runtime over a sequence's KV cache.

Visibility of one new row is either a *prefix* of the cache slots (``n``: slots
``0 .. n - 1``: prefill, decoding, chain verification) or an explicit slot list (a token
tree node: the prefix plus its ancestors and itself).

* :func:`attention_fast`: all rows at once with ``scaled_dot_product_attention`` and a
  boolean mask.
* :func:`attention_exact`: one row at a time, always through the same operations on a
  key/value view with the same shape and strides, whatever the step computes around it:
  a row's output then depends only on the keys it sees, so a token gets the same bits
  decoded alone, verified in a chain, in a tree, or next to other sequences. (Batched
  attention cannot promise that: the score and value products change their blocking with
  the number of rows and keys, even in a hand-written softmax(QK^T)V.)
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


def attention_exact(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: list[Visibility],
    scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Row-at-a-time attention whose result per row is independent of the other rows.

    Args:
        q: ``[T, H, d]``.
        keys, values: ``[G, C, d]`` the layer's whole cache buffers (C = capacity).
        visible: per row, a prefix length or the slots it sees.
        scale: softmax scale.
        scratch: two ``[G, C, d]`` buffers to gather tree rows' keys into (same strides as
            the cache, so the products see the same layout as for a prefix); allocated
            when ``None`` and needed.

    Returns:
        ``[T, H * d]``. Scores are softmaxed in float32 (as transformers' eager attention).
    """
    t, h, d = q.shape
    g = keys.shape[0]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    for row, vis in enumerate(visible):
        if isinstance(vis, int):
            k, v = keys[:, :vis], values[:, :vis]
        else:
            if scratch is None:
                scratch = (torch.empty_like(keys), torch.empty_like(values))
            n = vis.numel()
            scratch[0][:, :n].copy_(keys.index_select(1, vis))
            scratch[1][:, :n].copy_(values.index_select(1, vis))
            k, v = scratch[0][:, :n], scratch[1][:, :n]
        qg = q[row].view(g, h // g, d)  # [G, H/G, d]
        scores = torch.matmul(qg, k.transpose(1, 2)) * scale  # [G, H/G, n]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[row] = torch.matmul(probs, v).view(h, d)
    return out.view(t, h * d)
