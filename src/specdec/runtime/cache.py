"""KV storage of the native runtime: one contiguous buffer per sequence, indexed by slot.

Layout (gpt-fast style): keys and values are ``[num_layers, num_kv_heads, capacity,
head_dim]`` views of one buffer; slot ``i`` holds the ``i``-th cached token, so rolling back after a
partial acceptance is moving the cursor and compaction after a token tree is one gather
along the slot axis. Same cursor rule and the same ``truncate`` / ``compact`` contract as
:class:`specdec.kv_cache.KVCache`.
"""

from __future__ import annotations

import torch

from specdec.option import env_switch
from specdec.runtime.attention import KEY_BLOCK

#: Capacity granularity: exact attention's key block.
SLOT_BLOCK = KEY_BLOCK

#: Slots from which a bfloat16 cache keeps its blocks packed for the attention kernel
#: (:meth:`NativeKVCache.pack_tiles`): the copy doubles the cache's memory, and saves
#: most at long contexts, where attention is most of a decoding step.
TILES_FROM = 2048

#: ``off`` (or ``0`` / ``false``) keeps no packed blocks (the kernel packs every block it
#: reads on every forward, as before them): for a machine short of memory.
PACKED_KV_ENV = "SPECDEC_PACKED_KV"


def packed_kv_on() -> bool:
    """Whether caches keep packed blocks (:data:`PACKED_KV_ENV`: on, off or auto/unset =
    on).

    Raises:
        ValueError: another value of the variable.
    """
    return env_switch(PACKED_KV_ENV, f"on from {TILES_FROM} tokens") is not False


