"""Request bodies of the OpenAI-compatible API (pydantic), and OpenAI-style errors.

Fields follow OpenAI's completions and chat completions APIs (``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``logprobs`` and ``response_format`` included),
plus vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``bad_words``, ``structured_outputs`` and ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, OpenAI's ``prediction``
(Predicted Outputs), chat's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (see
:mod:`specdec.tools`), and specdec's ``speculative``. Every field a request sends falls
under one rule:

- the fields this server implements work as documented; ``null`` means the default;
- known OpenAI fields and vLLM sampling extensions that it does not implement
  (:data:`UNSUPPORTED`: ``suffix``, ``functions``, completions' ``tools``, ...) are
  accepted when their value asks for nothing
  (``null`` or the neutral value: ``false``, ``[]``, ``tool_choice: "none"``, ...) and
  otherwise refused
  (HTTP 400, ``param`` the field): ignoring ``echo: true`` would hand a client less than
  it asked for;
- fields that do not change the output (:data:`IGNORED`: ``user``, ``metadata``,
  ``store``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
  ``request_id``, and completions' ``parallel_tool_calls``) are accepted and ignored;
- anything else is refused (HTTP 400, ``unknown field 'foo_bar'``, ``param: "foo_bar"``):
  a misspelt field would otherwise silently do nothing.

A chat message has ``role``, ``content`` and optionally ``name`` (ignored). ``content`` is
a string or a list of OpenAI content parts: text parts (``{"type": "text", "text": ...}``)
are joined with ``"\\n"`` (as vLLM does); other parts (``image_url``, ``input_audio``,
``file``, ...) are refused, as this model takes text only. An assistant message's
``content`` may be ``null`` (read as ``""``). A tool message's ``tool_call_id`` and an
assistant's ``tool_calls`` (their arguments as objects) are passed to the chat template.
``function_call`` and a returned answer's ``refusal``, ``audio`` and ``annotations`` are
accepted only empty (``null``, ``[]``).

Every string of a request (prompts, message contents, stop strings, ``model``, the
``speculative`` options, field names, ignored values) must be valid Unicode: a lone UTF-16
surrogate, which a JSON ``\\u`` escape can carry, is refused with HTTP 400 naming where it
is. Errors name the offending field in OpenAI's ``param`` (``"temperature"``,
``"messages[0].content"``, ``"stop[1]"``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from specdec.config import (
    LOGIT_BIAS_RANGE,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_NUM_SPECULATIVE_TOKENS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from specdec.structured import StructuredOutputsParams
from specdec.tools import (
    ToolChoice,
    check_tool_choice,
    check_tools,
    template_tool_calls,
    tool_constraint,
)
from specdec.unicode import find_invalid, printable


class BadRequest(Exception):
    """An invalid request (HTTP 400): the message says why; ``param`` names the field as
    OpenAI does (``"prompt"``, ``"messages[0].content"``), or is ``None``.

    Not a ``ValueError``: raised inside pydantic validation, it passes through unchanged,
    so the field's location survives.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    #: the HTTP status and OpenAI's error ``code`` (``None``: none)
    status = 400
    code: str | None = None


