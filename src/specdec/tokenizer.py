"""The tokenizer side of a model, kept apart from its forward: prompts (text or chat
messages) to token ids, ids to text, and the ids that end generation.

A backend (:class:`specdec.models.Backend`) only maps token ids to logits; :class:`LLM`,
the benchmark and the server encode and decode with a :class:`Tokenizer`. A target and its
draft model share one vocabulary unless the draft translates through text
(:mod:`specdec.drafters.cross_tokenizer`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from specdec.unicode import check_text

#: End-of-turn markers of common chat templates; each one that the template uses and the
#: tokenizer maps to a single token ends generation like EOS.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class Tokenizer:
    """A Hugging Face tokenizer as specdec uses it.

    Args:
        hf: the ``transformers`` tokenizer (``PreTrainedTokenizerBase``), or a
            :class:`Tokenizer` (returned as is by :meth:`of`).
        extra_eos_token_ids: more ids that end generation (a model's ``eos_token_id`` from
            its config or generation config).
        name: label for error messages.

    Attributes:
        hf: the wrapped tokenizer (for transformers APIs).
        eos_token_ids: ids that end generation: EOS (tokenizer and model), and each chat
            end-of-turn marker (:data:`END_OF_TURN_MARKERS`) the template uses.
    """

    def __init__(self, hf, extra_eos_token_ids: Iterable[int] = (), name: str = "model") -> None:
        self.hf = hf
        self.name = name
        self.eos_token_ids = frozenset(_eos_token_ids(hf) | {int(i) for i in extra_eos_token_ids})
        self._token_bytes: dict[int, bytes] = {}  # token_bytes' cache

    @classmethod
    def of(cls, tokenizer, extra_eos_token_ids: Iterable[int] = (), name: str = "model"):
        """``tokenizer`` itself if it is a :class:`Tokenizer`, else a new one wrapping it."""
        if isinstance(tokenizer, cls):
            return tokenizer
        return cls(tokenizer, extra_eos_token_ids, name)

    def __len__(self) -> int:
        """Tokens the tokenizer knows (added tokens included)."""
        return len(self.hf)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id."""
        return self.hf.get_vocab()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token string of the vocabulary, in characters (computed once). A
        byte-level BPE token string holds one character per byte of the text it covers,
        so a text of C characters has at least ``C / max_token_chars`` tokens."""
        return max((len(t) for t in self.get_vocab()), default=1)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(
        self,
        prompt: str | list[dict],
        chat: bool | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Tokenize a prompt; with ``chat`` (default: when a template exists) use the chat
        template with the generation prompt appended.

        Args:
            prompt: a user message, or a list of ``{"role", "content"}`` messages.
            chat: apply the chat template (``None``: if the tokenizer has one).
            add_generation_prompt: messages: end with the template's opening of an
                assistant turn (vLLM's and transformers' default).
            continue_final_message: messages: leave the last message (an assistant's, to
                be continued) open, without its end-of-turn; needs
                ``add_generation_prompt=False`` (transformers' ``apply_chat_template``).
            chat_template_kwargs: extra variables for the chat template (vLLM's and
                transformers' name, e.g. ``{"enable_thinking": False}`` for Qwen3); only
                where the template applies.
            tools: function tools in OpenAI's form (:func:`specdec.tools.check_tools`),
                given to the chat template as ``tools`` (transformers' argument; a template
                that does not read them ignores them); only where the template applies.

        Returns:
            prompt token ids (list of int).

        Raises:
            ValueError: messages given but the tokenizer has no chat template, text that
                is not valid Unicode (a lone surrogate; see :mod:`specdec.unicode`), or
                ``continue_final_message`` with ``add_generation_prompt`` or after a last
                message that is not the assistant's; ``chat_template_kwargs`` that is not a
                mapping of names, or that names one of the arguments above.
        """
        _check_prompt_text(prompt)
        extra = _template_kwargs(chat_template_kwargs)
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message continues the last message, so it needs "
                    "add_generation_prompt=false (a new assistant turn cannot follow it)"
                )
            if not isinstance(prompt, list) or prompt[-1].get("role") != "assistant":
                raise ValueError(
                    "continue_final_message continues the last message, which must be the "
                    "assistant's"
                )
        if chat is None:
            chat = self.has_chat_template
        if isinstance(prompt, list):
            if not self.has_chat_template:
                raise ValueError(f"{self.name} has no chat template; pass a plain string prompt")
            messages = prompt
        elif chat and self.has_chat_template:
            messages = [{"role": "user", "content": prompt}]
        else:
            return list(self.hf(prompt, add_special_tokens=True)["input_ids"])
        text = self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **({"tools": list(tools)} if tools else {}),
            **extra,
        )
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Detokenize, dropping special tokens (EOS, end-of-turn)."""
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own decoding, special tokens shown (a token holding part of a
        character decodes to U+FFFD)."""
        return self.hf.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of the text one token stands for (OpenAI's logprobs ``bytes``): a
        token holding part of a multi-byte character gives its own bytes (the first byte
        of an emoji, ``b"\\xf0"``), not the U+FFFD its decoding shows, so that the
        bytes of consecutive tokens join into the text. Read from the token's string: a
        byte-level BPE symbol (GPT-2's byte-to-unicode table: Llama 3, Qwen, SmolLM) or a
        byte-fallback piece ``<0xF0>`` (SentencePiece: Llama 2, Mistral); a token of
        neither kind, or a special token, gives its decoding's UTF-8. Cached per id."""
        token_id = int(token_id)
        cached = self._token_bytes.get(token_id)
        if cached is None:
            text = self.token_text(token_id)
            cached = text.encode()
            if "\ufffd" in text:
                raw = _piece_bytes(self.hf.convert_ids_to_tokens(token_id))
                cached = cached if raw is None else raw
            self._token_bytes[token_id] = cached
        return cached


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE table, symbol -> byte (its ``bytes_to_unicode`` inverted)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {symbol: byte for byte, symbol in bytes_to_unicode().items()}


def _piece_bytes(piece) -> bytes | None:
    """The bytes a token string stands for: ``<0xHH>`` (a byte-fallback piece) or a
    byte-level BPE symbol string; ``None`` for anything else."""
    if not isinstance(piece, str) or not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    table = _byte_decoder()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


#: ``apply_chat_template`` arguments that ``chat_template_kwargs`` may not set (specdec
#: sets them, or they are not template variables)
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_tensors", "return_dict", "chat_template", "tools"}
)  # fmt: skip


def _template_kwargs(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` checked: a mapping of string names, none reserved."""
    if values is None:
        return {}
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise ValueError(f"chat_template_kwargs must map variable names to values, got {values!r}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(values))
    if reserved:
        own = {"add_generation_prompt", "continue_final_message", "tools"}.intersection(reserved)
        why = (
            f"give {' / '.join(sorted(own))} as its own argument"
            if own
            else "the messages and the template's call are specdec's"
        )
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)} ({why})")
    return dict(values)


def model_eos_token_ids(model) -> set[int]:
    """``eos_token_id`` (an int or a list) of a transformers model's generation config and
    config."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids |= _ids(getattr(source, "eos_token_id", None))
    return ids


def _ids(value) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value}
    return set()


def _eos_token_ids(tokenizer) -> set[int]:
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, str):
        for marker in END_OF_TURN_MARKERS:
            if marker in template:
                token_ids = tokenizer.convert_tokens_to_ids([marker])
                unk = getattr(tokenizer, "unk_token_id", None)
                if token_ids and token_ids[0] is not None and token_ids[0] != unk:
                    ids.add(int(token_ids[0]))
    return ids


def _check_prompt_text(prompt: str | list[dict]) -> None:
    """Refuse a prompt or message text that is not valid Unicode (the tokenizer would fail
    with a ``TypeError`` far from the cause)."""
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        return
    for i, message in enumerate(prompt):
        content = message.get("content") if isinstance(message, dict) else None
        parts = content if isinstance(content, list) else [content]
        for j, part in enumerate(parts):
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                where = f"messages[{i}].content" + (f"[{j}]" if isinstance(content, list) else "")
                check_text(text, where)
