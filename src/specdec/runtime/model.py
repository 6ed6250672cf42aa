"""The native forward of a Llama-family decoder (gpt-fast / nano-vllm style): explicit
positions, our own KV storage, no transformers modules in the hot path.

One forward runs a *ragged batch*: several sequences, each with a chain of new tokens or a
token tree, flattened into one ``[sum T_i, D]`` activation so that every matrix product
reads the weights once for all of them; attention then runs per sequence over its own KV
cache (:mod:`specdec.runtime.attention`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models.base import BatchItem, ForwardOutput, check_capture
from specdec.runtime.attention import (
    Visibility,
    attention_exact,
    attention_fast,
    key_groups,
    visibility_mask,
)
from specdec.runtime.cache import NativeKVCache, packed_kv_on
from specdec.runtime.kernels import (
    add_rms_norm,
    decode_layer,
    decode_layers,
    kernel_available,
    prompt_attention,
    prompt_attention_available,
    ragged_attention,
    rms_norm,
    rotary_kv,
    silu_mul,
)
from specdec.runtime.linear import BUCKETS, KernelChoice, Linear, kernel_choices
from specdec.runtime.prefill import BLOCKED_HEAD_DIMS, PrefillPlan, prefill_plan
from specdec.runtime.quant import QuantLinear, quant_kernel_choices
from specdec.runtime.weights import ModelWeights

#: Fast mode: a sequence with at most this many new rows (after its prefill) goes through
#: the attention kernel; longer chunks through one ``scaled_dot_product_attention``.
KERNEL_ROWS = 64

#: Run a layer of decoding / verification rows as one call into the extension
#: (:func:`~specdec.runtime.kernels.decode_layer`) where its products are quantized
#: (``fma``, ``q8``, ``dpbf16`` or ``amx`` kernel, no bias, no query/key norms) or dense on
#: specdec's tile formulations (:data:`_DENSE_KERNELS`), and all the layers of such a
#: forward in one call (:func:`~specdec.runtime.kernels.decode_layers`) where every layer
#: qualifies and no hidden state is captured: the same functions in the same order as
#: :meth:`NativeDecoder._fused_layer`, so the same bits (tested), without about a dozen
#: Python calls and tensor allocations per layer. ``False`` runs them from Python.
FUSED_DECODE_LAYER = True

#: Exact mode: prompt chunks shorter than this many rows share one forward (see
#: :func:`_prefill_groups`); longer ones run as forwards of their own. Measured on the
#: embedded model (Q4_1 on the ``amx`` kernel, bf16, 2 threads, Xeon with AMX), per chunk
#: alone against 4-16 chunks together: 32 rows 43 -> 26 ms, 64 rows 55 -> 40 ms, 128 rows
#: 80 -> 69 ms, 256 rows 134 -> 130 ms, 512 rows 233 -> 248 ms.
PREFILL_GROUP_ROWS = 256


#: Dense formulations the fused decoding layers run: name -> (kernel code, tile kind) of
#: ``decode_layer`` (see :mod:`specdec.runtime.linear`).
_DENSE_KERNELS = {"dpbf16": (2, 2), "f32_tiles": (3, 0), "amx": (4, 2)}

#: Kernel codes of ``decode_layer`` for quantized products (``csrc/attention.cpp``).
_QUANT_KERNELS = {"fma": 0, "q8": 1, "dpbf16": 2, "amx": 4}


class NativeDecoder:
    """Runs :class:`ModelWeights` (see :mod:`specdec.runtime.weights`).

    Args:
        weights: the fused weights.
        exact: default mode of :meth:`forward` (batch-invariant products and attention).
        choices: a :class:`KernelChoice` per product name (``qkv``, ``o``, ``gate_up``,
            ``down``, ``lm_head``); measured (or read from the on-disk table) when ``None``.
        prefill: when prompt chunks of a 16-bit model compute in float32
            (:mod:`specdec.runtime.prefill`); measured (or read from the on-disk table)
            when ``None``.
        quant_kernels: the kernel of each quantized product (``{product: "fma" | "amx" |
            "dpbf16" | "q8"}``, e.g. a quantized self-draft's own); measured (see
            :func:`~specdec.runtime.quant.quant_kernel_choices`) when ``None``.

    Raises:
        ValueError: a bad ``SPECDEC_PACKED_KV``
            (:data:`~specdec.runtime.cache.PACKED_KV_ENV`).
    """

    def __init__(
        self,
        weights: ModelWeights,
        exact: bool = True,
        choices: dict[str, KernelChoice] | None = None,
        prefill: PrefillPlan | None = None,
        quant_kernels: dict[str, str] | None = None,
    ) -> None:
        packed_kv_on()  # a bad SPECDEC_PACKED_KV is refused at load, not mid-generation
        self.weights = weights
        self.config = cfg = weights.config
        self.exact = exact
        layers = weights.layers
        products = {
            "qkv": [w.qkv for w in layers], "o": [w.o for w in layers],
            "gate_up": [w.gate_up for w in layers], "down": [w.down for w in layers],
            "lm_head": [weights.lm_head],
        }  # fmt: skip
        quantized = weights.quantized or {}
        dense = {name: ws for name, ws in products.items() if name not in quantized}
        self.choices = choices or (kernel_choices(dense) if dense else {})
        self.dtype = weights.embed.dtype
        #: the kernel of each quantized product (measured once, see quant_kernel_choices)
        self.quant_kernels = quant_kernels or (
            quant_kernel_choices(quantized, self.dtype) if quantized else {}
        )

        def linear(name: str, index: int, weight, bias):
            if name in quantized:
                return QuantLinear(
                    quantized[name][index], bias, self.dtype, self.quant_kernels[name]
                )
            return Linear(weight, bias, self.choices[name])

        self.layers = [
            {
                "qkv": linear("qkv", i, w.qkv, w.qkv_bias),
                "o": linear("o", i, w.o, w.o_bias),
                "gate_up": linear("gate_up", i, w.gate_up, None),
                "down": linear("down", i, w.down, None),
            }
            for i, w in enumerate(weights.layers)
        ]
        self.lm_head = linear("lm_head", 0, weights.lm_head, None)
        self._decode_specs = {
            mode: [self._decode_spec(i, mode) for i in range(len(self.layers))]
            for mode in (True, False)
        }
        self._fused_cache: dict[tuple, tuple | None] = {}  # (exact, *layers)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.device = weights.embed.device
        self.use_kernel = kernel_available(self.device)
        # the blocked prompt kernel's shapes (see runtime.prefill)
        self._blocked_prompts = (
            self.use_kernel
            and self.dtype == torch.bfloat16
            and cfg.head_dim in BLOCKED_HEAD_DIMS
            and prompt_attention_available()
        )
        self.prefill_plan = prefill or self._measure_prefill(quantized)
        self._cos = self._sin = torch.empty(0)

    def _measure_prefill(self, quantized: dict) -> PrefillPlan:
        """:func:`~specdec.runtime.prefill.prefill_plan` timed on the first layer's products."""
        cfg = self.config
        width = {"qkv": cfg.hidden_size, "o": cfg.num_heads * cfg.head_dim,
                 "gate_up": cfg.hidden_size, "down": cfg.intermediate_size}  # fmt: skip
        first = self.layers[0] if self.layers else {}
        products = [(first[name].prefill, k) for name, k in width.items() if name in first]
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        kinds = {name: m[0].kind for name, m in quantized.items()}
        kernels = {name: first[name].kernel for name in width
                   if isinstance(first.get(name), QuantLinear)}  # fmt: skip
        model_key = ";".join(
            [f"{name}={k}:{kinds.get(name, 'dense')}" for name, k in width.items()]
            + [f"heads={'x'.join(map(str, heads))}"]
            + [f"kernel={'/'.join(sorted(set(kernels.values())))}"] * bool(kernels)
        )
        present = [name for name in width if name in first]
        on_kernel = [first[name] for name in present] if present and all(
            name in kernels for name in present
        ) else None  # fmt: skip
        return prefill_plan(
            products, heads, self.dtype, self.device, model_key, on_kernel, self.use_kernel
        )

    def new_cache(self, capacity: int) -> NativeKVCache:
        """An empty cache for one sequence (``capacity`` slots; grows if needed)."""
        cfg = self.config
        return NativeKVCache(
            len(self.layers), cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device
        )

    def forward(
        self,
        items: Sequence[BatchItem],
        exact: bool | None = None,
        layers: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """One forward over a ragged batch; per item, ``[T or num_logits, vocab_size]``
        float32 logits. See :meth:`forward_full` for the arguments."""
        return [out.logits for out in self.forward_full(items, exact, layers)]

    @torch.inference_mode()
    def forward_full(
        self,
        items: Sequence[BatchItem],
        exact: bool | None = None,
        layers: Sequence[int] | None = None,
        capture: Sequence[int] = (),
    ) -> list[ForwardOutput]:
        """One forward over a ragged batch, with hidden states.

        Args:
            items: the sequences (each with its own cache; no cache twice).
            exact: batch-invariant mode (default: the decoder's ``exact``).
            layers: the decoder layers to run, in increasing order (default: all). A
                prefix ``range(L)`` is early exit after L layers; any subset is a
                layer-skip forward (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et al.
                2025). The final norm and LM head apply after the last layer run. Only
                the run layers write the new tokens' keys and values; the cursor moves
                past the tokens all the same, so a drafting pass is rolled back with
                ``truncate`` before the full forward verifies (and rewrites) them.
            capture: hidden-state indices to return for every row (``0`` = embedding,
                ``i`` = input of layer ``i``, ``num_layers`` = final-normed; see
                :attr:`~specdec.models.base.ForwardOutput.captured`); all layers only.

        Returns:
            per item, a :class:`ForwardOutput`: ``logits`` ``[n, vocab_size]`` float32,
            ``hidden`` ``[n, hidden_size]`` (the model dtype), n = ``num_logits`` or T, and
            ``captured`` ``[T, len(capture) * hidden_size]`` (``None`` without ``capture``).

        Raises:
            ValueError: empty tokens, positions / tree_mask of the wrong shape, layers
                out of range or not increasing, capture indices outside ``0..num_layers``
                or given with ``layers``.
        """
        exact = self.exact if exact is None else exact
        order = self._layer_order(layers)
        capture = check_capture(capture, len(self.layers))
        if capture and layers is not None:
            raise ValueError("capture needs every layer (layers=None)")
        if exact and len(items) > 1:
            groups = _prefill_groups(items)
            if len(groups) > 1:  # see _prefill_groups
                out: list[ForwardOutput | None] = [None] * len(items)
                for group in groups:
                    results = self.forward_full([items[i] for i in group], exact, layers, capture)
                    for i, result in zip(group, results, strict=True):
                        out[i] = result
                return out  # type: ignore[return-value]
        wanted = set(capture)
        kept: dict[int, torch.Tensor] = {}
        plans = [self._plan(item) for item in items]
        ids = torch.cat([p.ids for p in plans])
        positions = torch.cat([p.positions for p in plans])
        cos, sin = self._rotary(positions)
        x = self.weights.embed.index_select(0, ids)
        kernel = self._kernel_rows(plans, exact)
        pending = None  # with the kernels: the last layer's output, not yet added to x
        segments = _capture_segments(list(order), wanted) if wanted else [list(order)]
        fused = [self._fused_layers(seg, kernel, x.shape[0], exact) for seg in segments]
        if all(f is not None for f in fused):  # every layer in one call per segment
            for seg, lists in zip(segments, fused, strict=True):
                if pending is not None:
                    x, pending = x + pending, None  # the bits add_rms_norm's sum has
                if seg[0] in wanted:  # the residual stream entering a captured layer
                    kept[seg[0]] = x
                x, pending = decode_layers(
                    x, cos, sin, kernel.caches, seg, kernel.store_seq, kernel.store_slot,
                    kernel.row_seq, kernel.row_n, kernel.row_off, kernel.slots, self.scale,
                    self.config.num_heads, *lists, self.config.rms_eps, kernel.tiles,
                    kernel.tiles_upto,
                )  # fmt: skip
            order = ()
        for index in order:
            if kernel is None:
                if index in wanted:
                    kept[index] = x
                x = self._layer(index, self.layers[index], x, cos, sin, plans, exact)
                continue
            norm = self.weights.layers[index].attn_norm
            if pending is None:
                normed = rms_norm(x, norm, self.config.rms_eps)
            else:
                x, normed = add_rms_norm(x, pending, norm, self.config.rms_eps)
            if index in wanted:
                kept[index] = x
            x, pending = self._fused_layer(index, x, normed, cos, sin, plans, exact, kernel)
        if pending is not None:
            x = x + pending
        if len(self.layers) in wanted:
            kept[len(self.layers)] = _rms_norm(x, self.weights.norm, self.config.rms_eps)
        captured = (
            torch.cat([kept[i] for i in capture], dim=-1).split([p.length for p in plans])
            if capture
            else [None] * len(plans)
        )
        rows, offset = [], 0
        for p in plans:  # the last num_logits rows of each sequence
            rows.append(torch.arange(offset + p.length - p.num_logits, offset + p.length))
            offset += p.length
            p.item.cache.num_tokens = p.start + p.length
            pack = getattr(p.item.cache, "pack_tiles", None)
            if p.prefill and pack is not None:
                # a long prompt's blocks packed as it is read, not by the first decoding
                # forward: that work (28-32 ms at 8k tokens on a 2-core Zen 4, 186 ms
                # when the packed copy's pages are first touched) is the prompt's, and in
                # a first draft or plain step it was counted as decoding's
                pack()
        index = torch.cat(rows).to(self.device)
        hidden = _rms_norm(x.index_select(0, index), self.weights.norm, self.config.rms_eps)
        sizes = [p.num_logits for p in plans]
        hiddens = hidden.split(sizes)
        if all(p.item.lm_head is None for p in plans):
            logits = self.lm_head(hidden, exact).float().split(sizes)
        else:  # an item's own head (a draft vocabulary) on its rows
            logits = [
                (p.item.lm_head or self.lm_head)(h, exact).float()
                for p, h in zip(plans, hiddens, strict=True)
            ]
        return [ForwardOutput(lg, h, c) for lg, h, c in zip(logits, hiddens, captured, strict=True)]

    def vocab_head(self, ids: torch.Tensor) -> Linear | QuantLinear:
        """An LM head over the vocabulary rows ``ids`` only: the model's own head (the
        same kernel; quantized blocks stay quantized) restricted to those rows, so its
        logits are ``[n, len(ids)]``, column ``j`` the logit of token ``ids[j]``, computed
        as the full head computes it. A draft over a subset of the vocabulary reads
        ``len(ids) / vocab_size`` of the head's bytes (FR-Spec, Zhao et al. 2025,
        arXiv:2502.14856: the LM head is the largest single product of a small model's
        draft step). ``len(ids)`` a multiple of 8 reads fastest on the ``q8`` kernel.

        Args:
            ids: ``[m]`` distinct token ids in ``[0, vocab_size)``, int64, m >= 1.

        Raises:
            ValueError: ``ids`` empty, not 1-D, repeated or out of range.
        """
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        vocab = self.config.vocab_size
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"ids must lie in [0, {vocab})")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("ids must be distinct")
        head = self.lm_head
        if isinstance(head, QuantLinear):
            return QuantLinear(head.matrix.rows(ids), None, self.dtype, head.kernel)
        return Linear(head.weight.index_select(0, ids).contiguous(), None, head.choice)

    def _layer_order(self, layers: Sequence[int] | None) -> Sequence[int]:
        n = len(self.layers)
        if layers is None:
            return range(n)
        order = [int(i) for i in layers]
        if not order or any(not 0 <= i < n for i in order) or order != sorted(set(order)):
            raise ValueError(
                f"layers must be increasing indices in [0, {n}) (at least one), got {layers}"
            )
        return order

    # ----------------------------------------------------------------- internals

    def _plan(self, item: BatchItem) -> _Plan:
        ids = torch.as_tensor(item.token_ids, dtype=torch.long, device=self.device).view(-1)
        t = ids.numel()
        if t == 0:
            raise ValueError("a forward needs at least one token per sequence")
        cache = item.cache
        start = cache.num_tokens
        cache.reserve(start + t)
        if item.positions is None:
            positions = torch.arange(start, start + t, device=self.device)
        else:
            positions = torch.as_tensor(item.positions, dtype=torch.long, device=self.device)
            if positions.shape != (t,):
                raise ValueError(f"{positions.numel()} positions for {t} tokens")
        visible = _visibility(item.tree_mask, start, t, self.device, item.kv_window)
        n = t if item.num_logits <= 0 else min(item.num_logits, t)
        return _Plan(item, ids, positions, visible, start, t, n)

    def _layer(self, index, layer, x, cos, sin, plans, exact):
        """One decoder layer in PyTorch operations, attention per sequence (the reference
        path, used without the compiled kernels)."""
        cfg = self.config
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        w = self.weights.layers[index]
        upcast = self.prefill_plan
        qkv = _product(layer["qkv"], _rms_norm(x, w.attn_norm, cfg.rms_eps), plans, exact, upcast)
        qk, v = qkv.split([(h + g) * d, g * d], dim=-1)
        qk = _head_norms(qk.reshape(-1, h + g, d), w, h, cfg.rms_eps)
        qk = _rotate(qk, cos.unsqueeze(1), sin.unsqueeze(1))  # queries and keys in one go
        q = qk[:, :h]
        kv_new = torch.cat([qk[:, h:], v.view(-1, g, d)], dim=1).view(-1, 2, g, d)
        row = 0
        for p in plans:  # the new keys and values into each sequence's cache
            p.item.cache.kv[index][:, :, p.start : p.start + p.length] = kv_new[
                row : row + p.length
            ].permute(1, 2, 0, 3)
            row += p.length
        outputs, row = [], 0
        for p in plans:
            outputs.append(self._sequence_attention(index, q[row : row + p.length], p, exact))
            row += p.length
        attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        x = x + _product(layer["o"], attn, plans, exact, upcast)
        normed = _rms_norm(x, w.mlp_norm, cfg.rms_eps)
        gate, up = _product(layer["gate_up"], normed, plans, exact, upcast).chunk(2, dim=-1)
        return x + _product(layer["down"], F.silu(gate) * up, plans, exact, upcast)

    def _decode_spec(self, index: int, exact: bool):
        """``(blocks, codes, kernels, rows)`` of layer ``index``'s four products for
        :func:`decode_layer` in ``exact`` or fast mode (``kernels``: 0 ``fma``, 1 ``q8``, 2
        ``dpbf16``, 3 ``f32_tiles``, 4 ``amx``; ``rows``: the most rows one call of each
        computes the way that mode computes them), or ``None`` where a product runs
        elsewhere: a dense product on another formulation than :data:`_DENSE_KERNELS` (in
        fast mode, for every row-count bucket up to ``rows``) or padded to two rows, tiles
        with N not a multiple of 16, a bias, or a layer with query/key norms."""
        layer = self.layers[index]
        parts = [layer[name] for name in ("qkv", "o", "gate_up", "down")]
        if self.weights.layers[index].q_norm is not None or any(p.bias is not None for p in parts):
            return None
        blocks, kinds, kernels, rows = [], [], [], []
        for p in parts:
            if isinstance(p, QuantLinear):
                tiled = p.kernel in ("dpbf16", "amx")
                if p.kernel not in _QUANT_KERNELS or (tiled and p.matrix.shape[0] % 16):
                    return None
                blocks.append(p.layout[0])
                kinds.append(int(p.layout[1]))
                kernels.append(_QUANT_KERNELS[p.kernel])
                rows.append(p.tile)
                continue
            name = p.choice.exact if exact else p.choice.fast[0]
            tiles = p.prepared.get(name)
            if name not in _DENSE_KERNELS or tiles.n % 16:
                return None
            if exact:
                if p.choice.min_rows != 1:
                    return None
                rows.append(p.choice.tile)
            else:  # the buckets whose fast formulation is this one on their own rows
                fast = p.choice.fast_rows or [0] * len(BUCKETS)
                run = 0
                for bucket, other, pad in zip(BUCKETS, p.choice.fast, fast, strict=True):
                    if other != name or pad:
                        break
                    run = bucket
                if not run:
                    return None
                rows.append(run)
            blocks.append(tiles.packed if name == "amx" else tiles.tiles)
            kinds.append(_DENSE_KERNELS[name][1])
            kernels.append(_DENSE_KERNELS[name][0])
        return blocks, kinds, kernels, min(rows)

    def _fused_layers(self, order, kernel, rows: int, exact: bool):
        """The per-layer lists :func:`decode_layers` takes for the layers ``order``
        (``blocks, codes, kernels, attn_norms, mlp_norms``; built once per order), or ``None``
        where the forward cannot run them in one call: fused layers off, a layer without
        a :meth:`_decode_spec`, a row outside the attention kernel (a prompt chunk), or
        more rows than a product computes at once with the bits of one row."""
        if not FUSED_DECODE_LAYER or kernel is None or not kernel.every:
            return None
        key = (exact, *order)
        if key not in self._fused_cache:
            specs = [self._decode_specs[exact][i] for i in order]
            if any(spec is None for spec in specs):
                self._fused_cache[key] = None
            else:
                self._fused_cache[key] = (
                    [b for spec in specs for b in spec[0]],
                    [c for spec in specs for c in spec[1]],
                    [f for spec in specs for f in spec[2]],
                    [self.weights.layers[i].attn_norm for i in order],
                    [self.weights.layers[i].mlp_norm for i in order],
                    min(spec[3] for spec in specs),
                )
        fused = self._fused_cache[key]
        if fused is None or rows > fused[5]:
            return None
        return fused[:5]

    def _fused_layer(self, index, x, normed, cos, sin, plans, exact, kernel):
        """One decoder layer with the compiled kernels (:mod:`specdec.runtime.kernels`):
        ``normed`` is ``x`` after the attention norm; returns ``(x + attention output,
        MLP output)``, the sum left to the next layer's :func:`add_rms_norm`."""
        cfg = self.config
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        w = self.weights.layers[index]
        spec = self._decode_specs[exact][index]
        if FUSED_DECODE_LAYER and spec is not None and kernel.every and x.shape[0] <= spec[3]:
            return decode_layer(
                x, normed, cos, sin, kernel.caches, index, kernel.store_seq, kernel.store_slot,
                kernel.row_seq, kernel.row_n, kernel.row_off, kernel.slots, self.scale, h,
                spec[0], spec[1], spec[2], w.mlp_norm, cfg.rms_eps, kernel.tiles,
                kernel.tiles_upto,
            )  # fmt: skip
        layer = self.layers[index]
        qkv = _rows(_product(layer["qkv"], normed, plans, exact, self.prefill_plan))
        if w.q_norm is not None:
            qk, v = qkv.split([(h + g) * d, g * d], dim=-1)
            qk = _head_norms(qk.reshape(-1, h + g, d), w, h, cfg.rms_eps)
            qkv = torch.cat([qk.reshape(qk.shape[0], -1), v], dim=-1)
        q = rotary_kv(qkv, cos, sin, kernel.caches, index, kernel.store_seq, kernel.store_slot, h)
        attn = torch.empty((q.shape[0], h * d), dtype=q.dtype, device=q.device)
        if kernel.rows:  # the kernel's rows of every sequence in one call
            ragged_attention(
                q, kernel.caches, index, kernel.row_seq, kernel.row_n, kernel.row_off,
                kernel.slots, self.scale, attn, kernel.tiles, kernel.tiles_upto,
            )  # fmt: skip
        row = 0
        for p in plans:  # the rest (prefill chunks): per sequence
            if not p.kernel:
                attn[row : row + p.length] = self._sequence_attention(
                    index, q[row : row + p.length], p, exact
                )
            row += p.length
        o = _rows(_product(layer["o"], attn, plans, exact, self.prefill_plan))
        x, normed = add_rms_norm(x, o, w.mlp_norm, cfg.rms_eps)
        gate_up = _rows(_product(layer["gate_up"], normed, plans, exact, self.prefill_plan))
        return x, _rows(_product(layer["down"], silu_mul(gate_up), plans, exact, self.prefill_plan))

    def _sequence_attention(self, index: int, q: torch.Tensor, p: _Plan, exact: bool):
        """One sequence's attention (its new keys already in its cache): a long bfloat16
        prompt chunk on the blocked prompt kernel where the prefill plan says so; exact
        after its prefill; else one ``scaled_dot_product_attention`` (in float32 for a
        prompt chunk where the prefill plan says so)."""
        kv = p.item.cache.kv[index]
        if (
            self._blocked_prompts
            and p.prefill
            and p.causal
            and self.prefill_plan.blocked_attention(p.length)
        ):  # see runtime.prefill
            return prompt_attention(
                q.contiguous(), p.item.cache.kv, index, p.start, self.scale,
                self.prefill_plan.blocked_amx,
            )  # fmt: skip
        if exact and not p.prefill:
            return attention_exact(q, kv[0], kv[1], p.attention(exact), self.scale)
        filled = p.start + p.length
        keys, values = kv[0, :, :filled], kv[1, :, :filled]
        if p.prefill and self.prefill_plan.attention(p.length):  # see runtime.prefill
            out = attention_fast(
                q.float(), keys.float(), values.float(), p.attention(exact), self.scale
            )
            return out.to(q.dtype)
        return attention_fast(q, keys, values, p.attention(exact), self.scale)

    def _kernel_rows(self, plans, exact: bool) -> _KernelRows | None:
        """What the kernels need about this forward's rows (built once per forward, for
        every layer); ``None`` without the kernels. A long sequence's cache first packs
        its new complete blocks for the attention kernel to read
        (:meth:`~specdec.runtime.cache.NativeKVCache.pack_tiles`). Attention rows: in
        exact mode every row after a sequence's prefill (the kernel is batch-invariant by
        construction); in fast mode those of sequences with at most :data:`KERNEL_ROWS`
        new rows (longer chunks are faster as one ``scaled_dot_product_attention``); and
        prompt chunks where the prefill plan measured the kernel faster
        (:attr:`~specdec.runtime.prefill.PrefillPlan.kernel_attention_to`; the same call
        for the same chunk, so the same bits alone or in any batch). ``every``: every row
        on the kernel and no prompt chunk (a chunk's products are its own, see
        :func:`_product`, so the fused decoding layers never take one)."""
        if not self.use_kernel:
            return None
        seq, slot, row_seq, n, off, slots, used = [], [], [], [], [], [], 0
        packed = []
        for s, p in enumerate(plans):
            if p.prefill:
                p.kernel = self.prefill_plan.kernel_attention(p.length)
            else:
                p.kernel = exact or p.length <= KERNEL_ROWS
            pack = getattr(p.item.cache, "pack_tiles", None)
            packed.append(pack() if p.kernel and not p.prefill and pack is not None else 0)
            seq += [s] * p.length
            slot += range(p.start, p.start + p.length)
            for v in p.visible:
                row_seq.append(s if p.kernel else -1)
                if isinstance(v, int):
                    n.append(v)
                    off.append(-1)
                else:
                    n.append(v.numel())
                    off.append(used)
                    slots.append(v.cpu())
                    used += v.numel()
        return _KernelRows(
            [p.item.cache.kv for p in plans],
            torch.tensor(seq, dtype=torch.long),
            torch.tensor(slot, dtype=torch.long),
            any(p.kernel for p in plans),
            all(p.kernel and not p.prefill for p in plans),
            torch.tensor(row_seq, dtype=torch.long),
            torch.tensor(n, dtype=torch.long),
            torch.tensor(off, dtype=torch.long),
            torch.cat(slots) if slots else torch.empty(0, dtype=torch.long),
            [
                p.item.cache.tiles if upto else p.item.cache.kv
                for p, upto in zip(plans, packed, strict=True)
            ]
            if any(packed)
            else [],
            torch.tensor(packed, dtype=torch.long),
        )

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, d]`` for the positions (a table grown on demand, as transformers
        computes them: float32 ``pos * inv_freq``, then cast to the model dtype)."""
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], 256)
            cfg = self.config
            pos = torch.arange(size, dtype=torch.float32)
            freqs = pos[:, None] * cfg.inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            sign = torch.ones(emb.shape[-1])
            sign[: emb.shape[-1] // 2] = -1.0  # rotate_half negates the second half
            self._cos = (emb.cos() * cfg.rope_scale).to(self.dtype).to(self.device)
            self._sin = (emb.sin() * cfg.rope_scale * sign).to(self.dtype).to(self.device)
        return self._cos[positions], self._sin[positions]


@dataclass
class _KernelRows:
    """One forward's rows for :mod:`specdec.runtime.kernels` (see their arguments)."""

    caches: list[torch.Tensor]
    store_seq: torch.Tensor
    store_slot: torch.Tensor
    rows: bool  # any row's attention runs in the kernel
    every: bool  # every row's attention runs in the kernel, and no row is a prompt chunk
    row_seq: torch.Tensor
    row_n: torch.Tensor
    row_off: torch.Tensor
    slots: torch.Tensor
    tiles: list[torch.Tensor]  # per sequence its packed blocks (empty: none packed)
    tiles_upto: torch.Tensor  # per sequence the slots packed


