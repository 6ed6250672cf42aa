"""Automatic prefix caching: prompts that share a beginning share its prompt-chunk KV.

vLLM's automatic prefix caching (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", Sec. 4.4; vLLM's ``--enable-prefix-
caching``) keeps the KV of earlier prompts in blocks keyed by the tokens up to each
block's end, so a request whose prompt starts like an earlier one (a system prompt,
few-shot examples, a document asked about several times) skips that part of its prefill.

specdec keeps specdec's promise on top: **a hit changes no bit.** The native runtime's
exact mode computes a prompt chunk's products as one product of the chunk's own rows
(see :class:`~specdec.models.base.BatchItem`), so a token's KV depends on the chunk it
was computed in. This cache therefore works in blocks of exactly one prefill chunk
(``EngineConfig.prefill_chunk``, aligned at position 0), and stores only *full* chunks
computed as prompt chunks: block ``i`` of a prompt is the KV of chunk
``[i * C, (i + 1) * C)``, computed by the same call over the same earlier KV whether the
prompt runs cold or after a hit. A hit copies those slots into the new sequence's cache
and its prefill resumes at the next chunk, exactly where a cold run's would stand; the
last, partial chunk (and the pending token) always run. So every output, logprob and
prompt logprob is the same with the cache on or off at the same ``prefill_chunk`` (tested
bit for bit), and only the chunks' compute is saved. (The chunk size itself is part of
what a prompt computes: 256-token chunks give some outputs other bits than 2048-token
ones, cache or not.) What it cannot reuse: KV that verification or decoding
computed (an earlier answer resent in a later turn's prompt runs again as a prompt
chunk, whose bits differ). A draft head reads the prompt's hidden states too
(:attr:`~specdec.engine.Sequence.captures`): a block keeps those of the layers a request
captured when it computed the chunk, and a request that captures the same layers shares
only blocks that hold them.

With ``EngineConfig.invariant_prefill`` the runtime computes prompt chunks with decoding's
batch-invariant arithmetic, so a token's KV is the same bits whatever chunk, batch or step
computed it: blocks then need not be chunks (16 tokens), and a sequence's whole KV, its
output included, is kept when it ends (or is preempted), so a conversation's next turn
reuses the previous answer and a preempted sequence is readmitted from its own blocks.
In the runtime's fast mode (``exact=False``) a hit is only as close to a cold run as any
batching is, as in vLLM (``invariant_prefill`` is refused there).

Storage is a copy (one ``[num_layers, 2, num_kv_heads, C, head_dim]`` tensor per block,
on the cache's device), not shared pages: the runtime's KV is one contiguous buffer per
sequence. Eviction is least-recently-used under a byte budget, leaves before the blocks
they extend.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class _Block:
    """One cached chunk: its KV, the block it extends (``-1``: the first) and its key."""

    kv: torch.Tensor
    parent: int
    key: tuple[int, tuple[int, ...]]
    children: set[int] = field(default_factory=set)
    hidden: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        tensors = [self.kv, *self.hidden.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """Prompt-chunk KV shared across requests, keyed by the tokens up to each chunk's end.

    Args:
        block_size: tokens per block, the engine's ``prefill_chunk`` (a block is one
            chunk, so that a hit changes no bit; see the module docstring).
        max_bytes: most bytes of KV kept (least recently used blocks are evicted first);
            0 keeps nothing.

    Attributes:
        num_queried_tokens, num_hit_tokens: prompt tokens looked up and found (vLLM's
            ``prefix_cache_queries`` / ``prefix_cache_hits`` counters).
        num_bytes: bytes of KV held now.

    Raises:
        ValueError: ``block_size`` < 1 or ``max_bytes`` < 0.
    """

    def __init__(self, block_size: int, max_bytes: int) -> None:
        for name, value, low in (("block_size", block_size, 1), ("max_bytes", max_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # oldest first
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def num_full_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks a prompt of ``num_prompt_tokens`` can share: full chunks before its last
        (pending) token."""
        return max(0, num_prompt_tokens - 1) // self.block_size

    def lookup(
        self, prompt_ids: Sequence[int], captures: tuple[int, ...] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The cached blocks that begin ``prompt_ids``, first to last.

        Args:
            prompt_ids: ``[L]`` the prompt.
            captures: the hidden-state layers the request reads (a draft head's): only
                blocks that hold them count.

        Returns:
            per block ``i`` found, its KV ``[num_layers, 2, num_kv_heads, block_size,
            head_dim]`` of slots ``[i * block_size, (i + 1) * block_size)`` and, with
            ``captures``, its hidden states ``[block_size, len(captures) * hidden_size]``
            (else ``None``); the cache's own tensors: copy, do not modify. Counted in
            ``num_queried_tokens`` / ``num_hit_tokens``.
        """
        found, parent = [], -1
        for i in range(self.num_full_blocks(len(prompt_ids))):
            block_id = self._ids.get(self._key(parent, prompt_ids, i))
            if block_id is None or (captures and captures not in self._blocks[block_id].hidden):
                break
            found.append(block_id)
            parent = block_id
        self._touch(found)
        self.num_queried_tokens += len(prompt_ids)
        self.num_hit_tokens += len(found) * self.block_size
        blocks = [self._blocks[b] for b in found]
        return [(b.kv, b.hidden[captures] if captures else None) for b in blocks]

    def insert(
        self,
        token_ids: Sequence[int],
        num_cached: int,
        read_slots,
        captures: tuple[int, ...] = (),
        hidden: torch.Tensor | None = None,
        hidden_start: int = 0,
    ) -> None:
        """Keep every full block of ``token_ids`` within its first ``num_cached`` tokens
        that is not kept yet.

        Args:
            token_ids: ``[L]`` the prompt (with ``invariant_prefill``: a sequence's
                tokens, output included).
            num_cached: its tokens whose KV the sequence's cache holds (as prompt chunks,
                or computed in any way with ``invariant_prefill``).
            read_slots: ``read_slots(start, end)`` -> a copy of the sequence's KV of
                slots ``[start, end)`` (``NativeKVCache.read_slots``).
            captures, hidden, hidden_start: the layers the request captured and ``[n,
                len(captures) * hidden_size]``, their states over the chunk of positions
                ``[hidden_start, hidden_start + n)`` that just ran (kept with the blocks
                that lie inside it).
        """
        if self.max_bytes == 0:
            return
        chain, parent = [], -1
        limit = min(num_cached, len(token_ids) - 1) // self.block_size
        for i in range(limit):
            key = self._key(parent, token_ids, i)
            block_id = self._ids.get(key)
            if block_id is None:
                kv = read_slots(i * self.block_size, (i + 1) * self.block_size)
                block_id = self._add(key, parent, kv)
            block = self._blocks[block_id]
            first, end = i * self.block_size - hidden_start, (i + 1) * self.block_size
            inside = hidden is not None and first >= 0 and end - hidden_start <= len(hidden)
            if captures and inside and captures not in block.hidden:
                before = block.num_bytes
                block.hidden[captures] = hidden[first : end - hidden_start].detach().clone()
                self.num_bytes += block.num_bytes - before
            chain.append(block_id)
            parent = block_id
        self._touch(chain)
        self._evict()

    def clear(self) -> None:
        """Drop every block."""
        self._ids.clear()
        self._blocks.clear()
        self.num_bytes = 0

    # ------------------------------------------------------------------ internals

    def _key(self, parent: int, prompt_ids: Sequence[int], i: int) -> tuple:
        size = self.block_size
        return parent, tuple(prompt_ids[i * size : (i + 1) * size])

    def _add(self, key, parent: int, kv: torch.Tensor) -> int:
        block_id = self._next_id
        self._next_id += 1
        self._blocks[block_id] = block = _Block(kv, parent, key)
        self._ids[key] = block_id
        if parent >= 0:
            self._blocks[parent].children.add(block_id)
        self.num_bytes += block.num_bytes
        return block_id

    def _touch(self, chain: list[int]) -> None:
        """Most recent use: a chain's deepest block first, so a block is always more
        recent than the blocks that extend it (eviction takes leaves first)."""
        for block_id in reversed(chain):
            self._blocks.move_to_end(block_id)

    def _evict(self) -> None:
        while self.num_bytes > self.max_bytes and self._blocks:
            self._drop(next(iter(self._blocks)))

    def _drop(self, block_id: int) -> None:
        block = self._blocks.pop(block_id)
        for child in list(block.children):  # never left unreachable
            self._drop(child)
        del self._ids[block.key]
        if block.parent in self._blocks:
            self._blocks[block.parent].children.discard(block_id)
        self.num_bytes -= block.num_bytes
