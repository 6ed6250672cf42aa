"""Request bodies of the OpenAI-compatible API (pydantic), and OpenAI-style errors.

Fields follow OpenAI's completions and chat completions APIs; ``top_k``, ``ignore_eos`` and
``speculative`` are specdec extensions (as vLLM adds ``top_k`` and ``ignore_eos``).
Unknown fields are ignored, as the OpenAI client may send more than a server uses.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SpeculativeOptions(BaseModel):
    """Per-request speculative settings (extension).

    Attributes:
        method: a registered drafter's name (``none``, ``ngram``, ``draft-model`` -- the
            server's draft model --, ``suffix``, ``recycling``, ...; see
            ``specdec drafters``), run with the server's options when it is the server's
            own drafter, else with the drafter's defaults.
        num_speculative_tokens: draft tokens per step (1 to 64).
        tree: a token-tree spec (e.g. ``"static:tree-16"``), or ``null`` for chains.
        enabled: ``false`` runs plain decoding for this request.
        controller: a registered speculation controller's name (``fixed``, ``cost``,
            ...; see ``specdec controllers``), with the server's options when it is the
            server's own controller, else with its defaults.
    """

    model_config = ConfigDict(extra="forbid")

    method: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64, strict=True)
    tree: str | None = None
    enabled: bool = True
    controller: str | None = None

    @field_validator("controller")
    @classmethod
    def _known_controller(cls, value: str | None) -> str | None:
        from specdec import registry

        if value is not None and value not in registry.controller_names():
            names = ", ".join(registry.controller_names())
            raise ValueError(
                f"unknown controller {value!r}; choose one of {names} "
                "(options cannot be set per request)"
            )
        return value

    @field_validator("method")
    @classmethod
    def _known_drafter(cls, value: str | None) -> str | None:
        from specdec import registry

        if value is not None and value not in registry.drafter_names():
            raise ValueError(
                f"unknown drafter {value!r}; choose one of {', '.join(registry.drafter_names())}"
                " (options cannot be set per request)"
            )
        return value


#: OpenAI request fields that are not implemented, with the values that ask for nothing.
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: SpeculativeOptions | None = None

    @field_validator("temperature", "top_p", "top_k", "seed", "n", mode="before")
    @classmethod
    def _no_bools(cls, value):
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        """OpenAI fields this server does not implement are refused when they ask for
        something (silently ignoring ``logprobs: 5`` would hand a client ``null``)."""
        if isinstance(data, dict):
            asked = [k for k, idle in UNSUPPORTED.items() if k in data and data[k] not in idle]
            if asked:
                raise ValueError(f"not supported by this server: {', '.join(sorted(asked))}")
        return data


class CompletionRequest(_Common):
    """``POST /v1/completions``; ``max_tokens`` defaults to 16 as in OpenAI's API."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``; without ``max_tokens`` / ``max_completion_tokens`` the
    output may fill the rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