@dataclass
class _Plan:
    item: BatchItem
    ids: torch.Tensor
    positions: torch.Tensor
    visible: list[Visibility]
    start: int
    length: int
    num_logits: int
    _attention: object = None
    kernel: bool = False

    @property
    def prefill(self) -> bool:
        """A prompt chunk (:attr:`BatchItem.prefill`; by default a sequence's first
        forward, empty cache and causal): its attention runs the fast path and its
        products run as one product of their own (see :func:`_product`), even in exact
        mode. Every run of the same prompt makes this same call, so it gives the same
        bits; exact mode is about rows computed in different shapes across runs (decoding
        vs verification), which all come after it."""
        return _is_prefill(self.item, self.start)

    @property
    def causal(self) -> bool:
        """Row ``i`` sees slots ``0 .. start + i`` (no token tree, no KV window)."""
        return self.item.tree_mask is None and self.item.kv_window is None

    def attention(self, exact: bool):
        """What attention needs about visibility, built once per forward for all layers."""
        if self._attention is None:
            device = self.ids.device
            if exact and not self.prefill:
                self._attention = key_groups(self.visible, device)
            else:
                self._attention = visibility_mask(self.visible, self.start + self.length, device)
        return self._attention


def _is_prefill(item: BatchItem, start: int) -> bool:
    """:attr:`_Plan.prefill` of ``item`` whose rows start at cache slot ``start``."""
    if item.prefill is not None:
        return bool(item.prefill)
    return start == 0 and item.tree_mask is None