class ModelNotFound(BadRequest):
    """A request for a model this server does not serve: HTTP 404 with OpenAI's (and
    vLLM's) ``code: "model_not_found"``, so clients raise their not-found error."""

    status = 404
    code = "model_not_found"


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
        verifier: ``"rejection"`` or ``"block"`` (lossless chain verifiers), or the lossy
            ``"typical[:epsilon=E,delta=D]"`` (see :attr:`specdec.SpeculativeConfig.verifier`).
        allow_lossy: ``true`` opts in to a lossy verifier (refused otherwise); the
            response's ``metrics.speculative_decoding.lossy`` then says so. ``false`` on a
            server started with a lossy verifier runs this request with ``rejection``.
    """

    model_config = ConfigDict(extra="forbid", strict=True)  # no type coercion (see _Common)

    method: str | None = None
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=MAX_NUM_SPECULATIVE_TOKENS, strict=True
    )
    tree: str | None = None
    enabled: bool = True
    controller: str | None = None
    verifier: str | None = None
    allow_lossy: bool = Field(False, strict=True)

    @field_validator("tree", mode="before")
    @classmethod
    def _tree_spec(cls, value):
        if value is not None and not isinstance(value, str):
            raise ValueError(
                "a token-tree spec is a string, e.g. 'dynamic:top_k=4,depth=6,budget=16' or "
                f"'static:tree-16' (null for chains; see the docs' Token trees page), not {value!r}"
            )
        return value

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, value: str | None) -> str | None:
        from specdec.config import parse_verifier

        if value is not None:
            parse_verifier(value)
        return value

    @field_validator("controller")
    @classmethod
    def _known_controller(cls, value: str | None) -> str | None:
        from specdec import registry

        if value is not None and value not in registry.controller_names():
            names = ", ".join(registry.controller_names())
            hint = " (options cannot be set per request)" if ":" in value else ""
            raise ValueError(f"unknown controller {value!r}; choose one of {names}{hint}")
        return value

    @field_validator("method")
    @classmethod
    def _known_drafter(cls, value: str | None) -> str | None:
        from specdec import registry

        if value is not None and value not in registry.drafter_names():
            name = value.partition(":")[0].strip()
            if ":" in value and name in registry.drafter_names():
                raise ValueError(
                    f"drafter options cannot be set per request ({value!r}): name the drafter "
                    f"only ({name!r}: the server's options if it runs that drafter, else its "
                    f"defaults), or start the server with --drafter '{value}'"
                )
            hint = " (options cannot be set per request)" if ":" in value else ""
            raise ValueError(
                f"unknown drafter {value!r}; choose one of {', '.join(registry.drafter_names())}"
                + hint
            )
        return value


#: Known OpenAI fields and vLLM extensions this server does not implement, each with the
#: values that ask for nothing (accepted, and then dropped); any other value is refused.
UNSUPPORTED: dict[str, tuple] = {
    # OpenAI
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),  # "auto" picks no tool when there are none
    "function_call": (None, "none", "auto"),
    "reasoning_effort": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "verbosity": (None,),
    # vLLM
    "length_penalty": (None, 1),
    "use_beam_search": (None, False),
    # one grammar engine (llguidance) serves every request; naming it is accepted
    "guided_decoding_backend": (None, "auto", "guidance", "llguidance"),
    "guided_whitespace_pattern": (None,),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "priority": (None, 0),
}

#: Fields that do not change what is generated: accepted with any value, and ignored.
IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
     "parallel_tool_calls", "request_id"}
)  # fmt: skip

#: Chat message fields beside ``role`` and ``content`` that are not implemented.
MESSAGE_UNSUPPORTED: dict[str, tuple] = {
    "function_call": (None,),
    "refusal": (None,),
    "audio": (None,),
    "annotations": (None, []),
}

#: Chat message fields accepted and ignored.
MESSAGE_IGNORED = frozenset({"name"})


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI): the schema (optional in OpenAI's API:
    without it, any JSON value, the empty schema ``{}``), its ``name`` and
    ``description`` (accepted, unused), ``strict`` (accepted: the output always follows
    the schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (with ``json_schema``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given exactly when type is "json_schema"')
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` object: one of ``json`` (a schema), ``regex``,
    ``choice``, ``grammar`` (Lark) or ``json_object``; ``disable_any_whitespace``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class TextPart(BaseModel):
    """A text content part (``{"type": "text", "text": ...}``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``,
    the expected output, drafted from (see
    :class:`~specdec.drafters.prediction.PredictionDrafter`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts;
    with it, vLLM's ``continuous_usage_stats`` also puts the counts so far in every chunk;
    ``include_obfuscation`` (padding against side channels) is accepted and ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no type coercion (see _Common)

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None


class _Common(BaseModel):
    #: strict: a number, a boolean or a string only where the field has that type (``true``
    #: is not ``max_tokens`` 1, ``"yes"`` not ``stream: true``); an integer is still a float
    # NaN and infinities: "should be a finite number", not a range error that NaN fails
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    #: the served model's name; optional, as in vLLM (``None``: the served model)
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, strict=True)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS
    )
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    unsupported_fields: ClassVar[dict] = UNSUPPORTED
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    speculative: SpeculativeOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prediction: Prediction | None = None
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field that asked for it (``None,
        None`` without one): ``response_format`` (OpenAI), ``structured_outputs`` (vLLM)
        or vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar``.

        Raises:
            BadRequest: more than one of them, or an invalid constraint (naming the field).
        """
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            asked.append(("response_format", fmt))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                asked.append((name, getattr(self, name)))
        if not asked:
            return None, None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise BadRequest(f"give one output constraint, got {names}", asked[1][0])
        name, value = asked[0]
        try:
            if name == "response_format":
                if value.type == "json_object":
                    return StructuredOutputsParams(json_object=True), name
                schema = value.json_schema.schema_
                return StructuredOutputsParams(json={} if schema is None else schema), name
            if name == "structured_outputs":
                return StructuredOutputsParams(
                    json=value.json_, regex=value.regex, choice=value.choice,
                    grammar=value.grammar, json_object=bool(value.json_object),
                    disable_any_whitespace=value.disable_any_whitespace,
                ), name  # fmt: skip
            kind = name.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: value}), name
        except ValueError as error:
            raise BadRequest(f"{name}: {error}", name) from None

    @field_validator(
        "temperature", "top_p", "top_k", "seed", "n", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "min_tokens", mode="before",
    )  # fmt: skip
    @classmethod
    def _no_bools(cls, value):
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value):
        """OpenAI's form: ``{"token id": bias}``, the id a string of digits (JSON keys are
        strings), each bias a number in [-100, 100]."""
        if value is None:
            return value
        if not isinstance(value, dict):
            raise BadRequest("logit_bias must map token ids to biases", "logit_bias")
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise BadRequest(
                    f"logit_bias keys must be token ids, got {printable(str(key))!r}", "logit_bias"
                )
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not (-LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE)
            ):
                raise BadRequest(
                    f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}",
                    "logit_bias",
                )
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value):
        if value is None:
            return value
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list):
            raise BadRequest("stop must be a string or a list of strings", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise BadRequest(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
        for i, s in enumerate(stops):
            where = "stop" if isinstance(value, str) else f"stop[{i}]"
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                raise BadRequest(
                    f"{where} must be a string of 1 to {MAX_STOP_STRING_CHARS} characters", where
                )
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        """OpenAI's and vLLM's rule: ``stream_options`` only with ``stream: true``."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options needs stream: true", "stream_options")
        return self

    @model_validator(mode="before")
    @classmethod
    def _screen_request(cls, data):
        """The module's rule: every string valid Unicode; unknown fields, and unsupported
        ones that ask for something, refused; ignored and neutral ones (and ``null``s,
        which mean the default) dropped."""
        if not isinstance(data, dict):
            return data  # pydantic says what is wrong
        check_unicode(data)
        data = screen_fields(data, cls.model_fields, cls.unsupported_fields, IGNORED)
        return cls._screen_more(data)

    @classmethod
    def _screen_more(cls, data: dict) -> dict:
        return data


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class CompletionRequest(_Common):
    """``POST /v1/completions``; ``max_tokens`` defaults to 16 as in OpenAI's API; ``0``
    with ``echo`` scores the prompt without generating (OpenAI's legacy API, vLLM)."""

    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=16, strict=True)

    @model_validator(mode="after")
    def _best_of(self):
        """OpenAI's rules: ``best_of`` >= ``n``, and no streaming when it is larger."""
        if self.best_of is not None and self.best_of < self.n:
            raise BadRequest(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise BadRequest("best_of > n cannot be streamed", "best_of")
        if self.best_of is not None and self.best_of > 1 and self.temperature == 0:
            raise BadRequest(
                "best_of > 1 needs sampling (temperature > 0): greedy candidates are all "
                "the same output", "best_of",
            )  # fmt: skip
        return self

    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    #: completions have no top_logprobs (``logprobs`` is the count); 0 asks for nothing
    unsupported_fields: ClassVar[dict] = {**UNSUPPORTED, "top_logprobs": (None, 0)}

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_count(cls, value):
        """``false`` (what chat clients send) means none; ``true`` is refused: here
        ``logprobs`` is how many top tokens to list per position (0 to 20)."""
        if value is False:
            return None
        if value is True:
            raise ValueError("completions take logprobs as a count of top tokens (0 to 20)")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        if isinstance(value, str) or _is_token_ids(value):
            return value
        if not isinstance(value, list):
            raise BadRequest(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists",
                "prompt",
            )
        for i, item in enumerate(value):
            if not (isinstance(item, str) or _is_token_ids(item)):
                raise BadRequest(
                    f"prompt[{i}] must be a string or a list of token ids", f"prompt[{i}]"
                )
        return value


class ChatMessage(BaseModel):
    """One chat message, its ``content`` already one string (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    #: a tool message's answer to the call with this id (passed to the chat template,
    #: which may show it; OpenAI's SDK always sends it)
    tool_call_id: str | None = None
    #: an assistant's tool calls (OpenAI's form), checked by ``_screen_message``; the chat
    #: template gets their arguments as objects (``LLM.encode``)
    tool_calls: list[dict] | None = None

    def template_message(self) -> dict:
        """The message as the chat template gets it."""
        out = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # LLM.encode gives the template their arguments as objects
            out["tool_calls"] = self.tool_calls
        return out


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``; without ``max_tokens`` / ``max_completion_tokens`` the
    output may fill the rest of the context."""

    #: chat has no ``echo`` (vLLM's chat echo repeats the last message) and no ``best_of``;
    #: it has ``tools`` and ``tool_choice``
    unsupported_fields: ClassVar[dict] = {
        **{k: v for k, v in UNSUPPORTED.items() if k not in ("tools", "tool_choice")},
        "echo": (None, False),
        "best_of": (None, 1),
    }
    #: OpenAI's function tools (see :mod:`specdec.tools`), given to the chat template
    tools: list[dict] | None = None
    #: ``"none"``, ``"auto"`` (default with tools: needs the server's tool-call parser),
    #: ``"required"`` or ``{"type": "function", "function": {"name": ...}}``
    tool_choice: str | dict | None = None
    #: ``false``: at most one call (``"required"``: by the constraint; ``"auto"``: the
    #: first call read, as vLLM does)
    parallel_tool_calls: bool | None = None
    _tools: list[dict] = PrivateAttr(default_factory=list)
    _tool_choice: ToolChoice = PrivateAttr(default_factory=lambda: ToolChoice("none"))

    @model_validator(mode="after")
    def _check_tools(self):
        """The tools and the choice checked (errors name the field)."""
        self._tools = _checked_tools(self.tools)
        try:
            choice = check_tool_choice(self.tool_choice, self._tools)
        except ValueError as error:
            raise BadRequest(str(error), "tool_choice") from None
        self._tool_choice = dataclasses.replace(
            choice, parallel=self.parallel_tool_calls is not False
        )
        return self

    @property
    def checked_tools(self) -> list[dict]:
        """The request's tools as the chat template takes them (empty: none)."""
        return self._tools

    @property
    def choice(self) -> ToolChoice:
        """The request's checked tool choice."""
        return self._tool_choice

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """As :meth:`_Common.structured_spec`, and a forced tool choice's constraint
        (:func:`~specdec.tools.tool_constraint`; field ``tools``, whose schemas it is
        made of), which excludes the others."""
        spec, field = super().structured_spec()
        if not self._tool_choice.forced:
            return spec, field
        if spec is not None:
            raise BadRequest(
                f"give one output constraint, got tool_choice (a forced call) and {field}", field
            )
        try:
            return tool_constraint(self._tools, self._tool_choice), "tools"
        except ValueError as error:
            raise BadRequest(f"tools: {error}", "tools") from None

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    #: vLLM's: open an assistant turn after the messages (default), or (with
    #: ``continue_final_message`` and this false) continue the last, assistant's, message
    add_generation_prompt: bool = Field(True, strict=True)
    continue_final_message: bool = Field(False, strict=True)
    #: vLLM's: extra variables for the chat template (e.g. ``{"enable_thinking": false}``)
    chat_template_kwargs: dict[str, Any] | None = None

    @classmethod
    def _screen_more(cls, data: dict) -> dict:
        messages = data.get("messages")
        if isinstance(messages, list):
            data["messages"] = [
                _screen_message(m, f"messages[{i}]") for i, m in enumerate(messages)
            ]
        return data


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: ``prompt`` (raw text, as completions read it) or
    ``messages`` (through the chat template, as chat reads them, with chat's template
    fields)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    #: vLLM's: a ``prompt``'s special tokens (BOS) added, as completions add them
    add_special_tokens: bool = Field(True, strict=True)
    #: vLLM's: also the tokens' strings (``token_strs``)
    return_token_strs: bool = Field(False, strict=True)
    add_generation_prompt: bool = Field(True, strict=True)
    continue_final_message: bool = Field(False, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: ``messages``' tools, given to the chat template as chat gives them; a chat
    #: request's ``tool_choice`` and ``parallel_tool_calls`` are accepted (they do not
    #: change the prompt)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    @property
    def checked_tools(self) -> list[dict]:
        """The tools as the chat template takes them (see :func:`specdec.tools.check_tools`).

        Raises:
            BadRequest: bad tools, naming the field as chat does.
        """
        return _checked_tools(self.tools)

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data):
        if isinstance(data, dict):
            check_unicode(data)
            messages = data.get("messages")
            if isinstance(messages, list):
                data = {**data, "messages": [
                    _screen_message(m, f"messages[{i}]") for i, m in enumerate(messages)
                ]}  # fmt: skip
        return data

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give prompt (text) or messages (a chat), one of them", "prompt")
        if self.prompt is not None and self.tools:
            raise BadRequest(
                "tools apply to messages (the chat template), not to a prompt", "tools"
            )
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text (special tokens included)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, strict=True)]]


