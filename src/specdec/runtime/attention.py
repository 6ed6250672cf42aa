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


#: :func:`visibility_mask`'s answer for rows that see exactly a causal prefix of the slots
#: starting at slot 0 (a prompt chunk from an empty cache): no mask is built, and
#: :func:`attention_fast` runs causal attention, which skips the masked blocks.
CAUSAL = "causal"


def visibility_mask(visible: list[Visibility], num_slots: int, device) -> torch.Tensor | str | None:
    """``[T, num_slots]`` bool mask for :func:`attention_fast`; ``None``: one row that sees
    every slot (the plain decoding step); :data:`CAUSAL`: row ``i`` sees slots ``0 .. i``
    and there are as many rows as slots (a prompt from an empty cache)."""
    if len(visible) == 1 and isinstance(visible[0], int) and visible[0] == num_slots:
        return None
    if len(visible) == num_slots and all(
        isinstance(v, int) and v == i + 1 for i, v in enumerate(visible)
    ):
        return CAUSAL
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
    mask: torch.Tensor | str | None,
    scale: float,
) -> torch.Tensor:
    """Batched attention of T rows.

    Args:
        q: ``[T, H, d]`` queries (rotary applied).
        keys, values: ``[G, S, d]`` the cache slots written so far (new rows included).
        mask: ``[T, S]`` bool from :func:`visibility_mask`, ``None`` (all visible) or
            :data:`CAUSAL` (T = S, row i sees slots 0 .. i).
        scale: softmax scale (``1 / sqrt(d)``).

    Returns:
        ``[T, H * d]``.
    """
    t, h, d = q.shape
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
    kh, vh = keys.unsqueeze(0), values.unsqueeze(0)
    causal = isinstance(mask, str)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=None if causal else mask, is_causal=causal, scale=scale,
        enable_gqa=kh.shape[1] != h,
    )  # fmt: skip
    return out[0].transpose(0, 1).reshape(t, h * d)


#: Exact attention computes a row over its visible keys padded to a multiple of this.
KEY_BLOCK = 64


@dataclass
class KeyGroup:
    """Rows that share a padded key width ``W``.

    Attributes:
        rows: ``[R]`` the rows (indices into the forward's rows of this sequence).
        width: ``W``, a multiple of :data:`KEY_BLOCK`.
        index: ``[R, W]`` slots to gather (visible ones first, in position order; filler
            after), or ``None`` when every row sees a prefix of the slots: the keys are
            then read in place, slots ``0 .. W - 1``.
        valid: ``[R, W]`` bool, which columns are visible.
        all_rows: the group is every row, in order (no row gather or scatter needed).
        all_valid: every column is visible to every row (no mask needed).
    """

    rows: torch.Tensor
    width: int
    index: torch.Tensor | None
    valid: torch.Tensor
    all_rows: bool = False
    all_valid: bool = False


def key_groups(visible: list[Visibility], device) -> list[KeyGroup]:
    """Group rows by ``W = ceil(n / KEY_BLOCK) * KEY_BLOCK`` (n = visible keys), once per
    forward: the same for every layer."""
    slots = [torch.arange(v) if isinstance(v, int) else v.cpu() for v in visible]
    widths = [-(-s.numel() // KEY_BLOCK) * KEY_BLOCK for s in slots]
    groups = []
    for width in sorted(set(widths)):
        rows = [i for i, w in enumerate(widths) if w == width]
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        prefix = all(isinstance(visible[i], int) for i in rows)
        index = None if prefix else torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(rows):
            valid[j, : slots[i].numel()] = True
            if index is not None:
                index[j, : slots[i].numel()] = slots[i]
        groups.append(
            KeyGroup(
                torch.tensor(rows, device=device),
                width,
                None if index is None else index.to(device),
                valid.to(device),
                rows == list(range(len(visible))),
                bool(valid.all()),
            )
        )
    return groups


def _rows_of(block: torch.Tensor, head: int, r: int, shared: bool) -> torch.Tensor:
    """``[R, W, d]`` keys (or values) of KV head ``head`` for R rows: one shared block
    broadcast (stride 0, no copy) or each row's gathered block."""
    if shared:
        return block[head].unsqueeze(0).expand(r, -1, -1)
    return block[head]


def attention_exact(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    groups: list[KeyGroup],
    scale: float,
) -> torch.Tensor:
    """Attention whose result for a row depends only on the keys that row sees.

    Each row's visible keys, in position order, fill the first n of
    ``W = ceil(n / KEY_BLOCK) * KEY_BLOCK`` columns (n = number of visible keys: its
    position + 1); the other columns are masked. Rows with the same ``W`` are computed
    together as a batch of identical small float32 products (one ``[H/G, d] x [d, W]``
    score product and one ``[H/G, W] x [W, d]`` value product per row and key-value head,
    the key block always laid out ``[W, d]`` with unit stride; several rows that see a
    prefix share one key block, broadcast without a copy), so a row's arithmetic is the
    same whether it is decoded alone or verified with others, in a chain or a tree.

    A row that sees a prefix of the slots (decoding, chains) reads slots ``0 .. W - 1`` in
    place; a tree row gathers its slots. Masked columns hold finite values (the cache is
    zero-initialised and its capacity a multiple of :data:`KEY_BLOCK`; a gather fills with
    slot 0) and get probability exactly 0, so they add exact zeros.

    Args:
        q: ``[T, H, d]``.
        keys, values: ``[G, C, d]`` the layer's cache buffers (slots written so far
            included; ``C`` a multiple of :data:`KEY_BLOCK`).
        groups: from :func:`key_groups`.
        scale: softmax scale.

    Returns:
        ``[T, H * d]`` in ``q``'s dtype; scores, softmax and the value product in float32.
    """
    t, h, d = q.shape
    g = keys.shape[0]
    out = None
    for group in groups:
        r, w = group.rows.numel(), group.width
        rows = q if group.all_rows else q.index_select(0, group.rows)
        qg = rows.view(r, g, h // g, d).float()  # [R, G, H/G, d]
        if group.index is None:  # prefix rows: the first W slots, read in place
            k, v = keys[:, :w].float(), values[:, :w].float()  # [G, W, d]
        else:
            k, v = keys[:, group.index].float(), values[:, group.index].float()  # [G, R, W, d]
        if r == 1:
            k = k.unsqueeze(0) if group.index is None else k.transpose(0, 1)
            v = v.unsqueeze(0) if group.index is None else v.transpose(0, 1)
            scores = torch.matmul(qg, k.transpose(-1, -2))  # [1, G, H/G, W]
        else:  # per KV head, R identical products (prefix rows share one key block)
            k, v = (
                [_rows_of(k, j, r, group.index is None) for j in range(g)],
                [_rows_of(v, j, r, group.index is None) for j in range(g)],
            )
            scores = torch.stack(
                [torch.bmm(qg[:, j], k[j].transpose(1, 2)) for j in range(g)], dim=1
            )
        scores.mul_(scale)
        if not group.all_valid:
            scores.masked_fill_(~group.valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if r == 1:
            result = torch.matmul(probs, v)
        else:
            result = torch.stack([torch.bmm(probs[:, j], v[j]) for j in range(g)], dim=1)
        result = result.to(q.dtype).view(r, h * d)
        if group.all_rows:
            return result
        if out is None:
            out = torch.empty((t, h * d), dtype=q.dtype, device=q.device)
        out.index_copy_(0, group.rows, result)
    return out