def _capture_segments(order: list[int], wanted: set[int]) -> list[list[int]]:
    """``order`` cut before every captured layer, so that :func:`decode_layers` runs each
    piece in one call and the residual stream entering a captured layer is at hand between
    two calls (EAGLE-3 reads 3 layers: 4 calls a forward instead of 30 layer by layer)."""
    segments: list[list[int]] = []
    for index in order:
        if not segments or index in wanted:
            segments.append([])
        segments[-1].append(index)
    return segments


def _prefill_groups(items: Sequence[BatchItem]) -> list[list[int]]:
    """Exact mode: the forwards a ragged batch runs as (indices into ``items``): every
    decoding or verification row together, the prompt chunks shorter than
    :data:`PREFILL_GROUP_ROWS` rows together, and each longer chunk on its own.

    Exact mode computes a prompt chunk's products as one product of its own anyway (see
    :func:`_product`), so running a long chunk in a shared forward only adds the cost of
    gathering every chunk's products back into one activation (measured on 8 prompts of
    about 800 tokens, bf16, 2 threads: 14% of the forward). Short chunks cost mostly the
    forward's per-layer calls, which a shared forward pays once for all of them (the
    measurements at :data:`PREFILL_GROUP_ROWS`). Every row other than a chunk's products
    is computed by row-invariant products and per-row kernels, so the bits are the same
    in any grouping (tested)."""
    chunks = [i for i, item in enumerate(items) if _is_prefill(item, item.cache.num_tokens)]
    if not chunks:
        return [list(range(len(items)))]
    rest = [i for i in range(len(items)) if i not in chunks]
    short = [i for i in chunks if len(items[i].token_ids) < PREFILL_GROUP_ROWS]
    long = [[i] for i in chunks if len(items[i].token_ids) >= PREFILL_GROUP_ROWS]
    return [group for group in (rest, short) if group] + long