def _checked_tools(tools) -> list[dict]:
    """:func:`~specdec.tools.check_tools` of a request's ``tools`` (``None``: none).

    Raises:
        BadRequest: naming the entry at fault (``tools[0].function.name``).
    """
    if tools is None:
        return []
    try:
        return check_tools(tools)
    except ValueError as error:
        param = str(error).split(":")[0].split(" ")[0]
        raise BadRequest(str(error), param if param.startswith("tools") else "tools") from None


# ---------------------------------------------------------------- screening


def check_unicode(data, path: str = "") -> None:
    """Refuse the first string (or object key) in the JSON value ``data`` that is not
    valid Unicode.

    Raises:
        BadRequest: naming its location (``param``) and the lone surrogate.
    """
    stack = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            _check_string(value, where, where or "the request body")
        elif isinstance(value, dict):
            inner = []
            for key, item in value.items():
                _check_string(key, _join(where, key), f"the field name '{printable(key)}'")
                inner.append((_join(where, key), item))
            stack.extend(reversed(inner))
        elif isinstance(value, list):
            stack.extend(reversed([(f"{where}[{i}]", item) for i, item in enumerate(value)]))


def _check_string(text: str, where: str, what: str) -> None:
    index = find_invalid(text)
    if index >= 0:
        raise BadRequest(
            f"{printable(what)} is not valid Unicode: lone surrogate U+{ord(text[index]):04X} at "
            f"character {index} (a \\u escape of a UTF-16 surrogate must be half of a "
            "high/low pair)",
            printable(where) or None,
        )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def screen_fields(data: dict, fields, unsupported: dict, ignored, path: str = "") -> dict:
    """``data`` with only ``fields`` (dropping ``null``s, ignored fields and unsupported
    ones that ask for nothing).

    Raises:
        BadRequest: a field neither known nor ignored, or an unsupported one that asks
            for something.
    """
    unknown = [k for k in data if k not in fields and k not in unsupported and k not in ignored]
    if unknown:
        name = printable(_join(path, unknown[0]))
        raise BadRequest(f"unknown field '{name}'", name)
    asked = sorted(
        k for k in data if k in unsupported and not _asks_nothing(data[k], unsupported[k])
    )
    if asked:
        names = [_join(path, k) for k in asked]
        idle = [json.dumps(v) for v in unsupported[asked[0]]]
        values = ", ".join(idle[:-1]) + " or " + idle[-1] if len(idle) > 1 else idle[0]
        raise BadRequest(
            f"not supported by this server: {', '.join(names)} ({names[0]} is accepted only "
            f"as {values}: values that ask for nothing)",
            names[0],
        )
    return {k: v for k, v in data.items() if k in fields and v is not None}