def _round_up(capacity: int) -> int:
    return -(-max(1, capacity) // SLOT_BLOCK) * SLOT_BLOCK


class NativeKVCache:
    """One sequence's keys and values for every layer, with an explicit cursor.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        capacity: slots to allocate, rounded up to a multiple of :data:`SLOT_BLOCK` (the
            buffer grows, doubling, if a forward needs more).
        dtype, device: storage dtype and device (the model's).

    The buffer is zero-initialised: exact attention reads whole blocks of
    :data:`SLOT_BLOCK` slots in place and masks the unwritten ones, which must be finite.

    Packed blocks: the attention kernel over a bfloat16 cache (AVX512-BF16) packs every
    block of 64 keys it reads, on every forward, into the layout its pair dot products
    take. From :data:`TILES_FROM` tokens on, :meth:`pack_tiles` keeps a sequence's
    complete blocks packed once (``tiles``, the cache's shape), which the kernel reads
    instead: the same bytes, so the same bits. Only slots below the cursor are packed, and
    only they are final: a forward writes at the cursor and after it, and the two
    operations that change slots below it, :meth:`truncate` and :meth:`compact`, drop the
    packed blocks from the first slot they change.

    Attributes:
        kv: ``[num_layers, 2, num_kv_heads, capacity, head_dim]``: keys then values, one
            buffer so that a layer's new keys and values are written in one copy.
        keys, values: ``[num_layers, num_kv_heads, capacity, head_dim]`` views of it.
        num_tokens: slots in use (the cursor); the next write goes to this slot.
        tiles: the packed blocks (``None`` until :meth:`pack_tiles` first packs).
        tiles_upto: the slots ``tiles`` holds (a multiple of 64, at most ``num_tokens``).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, 2, num_kv_heads, _round_up(capacity), head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.num_tokens = 0
        self.tiles: torch.Tensor | None = None
        self.tiles_upto = 0

    @property
    def keys(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def values(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def capacity(self) -> int:
        """Slots allocated."""
        return self.kv.shape[3]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes over all layers (keys and values)."""
        layers, two, heads, _, head_dim = self.kv.shape
        return two * layers * heads * head_dim * self.kv.element_size()

    @torch.inference_mode()
    def reserve(self, num_tokens: int) -> None:
        """Make room for ``num_tokens`` slots in total (grows by at least doubling)."""
        if num_tokens <= self.capacity:
            return
        capacity = _round_up(max(num_tokens, 2 * self.capacity))
        old = self.kv
        self.kv = old.new_zeros((*old.shape[:3], capacity, old.shape[4]))
        self.kv[:, :, :, : self.num_tokens] = old[:, :, :, : self.num_tokens]
        if self.tiles is not None:  # a block's packed bytes sit at its own slots
            tiles, upto = self.tiles, self.tiles_upto
            self.tiles = torch.empty_like(self.kv)
            self.tiles[:, :, :, :upto] = tiles[:, :, :, :upto]

    @torch.inference_mode()
    def pack_tiles(self) -> int:
        """Pack the complete blocks of 64 slots below the cursor that are not packed yet
        (see the class docstring), for a bfloat16 cache of at least :data:`TILES_FROM`
        tokens on a CPU whose kernels read packed blocks
        (:func:`~specdec.runtime.kernels.packed_kv_available`), unless
        :data:`PACKED_KV_ENV` is ``off``; elsewhere nothing.

        Returns:
            ``tiles_upto``: the slots packed.

        Raises:
            ValueError: a bad :data:`PACKED_KV_ENV` value.
        """
        end = self.num_tokens // SLOT_BLOCK * SLOT_BLOCK
        if end - self.tiles_upto < SLOT_BLOCK or self.num_tokens < TILES_FROM:
            return self.tiles_upto
        if self.kv.dtype != torch.bfloat16 or self.kv.device.type != "cpu":
            return self.tiles_upto
        if self.kv.shape[4] not in (64, 128) or not packed_kv_on():
            return self.tiles_upto
        from specdec.runtime import kernels

        if not kernels.packed_kv_available():
            return self.tiles_upto
        if self.tiles is None:
            self.tiles = torch.empty_like(self.kv)
        kernels.pack_kv_tiles(self.kv, self.tiles, self.tiles_upto, end)
        self.tiles_upto = end
        return end

    @torch.inference_mode()
    def read_slots(self, start: int, end: int) -> torch.Tensor:
        """A copy of slots ``[start, end)`` of every layer (what the prefix cache keeps).

        Returns:
            ``[num_layers, 2, num_kv_heads, end - start, head_dim]`` in the cache's dtype.

        Raises:
            ValueError: a range outside the slots in use.
        """
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"slots [{start}, {end}) outside a cache of {self.num_tokens} tokens")
        return self.kv[:, :, :, start:end].clone()

    @torch.inference_mode()
    def append_slots(self, kv: torch.Tensor) -> None:
        """Write ``kv`` (from :meth:`read_slots`, of the same model) at the cursor and move
        the cursor past it.

        Raises:
            ValueError: a tensor of another shape or dtype than this cache's slots.
        """
        own = self.kv.shape
        if (
            kv.dim() != 5
            or kv.shape[:3] != own[:3]
            or kv.shape[4] != own[4]
            or (kv.dtype != self.kv.dtype)
        ):
            raise ValueError(
                f"KV of shape {tuple(kv.shape)} ({kv.dtype}) does not fit this cache's slots "
                f"{tuple(own[:3])} x n x {own[4]} ({self.kv.dtype})"
            )
        start, n = self.num_tokens, kv.shape[3]
        self.reserve(start + n)
        self.kv[:, :, :, start : start + n] = kv.to(self.kv.device)
        self.num_tokens = start + n

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` slots (rollback after a partial acceptance).

        Raises:
            ValueError: if ``num_tokens`` is negative or larger than what is held.
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a cache of {self.num_tokens} tokens to {num_tokens}")
        self.num_tokens = num_tokens
        self._drop_tiles_from(num_tokens)

    @torch.inference_mode()
    def compact(self, indices: torch.Tensor | list[int], start: int = 0) -> None:
        """Keep slots ``< start`` in place, then exactly ``indices`` (in that order).

        Args:
            indices: ``[n]`` slots, each in ``[start, num_tokens)`` (a token tree's
                accepted path).
            start: slots before it stay untouched.

        Raises:
            ValueError: if ``start`` or an index is out of range.
        """
        if not 0 <= start <= self.num_tokens:
            raise ValueError(f"compact start {start} outside a cache of {self.num_tokens} tokens")
        index = torch.as_tensor(indices, dtype=torch.long)
        n = index.numel()
        if n and (int(index.min()) < start or int(index.max()) >= self.num_tokens):
            raise ValueError(f"compact indices must lie in [{start}, {self.num_tokens})")
        moved = not torch.equal(index, torch.arange(start, start + n))
        if moved:
            index = index.to(self.kv.device)
            self.kv[:, :, :, start : start + n] = self.kv.index_select(3, index)
        self.num_tokens = start + n
        self._drop_tiles_from(start if moved else self.num_tokens)

    def _drop_tiles_from(self, slot: int) -> None:
        """Forget the packed blocks from the one holding ``slot`` on (slots that change)."""
        self.tiles_upto = min(self.tiles_upto, slot // SLOT_BLOCK * SLOT_BLOCK)