def _visibility(tree_mask, start: int, t: int, device, window=None) -> list[Visibility]:
    """Per new row: a prefix length (causal) or the slots it sees (tree, or a KV window).

    ``window = (sinks, recent[, align])`` (:attr:`BatchItem.kv_window`) is StreamingLLM's
    rolling window: of the slots a row would see without it (its *path*: the context, then
    its own ancestors and itself), it keeps the first ``sinks`` and the last ``recent + 1``
    (the ``recent`` before it and itself), extended back to the nearest path position
    ``sinks + m * align`` (``align`` 1 by default: exactly ``recent + 1``). A row forwarded
    alone after ``n`` cached slots therefore sees the same slots as the same row at depth
    ``d`` of a chain or tree forwarded after ``n - d`` cached slots and its ``d``
    ancestors."""
    if window is not None:
        sinks, recent, align = _window_parts(window)
        whole = sinks + recent + 1 + align  # the shortest path the window hides a slot of
    if tree_mask is None and (window is None or start + t < whole):
        # causal rows inside any window: row r sees the prefix of start + r + 1 slots (what
        # the loop below finds row by row, at two aranges and a compare per row: 0.15 ms
        # of a 16-row verification, 20 ms of a 2,000-token prompt chunk)
        return list(range(start + 1, start + t + 1))
    if tree_mask is None:
        base, tree_rows = start, None
    else:
        mask = torch.as_tensor(tree_mask, dtype=torch.bool)
        s = mask.shape[1] if mask.dim() == 2 else -1
        if mask.dim() != 2 or mask.shape[0] != t or not t <= s <= start + t:
            raise ValueError(
                f"tree_mask must be [{t}, S] with {t} <= S <= {start + t}, got {tuple(mask.shape)}"
            )
        base = start + t - s  # slots before the tree part: all visible (context)
        tree_rows = [base + torch.nonzero(mask[row]).flatten() for row in range(t)]
    out: list[Visibility] = []
    for row in range(t):
        own = torch.arange(start, start + row + 1) if tree_rows is None else tree_rows[row]
        n = own.numel()
        if window is not None and base + n >= whole:
            first = sinks + (base + n - recent - 1 - sinks) // align * align
            if tree_rows is None:  # the path is the slots 0 .. start + row, in order
                kept = torch.cat([torch.arange(sinks), torch.arange(first, base + n)])
            else:
                path = torch.cat([torch.arange(base), own])
                kept = torch.cat([path[:sinks], path[first:]])
            out.append(kept.to(device))
        elif torch.equal(own, torch.arange(base, base + n)):
            out.append(base + n)  # a plain prefix of the slots (the causal case)
        else:
            out.append(torch.cat([torch.arange(base), own]).to(device))
    return out


