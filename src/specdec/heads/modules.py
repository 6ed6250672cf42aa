"""Draft heads as PyTorch modules: EAGLE-3's one-layer draft decoder and Medusa's heads.

Both read the target's hidden states (:attr:`specdec.models.base.ForwardOutput.captured`)
and predict over a *draft vocabulary*: the ``draft_vocab_size`` most frequent target tokens
of the training answers (FR-Spec, Zhao et al. 2025, arXiv:2502.14856; EAGLE-3's
``d2t`` map). ``vocab_map[i]`` is the target id of draft token ``i``; a target token
outside the map has draft probability 0, which verification handles like any other
draft distribution, so output stays lossless.

* :class:`EagleHead` (EAGLE-3, Li et al. 2025, arXiv:2503.01840, Sec. 3 and Fig. 6; EAGLE,
  Li et al. 2024, arXiv:2401.15077, Sec. 4.1): the target's hidden states of ``C`` layers
  (low, middle, high) are fused by ``fc`` (``[C * D] -> [D]``) into a feature ``f``. Row
  ``j`` of the draft decoder reads ``f_j`` (the target's state after token ``j``) and the
  embedding of token ``j + 1``: ``x = [norm(embed(t_{j+1})), norm(f_j)]`` (``[2D]``), one
  Llama decoder layer whose q/k/v read ``x`` and whose residual is ``f_j``; its output
  ``h_j`` predicts token ``j + 2`` through ``lm_head(norm(h_j))``. Drafting further, ``h_j``
  replaces the target's feature for the next row (EAGLE-3's training-time test trains
  exactly this reuse). The token embedding is the target's (frozen, not stored).
* :class:`ParallelHead` (parallel / block drafting: PARD, An et al. 2025,
  arXiv:2504.18583, Sec. 3; DFlash, Chen et al. 2026, arXiv:2602.06036): EAGLE's layer,
  plus ``block_size - 1`` learned *mask* embeddings. After the row of the pending token
  (``(f_j, t_{j+1})``, predicting token ``j + 2``), mask row ``i`` (``i = 1 ..
  block_size - 1``) reads ``f_j`` and mask embedding ``i`` at position ``j + i`` and
  predicts token ``j + 2 + i``; every row sees the verified rows and the earlier rows of
  its block (causal). One forward therefore proposes ``block_size`` tokens, where EAGLE
  needs one forward per token; the price is that a mask row does not see the tokens drafted
  before it.
* :class:`MedusaHead` (Medusa, Cai et al. 2024, arXiv:2401.10774, Sec. 2.1.1): ``K``
  residual blocks ``h_k = f + SiLU(W_k f)`` on the target's final-normed state ``f`` of the
  last verified token; head ``k`` predicts the token ``k + 2`` positions ahead. Here the
  heads share one trimmed LM head (Medusa gives each head a copy of the target's).
* :class:`HydraHead` (Hydra, Ankner et al. 2024, arXiv:2402.05109, Sec. 3): Medusa's
  heads made sequentially dependent. Head ``k`` reads the same state ``f`` and the
  embeddings of the pending token and of the ``k`` draft tokens before its position,
  ``u = SiLU(W_k [f, n(e_0), .., n(e_k)])``, ``h_k = f + U_k u`` (``n``: an RMSNorm), and
  predicts the token ``k + 2`` positions ahead, so a wrong guess at one position changes
  the guesses after it, where Medusa's heads guess every position blind. The heads share
  one trimmed LM head.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("eagle", "medusa", "parallel", "hydra")

#: Head kinds that read one hidden state (the target's last, final-normed), not a fusion.
SINGLE_STATE_KINDS = ("medusa", "hydra")

#: Token id that stands for mask row ``i`` in :meth:`ParallelHead.step` is ``MASK - i + 1``
#: (``-1`` is mask row 1, ``-2`` mask row 2, ...).
MASK = -1


@dataclass
class HeadConfig:
    """A head's architecture and the target it belongs to (``config.json`` of a head).

    Attributes:
        kind: ``"eagle"``, ``"medusa"``, ``"parallel"`` or ``"hydra"``.
        target_name: the target's name when the head was trained.
        target_fingerprint: :func:`specdec.heads.format.target_fingerprint` of it.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
            vocab_size, rms_eps, rope_theta: the target's shape (the head's attention
            and MLP copy it).
        capture: hidden-state indices the head reads (see
            :attr:`~specdec.models.base.ForwardOutput.captured`).
        draft_vocab_size: size of the draft vocabulary (``vocab_map``'s length).
        medusa_heads: number of Medusa or Hydra heads (``kind`` ``"medusa"`` or
            ``"hydra"``).
        block_size: tokens one forward proposes (``kind == "parallel"``: the pending
            token's row plus ``block_size - 1`` mask rows).
        training: a summary of how it was trained (free-form, for reports).
        format_version: the on-disk format (1).
    """

    kind: str
    target_name: str
    target_fingerprint: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    capture: list[int]
    draft_vocab_size: int
    medusa_heads: int = 0
    block_size: int = 0
    training: dict = field(default_factory=dict)
    format_version: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(
        cls, kind: str, view, fingerprint: str, capture, draft_vocab_size: int, medusa_heads=0,
        block_size=0,
    ) -> HeadConfig:  # fmt: skip
        """A config matching a target's :class:`~specdec.models.base.HeadView`."""
        return cls(
            kind=kind,
            target_name=view.name,
            target_fingerprint=fingerprint,
            num_layers=view.num_layers,
            hidden_size=view.hidden_size,
            num_heads=view.num_heads,
            num_kv_heads=view.num_kv_heads,
            head_dim=view.head_dim,
            intermediate_size=view.intermediate_size,
            vocab_size=view.vocab_size,
            rms_eps=view.rms_eps,
            rope_theta=view.rope_theta,
            capture=[int(i) for i in capture],
            draft_vocab_size=int(draft_vocab_size),
            medusa_heads=int(medusa_heads),
            block_size=int(block_size),
        )


def default_capture(kind: str, num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers (the outputs of layers 1, L/2 - 1 and L - 4,
    as SpecForge picks them), or the final-normed state for Medusa and Hydra.

    Example:
        >>> default_capture("eagle", 30), default_capture("hydra", 30)
        ([2, 15, 27], [30])
    """
    if kind in SINGLE_STATE_KINDS or num_layers < 4:  # parallel reads EAGLE-3's layers
        return [num_layers]
    return [2, num_layers // 2, num_layers - 3]


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight in the input's dtype: under bf16 autocast the fused kernel needs it
        weight = self.weight.to(x.dtype)
        if x.dim() == 2 and not torch.is_grad_enabled() and _runtime_norm(x):
            # drafting rows: the runtime's kernel (about 5 us against 23 for the library's
            # on the 2-core Zen 4; a row's float32 sum of squares in another fixed order)
            from specdec.runtime.kernels import rms_norm

            return rms_norm(x.contiguous(), weight.contiguous(), self.eps)
        return F.rms_norm(x, self.weight.shape, weight, self.eps)


def _runtime_norm(x: torch.Tensor) -> bool:
    """Whether the runtime's RMSNorm kernel takes ``x`` (CPU, float32 or bfloat16, the
    extension built)."""
    from specdec.runtime.kernels import kernel_available

    cpu = x.device.type == "cpu"
    return cpu and x.dtype in (torch.float32, torch.bfloat16) and kernel_available(x.device)


def _one_row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """What ``scaled_dot_product_attention`` computes for one query row that sees every
    key (scale ``d**-0.5``, grouped-query heads), as two small products and a float32
    softmax: ``q [1, H, d]``, ``keys``/``values`` ``[P, G, d]`` -> ``[H, 1, d]``.

    Why: with ``enable_gqa`` and one row, the library took its general path (about 125
    us of a 0.7 ms draft step of the shipped EAGLE head on the 2-core Zen 4); draft tokens
    are proposals, so the rounding may differ (tests compare within 1e-5)."""
    _, h, d = q.shape
    g = keys.shape[1]
    qg = q[0].view(g, h // g, d)
    scores = torch.matmul(qg, keys.permute(1, 2, 0)).float() * d**-0.5
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values.transpose(0, 1)).view(h, 1, d)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class FusedEagleLayer:
    """An :class:`EagleHead`'s decoder layer as one call of the native runtime's fused
    decoding layer (:func:`specdec.runtime.kernels.decode_layer`): the fused QKV product,
    rotary + KV store, attention, output product, residual + MLP norm, gate/up product,
    SiLU x up and down product in C++, over a KV cache in the runtime's layout, for causal
    rows (a chain's draft steps, the rows a drafter catches up, a parallel head's block).

    Why: the head's PyTorch layer is about 50 small operations per draft step; on a 2-core
    CPU after a target forward has streamed its weights through the caches each costs
    10-30 us, so a one-row draft step of the shipped Q8_0 EAGLE head took about 1.5 ms
    for weights a product reads in about 0.3 ms.

    The arithmetic is the head's (float32, the same ``fma`` products on the same Q8_0 /
    Q4_1 blocks: q, k and v concatenated by rows into one matrix, gate and up into
    another, which leaves every output's blocks and order unchanged), except the attention,
    computed by the runtime's kernel (another float32 summation order than
    ``scaled_dot_product_attention``). Drafts are proposals that verification checks, so
    output stays lossless either way.

    Built by :meth:`EagleHead.fused_layer` for a float32 CPU head whose seven layer
    products are :class:`QuantizedLinear` (``quantization=q8_0 / q4_1``, the default on a
    CPU) with the extension built; else that returns ``None`` and the PyTorch layer runs.

    Args:
        head: the quantized head (its embedding bound).
    """

    def __init__(self, head: EagleHead) -> None:
        from specdec.runtime.quant import QuantizedMatrix, QuantLinear

        c = head.config

        def joined(*linears: QuantizedLinear) -> tuple[torch.Tensor, int]:
            matrices = [lin.product.matrix for lin in linears]
            if len(matrices) == 1:
                return linears[0].product.layout
            matrix = QuantizedMatrix(
                matrices[0].kind,
                torch.cat([m.blocks for m in matrices]),
                (sum(m.shape[0] for m in matrices), matrices[0].shape[1]),
            )
            return QuantLinear(matrix, None, torch.float32, "fma").layout

        layouts = [
            joined(head.q, head.k, head.v), joined(head.o),
            joined(head.gate, head.up), joined(head.down),
        ]  # fmt: skip
        self.head = head
        self.blocks = [layout[0] for layout in layouts]
        self.codes = [int(layout[1]) for layout in layouts]
        self.kernels = [0, 0, 0, 0]  # quant_gemm (the fma kernel), as QuantizedLinear runs
        self.mlp_norm = head.mlp_norm.weight.detach().float().contiguous()
        self.eps = float(head.mlp_norm.eps)
        self.scale = c.head_dim**-0.5
        self.heads = c.num_heads
        self._cos = self._sin = torch.empty(0, c.head_dim)
        self._no_slots = torch.empty(0, dtype=torch.long)

    @staticmethod
    def supported(head: EagleHead) -> bool:
        """Whether ``head`` runs on this path (see the class docstring)."""
        from specdec.runtime.kernels import kernel_available

        names = ("q", "k", "v", "o", "gate", "up", "down")
        layers = [getattr(head, name) for name in names]
        if head.dtype != torch.float32 or head.embed is None or head.embed.device.type != "cpu":
            return False
        if not all(isinstance(m, QuantizedLinear) and m.product.kernel == "fma" for m in layers):
            return False
        same = all(head.q.kind == m.kind for m in (head.k, head.v))
        return same and head.gate.kind == head.up.kind and kernel_available("cpu")

    def _tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[>= end, head_dim]`` float32 (the runtime's rotary
        convention: ``x cos + rotate_half(x) sin`` with the first half of sin negated),
        from the head's own ``inv_freq``, as :meth:`EagleHead.rotary` computes them."""
        if end > self._cos.shape[0]:
            size = max(end, 2 * self._cos.shape[0], 256)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.head.inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            sign = torch.ones(emb.shape[-1])
            sign[: emb.shape[-1] // 2] = -1.0
            self._cos, self._sin = emb.cos().contiguous(), (emb.sin() * sign).contiguous()
        return self._cos, self._sin

    def run(
        self,
        kv: torch.Tensor,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        start: int,
        positions: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows in slots ``start .. start + N - 1``: each reads its feature and token,
        writes its key and value to its slot of ``kv`` and attends to the slots it sees.

        Args:
            kv: ``[1, 2, G, C, head_dim]`` float32 contiguous, ``C >= start + N``; slots
                below ``start`` hold the earlier rows.
            features: ``[N, D]`` float32 (fused target features or the head's outputs).
            token_ids: ``[N]`` int64 (a parallel head's mask rows: negative ids).
            start: the first row's slot.
            positions: ``[N]`` int64 rotary positions (default: the slots).
            visible: ``[N, start + N]`` bool, the slots each row sees (a token tree's rows:
                the verified rows, their ancestors and themselves); default causal (slots
                ``0 ..`` its own).

        Returns:
            ``h`` ``[N, D]`` float32, what :meth:`EagleHead.step` returns for these rows.

        Raises:
            ValueError: ``positions`` or ``visible`` of another shape.
        """
        from specdec.runtime.kernels import decode_layer

        head = self.head
        n = features.shape[0]
        features = features.contiguous()
        e = head.embed_tokens(token_ids).to(torch.float32)
        normed = torch.cat([head.embed_norm(e), head.feature_norm(features)], dim=-1)
        slots = torch.arange(start, start + n)
        if positions is None:
            cos, sin = self._tables(start + n)
            cos, sin = cos[start : start + n], sin[start : start + n]
        else:
            positions = torch.as_tensor(positions, dtype=torch.long)
            if positions.shape != (n,):
                raise ValueError(f"{positions.numel()} positions for {n} rows")
            cos, sin = self._tables(int(positions.max()) + 1)
            cos, sin = cos[positions], sin[positions]
        zeros = torch.zeros(n, dtype=torch.long)
        if visible is None:
            row_n, row_off, seen = slots + 1, torch.full((n,), -1, dtype=torch.long), self._no_slots
        else:
            if tuple(visible.shape) != (n, start + n):
                raise ValueError(f"visible must be [{n}, {start + n}], got {tuple(visible.shape)}")
            visible = visible.to(torch.bool)
            row_n = visible.sum(1)
            row_off = torch.cumsum(row_n, 0) - row_n
            seen = visible.nonzero()[:, 1].contiguous()  # each row's slots, in order
        out, mlp = decode_layer(
            features, normed, cos, sin, [kv], 0, zeros, slots, zeros, row_n, row_off, seen,
            self.scale, self.heads, self.blocks, self.codes, self.kernels, self.mlp_norm,
            self.eps,
        )  # fmt: skip
        return out + mlp


class EagleHead(nn.Module):
    """EAGLE-3's draft decoder layer (see the module docstring).

    Args:
        config: the head's :class:`HeadConfig` (``kind == "eagle"``).

    Buffers:
        vocab_map: ``[draft_vocab_size]`` int64 target ids of the draft vocabulary.

    The token embedding is bound with :meth:`bind` (the target's, never trained).
    """

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = config
        d, hd = c.hidden_size, c.head_dim
        self.config = c
        self.fc = nn.Linear(len(c.capture) * d, d, bias=False) if len(c.capture) > 1 else None
        self.embed_norm = _RMSNorm(d, c.rms_eps)
        self.feature_norm = _RMSNorm(d, c.rms_eps)
        self.q = nn.Linear(2 * d, c.num_heads * hd, bias=False)
        self.k = nn.Linear(2 * d, c.num_kv_heads * hd, bias=False)
        self.v = nn.Linear(2 * d, c.num_kv_heads * hd, bias=False)
        self.o = nn.Linear(c.num_heads * hd, d, bias=False)
        self.mlp_norm = _RMSNorm(d, c.rms_eps)
        self.gate = nn.Linear(d, c.intermediate_size, bias=False)
        self.up = nn.Linear(d, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, d, bias=False)
        self.norm = _RMSNorm(d, c.rms_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("vocab_map", torch.arange(c.draft_vocab_size), persistent=True)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.embed: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norms' weights; quantized layers too)."""
        return self.norm.weight.dtype

    def fused_layer(self) -> FusedEagleLayer | None:
        """The layer as one call of the runtime's fused decoding layer
        (:class:`FusedEagleLayer`), built at the first call, or ``None`` where it does not
        run (then :meth:`step` does). Call it after :meth:`bind` and :func:`quantize_head`."""
        weight = self.norm.weight
        key = (self.embed is not None, getattr(self, "quantization", None), weight.device,
               weight.dtype)  # fmt: skip
        cached = self.__dict__.get("_fused")
        if cached is None or cached[0] != key:
            fused = FusedEagleLayer(self) if FusedEagleLayer.supported(self) else None
            self.__dict__["_fused"] = cached = (key, fused)
        return cached[1]

    def bind(self, embed: torch.Tensor) -> EagleHead:
        """Use the target's ``[vocab_size, hidden_size]`` token embedding."""
        if tuple(embed.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"embedding {tuple(embed.shape)} does not match the head's target "
                f"({self.config.vocab_size}, {self.config.hidden_size})"
            )
        self.embed = embed
        return self

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[(B,) N]`` int64 -> ``[(B,) N, D]`` the target's token embeddings."""
        return F.embedding(token_ids, self.embed)

    def fuse(self, captured: torch.Tensor) -> torch.Tensor:
        """``[N, C * D]`` captured target states -> ``[N, D]`` features."""
        return captured if self.fc is None else self.fc(captured)

    def rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def step(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass of the draft layer over ``N`` rows (optionally a leading batch
        dimension ``B`` on every argument but ``positions`` and ``mask``).

        Args:
            features: ``[(B,) N, D]`` fused target features or the head's own outputs.
            token_ids: ``[(B,) N]`` the token each row reads (the one after its feature's).
            positions: ``[N]`` rotary positions.
            past_k, past_v: ``[(B,) P, G, d]`` keys and values of earlier rows (or ``None``).
            mask: ``[N, P + N]`` bool, True where a row sees a key (``None``: causal over
                the new rows, every past row visible).

        Returns:
            ``(h [(B,) N, D], k [(B,) N, G, d], v [(B,) N, G, d])``: outputs and the new
            keys/values.
        """
        c = self.config
        lead = features.shape[:-1]  # (B,) N
        n = lead[-1]
        device = features.device  # the drafters build ids, positions and masks on the CPU
        token_ids, positions = token_ids.to(device), positions.to(device)
        mask = None if mask is None else mask.to(device)
        e = self.embed_tokens(token_ids).to(features.dtype)
        x = torch.cat([self.embed_norm(e), self.feature_norm(features)], dim=-1)
        q = self.q(x).view(*lead, c.num_heads, c.head_dim)
        k = self.k(x).view(*lead, c.num_kv_heads, c.head_dim)
        v = self.v(x).view(*lead, c.num_kv_heads, c.head_dim)
        cos, sin = self.rotary(positions, q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys = k if past_k is None else torch.cat([past_k, k], dim=-3)
        values = v if past_v is None else torch.cat([past_v, v], dim=-3)
        p = keys.shape[-3] - n
        if mask is None and n > 1:  # one row sees every key: no mask at all
            mask = torch.ones(n, p + n, dtype=torch.bool, device=features.device)
            mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=features.device).tril()
        if n == 1 and len(lead) == 1 and not torch.is_grad_enabled():
            attn = _one_row_attention(q, keys, values)  # a chain's draft step
        else:
            attn = F.scaled_dot_product_attention(
                q.transpose(-3, -2), keys.transpose(-3, -2), values.transpose(-3, -2),
                attn_mask=mask, enable_gqa=c.num_heads != c.num_kv_heads,
            )  # fmt: skip
        h = features + self.o(attn.transpose(-3, -2).reshape(*lead, -1))
        y = self.mlp_norm(h)
        h = h + self.down(F.silu(self.gate(y)) * self.up(y))
        return h, k, v

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` outputs -> ``[N, draft_vocab_size]`` draft logits."""
        return self.lm_head(self.norm(h))


class ParallelHead(EagleHead):
    """The parallel (block) drafting head: EAGLE's layer with learned mask embeddings
    (see the module docstring).

    Args:
        config: the head's :class:`HeadConfig` (``kind == "parallel"``, ``block_size >=
            2``).

    Parameters:
        mask_embed: ``[block_size - 1, D]``: the embedding mask row ``i`` reads (token id
            ``-i`` in :meth:`step`).

    Raises:
        ValueError: ``block_size < 2``.
    """

    def __init__(self, config: HeadConfig) -> None:
        if config.block_size < 2:
            raise ValueError(f"a parallel head needs block_size >= 2, got {config.block_size}")
        super().__init__(config)
        self.mask_embed = nn.Parameter(torch.zeros(config.block_size - 1, config.hidden_size))

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``>= 0`` read the target's embedding, ``-i`` reads mask embedding
        ``i`` (``[(B,) N]`` -> ``[(B,) N, D]``)."""
        masked = token_ids < 0
        if not bool(masked.any()):
            return F.embedding(token_ids, self.embed)
        tokens = F.embedding(token_ids.clamp(min=0), self.embed)
        masks = F.embedding((-token_ids - 1).clamp(min=0), self.mask_embed)
        return torch.where(masked[..., None], masks.to(tokens.dtype), tokens)

    def block(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        start: int,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafting forward: the ``N`` rows not yet run (the last one the pending
        token's) and ``size - 1`` mask rows, causal, in one pass.

        Args:
            features: ``[N, D]`` fused target features of the new rows.
            token_ids: ``[N]`` the token each new row reads.
            start: position of the first new row (the rows in the cache before it).
            past_k, past_v: ``[start, G, d]`` the cached rows (or ``None``).
            size: draft tokens wanted, ``1 .. block_size``.

        Returns:
            ``(logits [size, V'], k [N, G, d], v [N, G, d])``: draft-vocabulary logits of
            each draft position and the new rows' keys/values (mask rows are not kept).
        """
        n = features.shape[0]
        features, token_ids = self.block_rows(features, token_ids, size)
        positions = torch.arange(start, start + features.shape[0])
        h, k, v = self.step(features, token_ids, positions, past_k, past_v, None)
        return self.logits(h[n - 1 :]), k[:n], v[:n]

    def block_rows(
        self, features: torch.Tensor, token_ids: torch.Tensor, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of :meth:`block`: the ``N`` new rows, then ``size - 1`` mask rows
        reading the last new row's feature (``[N + size - 1, D]`` features, ``[N + size -
        1]`` token ids, mask row ``i`` as id ``-i``)."""
        extra = size - 1
        if not extra:
            return features, token_ids
        masks = -torch.arange(1, extra + 1, dtype=torch.long)
        return (
            torch.cat([features, features[-1:].expand(extra, -1)]),
            torch.cat([token_ids, masks]),
        )


class MedusaHead(nn.Module):
    """Medusa's residual heads over one shared trimmed LM head (see the module docstring).

    Args:
        config: the head's :class:`HeadConfig` (``kind == "medusa"``).
    """

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = config
        d = c.hidden_size
        self.config = c
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(c.medusa_heads))
        self.norm = _RMSNorm(d, c.rms_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("vocab_map", torch.arange(c.draft_vocab_size), persistent=True)
        for block in self.blocks:  # start as the identity (Medusa, Sec. 2.1.1)
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norm's weight; quantized layers too)."""
        return self.norm.weight.dtype

    def bind(self, embed: torch.Tensor) -> MedusaHead:
        """Nothing to bind (Medusa reads no embedding); for symmetry with EAGLE."""
        return self

    def forward(self, features: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """``[N, D]`` final-normed target states -> ``[N, K, draft_vocab_size]`` logits of
        the first ``heads`` heads (default all)."""
        blocks = self.blocks[: heads or len(self.blocks)]
        hs = torch.stack([features + F.silu(b(features)) for b in blocks], dim=-2)
        return self.lm_head(self.norm(hs))


class HydraHead(nn.Module):
    """Hydra's sequentially dependent heads over one shared trimmed LM head (see the
    module docstring).

    Args:
        config: the head's :class:`HeadConfig` (``kind == "hydra"``; ``medusa_heads`` is
            the number of heads ``K``).

    The token embedding is bound with :meth:`bind` (the target's, never trained).
    """

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = config
        d = c.hidden_size
        self.config = c
        self.embed_norm = _RMSNorm(d, c.rms_eps)
        self.inputs = nn.ModuleList(
            nn.Linear((k + 2) * d, d, bias=False) for k in range(c.medusa_heads)
        )
        self.outputs = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(c.medusa_heads))
        self.norm = _RMSNorm(d, c.rms_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("vocab_map", torch.arange(c.draft_vocab_size), persistent=True)
        for lin in self.outputs:  # every head starts as the identity on f, like Medusa's
            nn.init.zeros_(lin.weight)
        self.embed: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norm's weight; quantized layers too)."""
        return self.norm.weight.dtype

    def bind(self, embed: torch.Tensor) -> HydraHead:
        """Use the target's ``[vocab_size, hidden_size]`` token embedding.

        Raises:
            ValueError: the embedding's shape is not the target's.
        """
        if tuple(embed.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"embedding {tuple(embed.shape)} does not match the head's target "
                f"({self.config.vocab_size}, {self.config.hidden_size})"
            )
        self.embed = embed
        return self

    def position_logits(self, features: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Head ``k = P - 1``'s draft logits.

        Args:
            features: ``[..., D]`` the target's final-normed states (one per row).
            token_ids: ``[..., P]`` int64 per row: the pending token, then the ``P - 1``
                draft tokens before the position (``1 <= P <= K``).

        Returns:
            ``[..., draft_vocab_size]`` logits of the token ``P + 1`` places after the
            last verified one.

        Raises:
            ValueError: ``P`` is 0 or above the number of heads.
        """
        k = token_ids.shape[-1] - 1
        if not 0 <= k < len(self.inputs):
            raise ValueError(f"a Hydra head reads 1 to {len(self.inputs)} tokens, got {k + 1}")
        e = self.embed_norm(
            F.embedding(token_ids.to(features.device), self.embed).to(features.dtype)
        )
        x = torch.cat([features, e.flatten(-2)], dim=-1)
        h = features + self.outputs[k](F.silu(self.inputs[k](x)))
        return self.lm_head(self.norm(h))

    def forward(self, features: torch.Tensor, token_ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced logits of every head over a sequence.

        Args:
            features: ``[B, T, D]`` final-normed target states of rows ``0 .. T - 1``.
            token_ids: ``[B, T]`` the tokens (row ``j``'s pending token is ``j + 1``).

        Returns:
            per head ``k``, ``[B, T - 1 - k, draft_vocab_size]``: row ``j`` reads ``f_j``
            and tokens ``j + 1 .. j + 1 + k`` and predicts token ``j + k + 2`` (the label
            of row ``j + k + 1``).
        """
        t = token_ids.shape[-1]
        out = []
        for k in range(len(self.inputs)):
            n = t - 1 - k
            if n <= 0:
                break
            window = torch.stack([token_ids[:, 1 + i : 1 + i + n] for i in range(k + 1)], -1)
            out.append(self.position_logits(features[:, :n], window))
        return out


def spread_logits(draft_logits: torch.Tensor, vocab_map: torch.Tensor, vocab_size: int):
    """``[N, V']`` draft-vocabulary logits -> ``[N, vocab_size]`` float32 target-vocabulary
    logits, ``-inf`` outside the draft vocabulary (draft probability 0 there, whatever the
    sampling transform).

    Example:
        >>> spread_logits(torch.tensor([[1.0, 2.0]]), torch.tensor([3, 0]), 4).tolist()
        [[2.0, -inf, -inf, 1.0]]
    """
    out = torch.full((draft_logits.shape[0], vocab_size), float("-inf"), device=draft_logits.device)
    out[:, vocab_map] = draft_logits.float()
    return out


def make_head(config: HeadConfig) -> EagleHead | MedusaHead | ParallelHead | HydraHead:
    """An untrained head of ``config.kind``.

    Raises:
        ValueError: unknown kind.
    """
    if config.kind == "eagle":
        return EagleHead(config)
    if config.kind == "medusa":
        return MedusaHead(config)
    if config.kind == "parallel":
        return ParallelHead(config)
    if config.kind == "hydra":
        return HydraHead(config)
    raise ValueError(f"unknown head kind {config.kind!r}; known: {', '.join(KINDS)}")


#: ``quantization`` values of :func:`quantize_head` (the head drafters' option,
#: :data:`specdec.drafters.options.HEAD_QUANTIZATION_CHOICES`): ``none`` keeps the float
#: weights, ``auto`` is ``q8_0`` for a float32 CPU head where the kernels build, else ``none``.
HEAD_QUANTIZATIONS = ("auto", "none", "q8_0", "q4_1")


class QuantizedLinear(nn.Module):
    """An inference-only ``nn.Linear`` whose weight is kept in a GGUF block format and
    multiplied by the native runtime's few-row kernel
    (:class:`specdec.runtime.quant.QuantLinear`, ``fma``: float32 arithmetic on the
    dequantized weights).

    Why: a draft step reads every weight of the head for one or a few rows, so on a CPU
    its time is the weights' bytes. A float32 EAGLE head for SmolLM2-135M is 39 MB per
    draft token, about half of the target's own Q4_1 step; Q8_0 (8.5 bits per weight)
    reads 3.8x fewer bytes, and its product on the LM head took 0.42 ms against 1.98 ms
    in float32 on one Zen 4 core. The head's outputs change by Q8_0's rounding only; draft
    tokens stay proposals that verification checks, so output stays lossless (the
    distributions a sampled draft returns are those of the quantized head).

    Args:
        linear: the trained layer (its input width a multiple of 32).
        kind: ``"q8_0"`` or ``"q4_1"``.

    Raises:
        ValueError: an unknown kind or an input width that is not a multiple of 32.
    """

    def __init__(self, linear: nn.Linear, kind: str) -> None:
        from specdec.runtime.quant import BLOCK, QuantLinear, quantize

        super().__init__()
        if kind not in HEAD_QUANTIZATIONS[2:]:
            raise ValueError(f"unknown head quantization {kind!r}; known: {HEAD_QUANTIZATIONS[2:]}")
        if linear.in_features % BLOCK:
            raise ValueError(f"input width {linear.in_features} is not a multiple of {BLOCK}")
        self.in_features, self.out_features, self.kind = (
            linear.in_features, linear.out_features, kind,
        )  # fmt: skip
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.product = QuantLinear(quantize(linear.weight.detach().float(), kind), bias,
                                   torch.float32, "fma")  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` in ``x``'s dtype."""
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self.product(x)  # a drafting step's rows: no reshapes or casts
        lead = x.shape[:-1]
        y = self.product(x.reshape(-1, self.in_features).float().contiguous())
        return y.view(*lead, self.out_features).to(x.dtype)


def quantize_head(head: EagleHead | MedusaHead, kind: str) -> int:
    """Replace, in place, every ``nn.Linear`` of an inference head whose input width is a
    multiple of 32 by a :class:`QuantizedLinear` of ``kind`` (CPU only; the others stay
    float; ``auto``: see :data:`HEAD_QUANTIZATIONS`). For inference heads only (not for
    training).

    Sets ``head.quantization`` to the format that runs (``"none"``, ``"q8_0"`` or
    ``"q4_1"``; ``auto`` resolved), which ``specdec generate`` reports.

    Returns:
        the number of layers replaced.

    Raises:
        ValueError: an unknown kind, or an explicit kind for a head that is not a float32
            CPU head.
    """
    if kind not in HEAD_QUANTIZATIONS:
        raise ValueError(f"unknown head quantization {kind!r}; known: {HEAD_QUANTIZATIONS}")
    on_cpu = head.norm.weight.device.type == "cpu" and head.dtype == torch.float32
    if kind == "auto":
        from specdec.runtime.kernels import kernel_available

        kind = "q8_0" if on_cpu and kernel_available("cpu") else "none"
    if kind == "none":
        head.quantization = "none"
        return 0
    if not on_cpu:
        raise ValueError(
            f"head quantization {kind} runs on the CPU in float32; this head is "
            f"{head.norm.weight.dtype} on {head.norm.weight.device} (use quantization=none)"
        )
    from specdec.runtime.quant import BLOCK

    replaced = 0
    for module in list(head.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % BLOCK == 0:
                setattr(module, name, QuantizedLinear(child, kind))
                replaced += 1
    head.quantization = kind
    return replaced


def init_from_target(head: EagleHead | MedusaHead, view) -> None:
    """Start a head from the target's weights: the LM head rows of the draft vocabulary
    and the final norm (EAGLE and Medusa both start from the target's LM head)."""
    with torch.no_grad():
        rows = view.lm_head.index_select(0, head.vocab_map.to(view.lm_head.device))
        head.lm_head.weight.copy_(rows.float())
        head.norm.weight.copy_(view.norm.float())
        if isinstance(head, EagleHead):
            std = 1.0 / math.sqrt(head.config.hidden_size)
            for lin in (head.q, head.k, head.v, head.gate, head.up):
                nn.init.normal_(lin.weight, std=std)
            for lin in (head.o, head.down):
                nn.init.normal_(lin.weight, std=std / 4)
        if isinstance(head, HydraHead):
            for lin in head.inputs:
                nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))
        if isinstance(head, ParallelHead):  # mask rows start as an average token
            embed = view.embed.float()
            head.mask_embed.copy_(embed.mean(0).expand_as(head.mask_embed))
            head.mask_embed.add_(torch.randn_like(head.mask_embed) * float(embed.std()) * 0.1)