def _asks_nothing(value, idle: tuple) -> bool:
    return any(_same_json(value, v) for v in idle)


def _same_json(a, b) -> bool:
    """JSON equality that tells booleans from numbers (in Python ``True == 1``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _screen_message(message, path: str):
    """A chat message with only ``role`` and ``content``, the content one string."""
    if not isinstance(message, dict):
        return message  # pydantic says what is wrong
    role, content = message.get("role"), message.get("content")
    fields = ("role", "content", "tool_call_id", "tool_calls")
    message = screen_fields(message, fields, MESSAGE_UNSUPPORTED, MESSAGE_IGNORED, path)
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant":
            raise BadRequest(f"{path}.tool_calls: only an assistant's message makes tool calls",
                             f"{path}.tool_calls")  # fmt: skip
        try:
            template_tool_calls(calls, f"{path}.tool_calls")
        except ValueError as error:
            raise BadRequest(str(error), f"{path}.tool_calls") from None
    elif calls is not None:
        message.pop("tool_calls")
    return {**message, "content": _content_text(content, role, f"{path}.content")}


def _content_text(content, role, path: str) -> str:
    """A message's content as one string: text parts joined with ``"\\n"``."""
    if content is None:
        if role == "assistant":
            return ""
        raise BadRequest(f"{path} is required (only an assistant message may leave it null)", path)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{path} must be a string or a list of content parts", path)
    return "\n".join(_part_text(part, f"{path}[{j}]") for j, part in enumerate(content))