def _window_parts(window) -> tuple[int, int, int]:
    """``(sinks, recent, align)`` of a ``(sinks, recent[, align])`` window (align 1).

    Raises:
        ValueError: not 2 or 3 integers with ``sinks >= 0``, ``recent >= 1``, ``align >= 1``.
    """
    parts = tuple(window)
    if (
        len(parts) not in (2, 3)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in parts)
        or parts[0] < 0
        or min(parts[1:]) < 1
    ):
        raise ValueError(
            f"kv_window must be (sinks >= 0, recent >= 1) or (sinks, recent, align >= 1), "
            f"got {window!r}"
        )
    sinks, recent, align = (*parts, 1)[:3]
    return sinks, recent, align


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (one fused op; float32 accumulation for 16-bit inputs)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _product(
    linear, x: torch.Tensor, plans: list[_Plan], exact: bool, upcast: PrefillPlan
) -> torch.Tensor:
    """``linear`` over the forward's rows. Fast mode: one product for all rows (in float32
    when they include a prompt chunk and ``upcast`` says so for that many rows). Exact
    mode: each prefill chunk's rows as one product of their own (:meth:`Linear.prefill`:
    the fastest formulation for that many rows, in float32 where ``upcast`` says so; the
    same call for the same chunk, so the same bits alone or in any batch), and every other
    row (decoding, verification) through the batch-invariant product. A prompt chunk's
    rows are only ever computed as that chunk, so they need no invariance across row
    counts, and a long prompt runs at the speed of one large product instead of the exact
    mode's tiles."""
    if not any(p.prefill for p in plans):
        return linear(x, exact)
    quantized = isinstance(linear, QuantLinear)
    if not exact:
        if upcast.products(x.shape[0]) and not (quantized and upcast.quantized(x.shape[0])):
            return linear.prefill(x, True)
        return linear(x, False)
    outputs, row, run = [], 0, 0  # run: rows of other sequences not yet computed
    for p in plans:
        if p.prefill:
            if run:
                outputs.append(linear(x[row - run : row], True))
                run = 0
            chunk = x[row : row + p.length]
            if quantized and upcast.quantized(p.length):
                outputs.append(linear.prefill(chunk, quantized=True))
            else:
                outputs.append(linear.prefill(chunk, upcast.products(p.length)))
        else:
            run += p.length
        row += p.length
    if run:
        outputs.append(linear(x[row - run : row], True))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with contiguous rows (a product may return a transposed view)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _head_norms(qk: torch.Tensor, w, heads: int, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over each query and key head before the rotation (``qk`` ``[T,
    H + G, d]``); ``qk`` itself for models without them."""
    if w.q_norm is None:
        return qk
    return torch.cat(
        [_rms_norm(qk[:, :heads], w.q_norm, eps), _rms_norm(qk[:, heads:], w.k_norm, eps)], dim=1
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x * cos + rotate_half(x) * sin`` for ``x`` ``[T, heads, d]``;
    ``sin`` carries rotate_half's sign (its first half negated, see ``_rotary``), so
    rotate_half is a swap of the two halves: one ``flip`` of a ``[.., 2, d/2]`` view."""
    t, heads, d = x.shape
    swapped = x.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    return x * cos + swapped * sin
