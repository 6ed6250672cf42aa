"""A KV cache with an explicit cursor: append, truncate(n), compact(indices).

Storage is preallocated per layer (``[batch, kv_heads, capacity, head_dim]``) and indexed by
position, so rolling back after a partial acceptance is moving an integer (gpt-fast style),
not copying tensors. The class plugs into transformers' ``Cache`` interface, so any
transformers causal LM that accepts ``past_key_values`` can use it.

Cursor rule (see the architecture guide): after every decoding step the cache holds every
token of the sequence except the last one, which is *pending* and is the first input of the
next step. The engine maintains it with :meth:`KVCache.truncate`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _BufferLayer(DynamicLayer):
    """One layer's keys/values in a growable preallocated buffer; ``length`` is the cursor."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self.length = 0
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        capacity = max(self.capacity, key_states.shape[-2])
        self._key_buf = key_states.new_empty(
            (*key_states.shape[:-2], capacity, key_states.shape[-1])
        )
        self._value_buf = value_states.new_empty(
            (*value_states.shape[:-2], capacity, value_states.shape[-1])
        )
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._key_buf.shape[-2]:
            self._grow(end)
        self._key_buf[..., self.length : end, :] = key_states
        self._value_buf[..., self.length : end, :] = value_states
        self.set_length(end)
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._key_buf.shape[-2])
        for name in ("_key_buf", "_value_buf"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:-2], capacity, old.shape[-1]))
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def set_length(self, length: int) -> None:
        self.length = length
        if self._key_buf is not None:
            self.keys = self._key_buf[..., :length, :]
            self.values = self._value_buf[..., :length, :]

    def gather(self, indices: torch.Tensor, start: int = 0) -> None:
        if self._key_buf is None:
            return
        end = start + indices.numel()
        self._key_buf[..., start:end, :] = self._key_buf.index_select(-2, indices)
        self._value_buf[..., start:end, :] = self._value_buf.index_select(-2, indices)
        self.set_length(end)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.set_length(max(0, self.length - abs(tokens_to_remove)))

    def reset(self) -> None:
        self.set_length(0)


class KVCache(Cache):
    """Per-sequence KV cache with an explicit cursor (``num_tokens``).

    Args:
        num_layers: number of attention layers of the model it serves.
        capacity: tokens to preallocate per layer (grows by doubling if exceeded).

    Shapes: each layer stores ``[batch, num_kv_heads, capacity, head_dim]`` in the model's
    dtype; ``keys``/``values`` are views of the first ``num_tokens`` positions.
    """

    def __init__(self, num_layers: int, capacity: int = 256) -> None:
        super().__init__(layers=[_BufferLayer(capacity) for _ in range(num_layers)])

    @property
    def num_tokens(self) -> int:
        """Tokens held (the cursor): the next write goes to this position."""
        return self.layers[0].length if self.layers else 0

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` positions (rollback after partial acceptance).

        Raises:
            ValueError: if ``num_tokens`` is negative or larger than what is held.
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a cache of {self.num_tokens} tokens to {num_tokens}")
        for layer in self.layers:
            layer.set_length(num_tokens)

    @torch.inference_mode()
    def compact(self, indices: torch.Tensor | list[int], start: int = 0) -> None:
        """Keep positions ``< start`` untouched, then exactly ``indices`` (in that order).

        Used after tree verification, where the accepted path is scattered over the
        verified nodes: ``start`` is the first tree position and ``indices`` the accepted
        nodes' positions, so only the tree part is copied (not the whole sequence).

        Args:
            indices: ``[n]`` int64 absolute positions, each in ``[start, num_tokens)``.
            start: positions before it are kept in place (0 = gather everything).

        Raises:
            ValueError: if ``start`` or an index is out of range.
        """
        if not 0 <= start <= self.num_tokens:
            raise ValueError(f"compact start {start} outside a cache of {self.num_tokens} tokens")
        if not isinstance(indices, torch.Tensor) and list(indices) == list(
            range(start, start + len(indices))
        ):  # already in place (e.g. the first-child path of a tree): just move the cursor
            self.truncate(start + len(indices))
            return
        device = self.layers[0].device if self.layers and self.layers[0].is_initialized else "cpu"
        indices = torch.as_tensor(indices, dtype=torch.long, device=device)
        if indices.numel() and (
            int(indices.min()) < start or int(indices.max()) >= self.num_tokens
        ):
            raise ValueError(
                f"compact indices must lie in [{start}, {self.num_tokens}) for this cache"
            )
        for layer in self.layers:
            layer.gather(indices, start)
