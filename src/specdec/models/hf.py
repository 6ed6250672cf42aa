"""Backend for any transformers causal LM: forward with explicit positions into a KVCache."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from specdec.kv_cache import KVCache
from specdec.trees.tree import TokenTree, tree_attention_bias

#: End-of-turn markers of common chat templates; each one that the template uses and the
#: tokenizer maps to a single token ends generation like EOS.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class HFModel:
    """A transformers causal LM plus its tokenizer, as specdec uses it (target or draft).

    Args:
        model: a ``transformers`` causal LM (``PreTrainedModel``) in eval mode.
        tokenizer: its tokenizer (``PreTrainedTokenizerBase``).
        name: a label for logs and reports.

    Attributes:
        vocab_size: width of the logits (may exceed ``len(tokenizer)`` when the embedding
            matrix is padded).
        max_context: maximum sequence length (prompt + output), in tokens.
        eos_token_ids: token ids that end generation (EOS and chat end-of-turn tokens).
        device, dtype: where the weights live and their dtype.
    """

    #: Who runs the forward (``"native"`` for :class:`~specdec.models.native.NativeModel`).
    backend = "hf"

    def __init__(self, model, tokenizer, name: str = "model") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        config = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = _max_context(config, tokenizer)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.eos_token_ids = frozenset(_eos_token_ids(model, tokenizer))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty :class:`KVCache` sized for ``capacity`` tokens."""
        return KVCache(self.num_layers, capacity)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: KVCache,
        num_logits: int = 0,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``token_ids`` and append their keys/values to ``cache`` (after its cursor).

        Causal by default: token ``j`` sits at position ``cache.num_tokens + j`` and sees
        everything before it. With ``tree_mask`` this is tree attention (SpecInfer, Miao
        et al. 2024, §3.2): each new token sees every cached position before the tree and,
        within the tree, only the positions its mask row allows (its ancestors and itself).

        Args:
            token_ids: ``[T]`` int token ids (T >= 1).
            cache: the sequence's cache.
            num_logits: return logits for only the last ``num_logits`` positions
                (0 = all T). Prefill uses 1 to skip the LM head on the prompt.
            positions: ``[T]`` absolute int positions (rotary embeddings); default
                ``cache.num_tokens + arange(T)``. Tree nodes use prefix length + depth.
            tree_mask: ``[T, S]`` bool, ``S >= T``: which of the last ``S`` key positions
                (the ``S - T`` tree tokens already cached, then these ``T``) each new token
                attends to. Converted to an additive float mask.

        Returns:
            ``[T or num_logits, vocab_size]`` float32 logits on the model's device.

        Raises:
            ValueError: ``tree_mask`` or ``positions`` has the wrong shape.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        num_new = ids.shape[1]
        start = cache.num_tokens
        if positions is None:
            pos = torch.arange(start, start + num_new, device=self.device).view(1, -1)
        else:
            pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).view(1, -1)
            if pos.shape[1] != num_new:
                raise ValueError(f"{pos.shape[1]} positions for {num_new} tokens")
        extra = {}
        if tree_mask is not None:
            if (
                tree_mask.dim() != 2
                or tree_mask.shape[0] != num_new
                or not (num_new <= tree_mask.shape[1] <= start + num_new)
            ):
                raise ValueError(
                    f"tree_mask must be [{num_new}, S] with {num_new} <= S <= "
                    f"{start + num_new}, got {tuple(tree_mask.shape)}"
                )
            past_len = start + num_new - tree_mask.shape[1]
            extra["attention_mask"] = tree_attention_bias(
                tree_mask, past_len, self.dtype, self.device
            )
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=num_logits,
            **{self._cache_kwarg: cache},
            **extra,
        )
        return out.logits[0].float()

    def forward_tree(self, root_token: int, tree: TokenTree, cache: KVCache) -> torch.Tensor:
        """Tree attention pass: the pending (root) token plus every node of ``tree``.

        Root at position ``cache.num_tokens``, node ``i`` at that plus its depth, each
        seeing the cache, its ancestors and itself (:meth:`TokenTree.attention_mask`).

        Returns:
            ``[N + 1, vocab_size]`` float32 logits: row 0 after the root, row ``i + 1``
            after node ``i``'s root-to-node path.
        """
        return self.forward(
            [root_token, *tree.token_ids],
            cache,
            positions=cache.num_tokens + tree.position_offsets(),
            tree_mask=tree.attention_mask(),
        )

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> list[int]:
        """Tokenize a prompt; with ``chat`` (default: when a template exists) use the chat template.

        Args:
            prompt: a user message, or a list of ``{"role", "content"}`` messages.
            chat: apply the chat template (``None``: if the tokenizer has one).

        Returns:
            prompt token ids (list of int).

        Raises:
            ValueError: messages given but the model has no chat template.
        """
        if chat is None:
            chat = self.has_chat_template
        if isinstance(prompt, list):
            if not self.has_chat_template:
                raise ValueError(f"{self.name} has no chat template; pass a plain string prompt")
            messages = prompt
        elif chat and self.has_chat_template:
            messages = [{"role": "user", "content": prompt}]
        else:
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Detokenize, dropping special tokens (EOS, end-of-turn)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @torch.inference_mode()
    def warmup(self, num_tokens: Sequence[int] = (1, 8)) -> None:
        """Run throwaway forwards of the given lengths so first-call costs leave timings."""
        for n in num_tokens:
            cache = self.new_cache(n)
            self.forward([0] * n, cache)


def _max_context(config, tokenizer) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**7:
        return value
    return 2048


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, str):
        for marker in END_OF_TURN_MARKERS:
            if marker in template:
                token_ids = tokenizer.convert_tokens_to_ids([marker])
                unk = getattr(tokenizer, "unk_token_id", None)
                if token_ids and token_ids[0] is not None and token_ids[0] != unk:
                    ids.add(int(token_ids[0]))
    return ids