def _part_text(part, path: str) -> str:
    """The text of one content part; any other kind of part is refused."""
    if not isinstance(part, dict):
        example = '{"type": "text", "text": "..."}'
        raise BadRequest(f"{path} must be a content part such as {example}", path)
    kind = part.get("type")
    if kind != "text":
        if isinstance(kind, str):
            raise BadRequest(
                f"{path}: this model takes text only; content parts of type '{kind}' are not "
                "supported",
                path,
            )
        raise BadRequest(f'{path}.type must be "text" (this model takes text only)', f"{path}.type")
    screen_fields(part, ("type", "text"), {}, (), path)
    if not isinstance(part.get("text"), str):
        raise BadRequest(f"{path}.text must be a string", f"{path}.text")
    return part["text"]


# ---------------------------------------------------------------- errors


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
):
    """OpenAI's error object (any lone surrogate escaped, so it always encodes as UTF-8)."""
    param = None if param is None else printable(param)
    return {"error": {"message": printable(message), "type": kind, "param": param, "code": code}}


def describe_errors(errors: list[dict], body) -> tuple[str, str | None]:
    """OpenAI's ``message`` and ``param`` for pydantic's validation ``errors`` of the
    request ``body``: each error as ``field: reason`` (without pydantic's ``Value error,``
    prefix), ``param`` the first one's field (``"messages[0].role"``)."""
    parts, params = [], []
    for e in errors:
        if e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",):
            return "the request body is empty; send a JSON object", None
        if tuple(e.get("loc", ())) == ("body",) and not isinstance(body, dict):
            return f"the request body must be a JSON object, got {_json_kind(body)}", None
        if e.get("type") == "json_invalid":
            loc = e.get("loc", ())
            where = f" at character {loc[1]}" if len(loc) > 1 else ""
            detail = (e.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON (error{where}: {detail})")
            continue
        param = _error_param(e, body)
        if param in params:
            continue  # one reason per field (a union's members each add one)
        params.append(param)
        parts.append(_error_text(e, param))
    return "; ".join(parts) or "invalid request", next((p for p in params if p), None)


def _json_kind(value) -> str:
    """The JSON type of a decoded value, as a user would name it."""
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"),
                       (str, "a string"), (list, "an array")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _error_text(error: dict, param: str | None) -> str:
    kind = error.get("type")
    if kind == "extra_forbidden" and param:
        return f"unknown field '{param}'"
    if kind in ("value_error", "assertion_error") and "error" in (error.get("ctx") or {}):
        reason = str(error["ctx"]["error"])  # without pydantic's "Value error, "
    else:
        reason = str(error.get("msg"))
    return f"{param}: {reason}" if param else reason


def _error_param(error: dict, body) -> str | None:
    """The error's location in ``body``, OpenAI-style (``messages[0].content``): pydantic's
    ``loc`` followed through the body as sent (so a union member's name, which is not in
    the body, ends it)."""
    path, value = "", body
    for key in error.get("loc", ())[1:]:  # after "body"
        if isinstance(value, dict) and isinstance(key, str):
            if key not in value and error.get("type") != "missing":
                break
            path, value = _join(path, key), value.get(key)
        elif isinstance(value, list) and type(key) is int and 0 <= key < len(value):
            path, value = f"{path}[{key}]", value[key]
        else:
            break
    return path or None
