"""Tool (function) calling in OpenAI's chat format.

Three parts, used by the server's ``tools`` / ``tool_choice`` and open to library users:

- :func:`check_tools` / :func:`check_tool_choice`: OpenAI's function tools and tool
  choice, checked, in the form chat templates take (transformers' ``tools=``).
- :func:`tool_constraint`: what a *forced* choice puts on the output, as vLLM does it: a
  named function (``{"type": "function", "function": {"name": ...}}``) makes the output
  that function's arguments, one JSON object valid against its ``parameters`` schema;
  ``"required"`` makes it a JSON array of ``{"name", "parameters"}`` calls, each
  valid against its tool's schema (at most one call with ``parallel_tool_calls: false``).
  The constraint is a :class:`~specdec.structured.StructuredOutputsParams` JSON schema,
  so it masks every verified row like any structured output, and speculation stays
  lossless (see :mod:`specdec.structured`).
- :data:`TOOL_CALL_PARSERS`: what reads tool calls out of a model's free text when the
  model chooses (``tool_choice: "auto"``), in the format its chat template taught it:
  ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Hermes, Qwen2.5,
  SmolLM3 and others) and ``llama3_json`` (a bare JSON object ``{"name": ...,
  "parameters": {...}}``, optionally after ``<|python_tag|>``, several joined by ``;``:
  Llama 3.1-3.3) and ``mistral`` (a JSON array of ``{"name", "arguments"}`` opening the
  output, after the ``[TOOL_CALLS]`` token, which decoding drops as a special token:
  Mistral's instruct models). The model decides; a parser only reads. vLLM's parsers of
  the same names read the same formats.

:class:`ToolCallStream` turns one choice's text, as it is generated, into OpenAI's
streamed ``delta`` objects (``content`` or ``tool_calls``) and its final
``finish_reason``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.structured import StructuredOutputsParams

#: OpenAI's rule for a function's name.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Most tools one request may define (OpenAI's limit).
MAX_TOOLS = 128


def new_call_id() -> str:
    """A fresh tool call id, OpenAI-style (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool.

    Attributes:
        name: the function's name.
        arguments: its arguments as JSON text (an object), as OpenAI returns them.
        id: the call's id (fresh unless given).
    """

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict:
        """The call as an OpenAI ``tool_calls`` entry (with ``index`` when streamed)."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolChoice:
    """A checked ``tool_choice``.

    Attributes:
        mode: ``"none"`` (answer in text), ``"auto"`` (the model decides; a parser reads its
            calls), ``"required"`` (one or more calls, forced) or ``"named"`` (a call of
            ``name``, forced).
        name: the function of a ``"named"`` choice, else ``None``.
        parallel: ``parallel_tool_calls``; ``False``: at most one call (``"required"``'s
            constraint allows one; under ``"auto"`` the first call read is kept, as vLLM
            does).
    """

    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Whether the output is constrained to tool calls."""
        return self.mode in ("required", "named")


def check_tools(tools: Sequence) -> list[dict]:
    """OpenAI's ``tools`` checked: function tools ``{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}`` with distinct names matching
    :data:`NAME_PATTERN`, ``parameters`` a JSON-schema object.

    Args:
        tools: the tool definitions (dicts, as decoded from JSON).

    Returns:
        The tools as chat templates take them (new dicts; ``parameters`` given
        ``"type": "object"`` when it has no type, and defaulted to an object without
        properties: OpenAI's function of no arguments).

    Raises:
        ValueError: the first thing wrong, named as ``tools[i].function.name`` and so on.
    """
    if not isinstance(tools, (list, tuple)):
        raise ValueError("tools must be a list of function tools")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}: only function tools ({{"type": "function", ...}}) exist')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ValueError(f"{where}.function: unknown field '{unknown[0]}'")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ValueError(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"
            )
        if name in seen:
            raise ValueError(f"{where}.function.name: {name!r} is defined twice")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is None:  # OpenAI's reading: a function without arguments
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        if params.get("type", "object") != "object":  # OpenAI's rule: arguments are an object
            raise ValueError(
                f'{where}.function.parameters must be a JSON schema of "type": "object" '
                f"(a function's arguments are an object), got type {params['type']!r}"
            )
        params = {"type": "object", **params}
        checked = {"name": name, "parameters": params}
        if fn.get("description") is not None:
            checked["description"] = fn["description"]
        out.append({"type": "function", "function": checked})
    return out


def check_tool_choice(choice, tools: Sequence[dict] | None) -> ToolChoice:
    """OpenAI's ``tool_choice`` checked against the (checked) ``tools``.

    Args:
        choice: ``None`` (OpenAI's default: ``"auto"`` with tools, else ``"none"``),
            ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function":
            {"name": ...}}``.
        tools: the request's tools (``None`` or empty: none).

    Raises:
        ValueError: another value, ``"required"`` or a named function without tools, or a
            name no tool has.
    """
    names = [t["function"]["name"] for t in tools or ()]
    if choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(
                f'tool_choice must be "none", "auto", "required" or a named function, '
                f"got {choice!r}"
            )
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return ToolChoice(choice if names or choice == "none" else "none")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise ValueError(
            f'tool_choice of type {kind!r} is not supported here: give "none", "auto", '
            '"required" or {"type": "function", "function": {"name": ...}}'
        )
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(fn, dict) and isinstance(fn.get("name"), str)):  # fmt: skip
        raise ValueError(
            'tool_choice names a function as {"type": "function", "function": {"name": ...}}'
        )
    if fn["name"] not in names:
        known = ", ".join(names) or "none"
        raise ValueError(
            f"tool_choice names {fn['name']!r}, which no tool defines (tools: {known})"
        )
    return ToolChoice("named", fn["name"])


def tool_constraint(
    tools: Sequence[dict], choice: ToolChoice, parallel: bool | None = None
) -> StructuredOutputsParams | None:
    """The output constraint of a forced ``choice`` (``None`` for ``"none"`` / ``"auto"``).

    Args:
        tools: checked tools (:func:`check_tools`).
        choice: checked choice (:func:`check_tool_choice`).
        parallel: ``parallel_tool_calls``; ``False`` allows one call under ``"required"``
            (default: the choice's own :attr:`ToolChoice.parallel`).

    Returns:
        ``"named"``: the function's ``parameters`` schema; ``"required"``: an array (at
        least one item) of ``{"name": <a tool's name>, "parameters": <its schema>}``
        objects, every tool's ``$defs`` moved to the top so that its ``$ref`` still
        resolve (vLLM's schema for ``"required"``). Compact JSON (no whitespace between
        its tokens: arguments are data, and a small model cannot pad them with newlines
        until ``max_tokens``), so most of a call's scaffolding is forced and drafted
        whole (:meth:`~specdec.structured.GrammarState.forced_tokens`).

    Raises:
        ValueError: two tools defining one ``$defs`` name differently.
    """
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if choice.mode == "named":
        return StructuredOutputsParams(json=by_name[choice.name], disable_any_whitespace=True)
    if choice.mode != "required":
        return None
    defs: dict = {}
    options = []
    for name, params in by_name.items():
        params = dict(params)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(
                    f"tools define $defs/{key} differently; give the definitions distinct names"
                )
            defs[key] = value
        options.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not (choice.parallel if parallel is None else parallel):
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


# ------------------------------------------------------------------------- parsers


@dataclass(frozen=True)
class ToolCallParser:
    """Reads tool calls out of a model's text.

    Attributes:
        name: the parser's name (``--tool-call-parser``).
        starts: where calls start: the text from the first match on is the calls' (a
            compiled pattern; ``match`` at the text's start or ``search`` anywhere, per
            ``anywhere``).
        anywhere: calls may follow text (``True``) or must open the output (``False``).
        read: the calls' text -> calls, or ``None`` when it does not parse.
        prefixes: the strings that open calls, for holding back a partial one in a stream.
        outside: the calls' text -> the text in it that is not a call (``None``: none).
    """

    name: str
    starts: re.Pattern
    anywhere: bool
    read: Callable[[str], list[ToolCall] | None]
    prefixes: tuple[str, ...]
    outside: Callable[[str], str] | None = None

    def split(self, text: str) -> int | None:
        """Where the calls start in ``text`` (``None``: no calls)."""
        if self.anywhere:
            found = self.starts.search(text)
            return None if found is None else found.start()
        stripped = len(text) - len(text.lstrip())
        return stripped if self.starts.match(text, stripped) else None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output -> (its content, its calls). Calls that do not parse leave the
        whole text as content and no calls; with calls, the content is the text outside
        them (``hermes``: before, between and after its blocks), so no text is lost.

        Returns:
            ``content`` (``None`` when empty or only whitespace) and the calls in order.
        """
        start = self.split(text)
        if start is None:
            return (text or None), []
        calls = self.read(text[start:])
        if not calls:
            return (text or None), []
        content = text[:start] + (self.outside(text[start:]) if self.outside else "")
        return (content if content.strip() else None), calls

    def held_back(self, text: str) -> int:
        """How many characters at the end of ``text`` (no calls in it yet) could open a
        call, and must wait for the next text before they are sent as content."""
        if not self.anywhere:  # calls open the output or never come
            head = text.lstrip()
            return len(text) if not head or any(p.startswith(head) for p in self.prefixes) else 0
        for n in range(min(len(text), max(map(len, self.prefixes))), 0, -1):
            if any(p.startswith(text[-n:]) for p in self.prefixes):
                return n
        return 0


def _arguments(value) -> str | None:
    """A call's arguments as JSON text (an object), or ``None`` if they are not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(obj, key_order=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in key_order if k in obj), {})
    text = _arguments(args)
    return None if text is None else ToolCall(obj["name"], text)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _read_hermes(text: str) -> list[ToolCall] | None:
    calls = []
    for body in _HERMES_BLOCK.findall(text):
        try:
            call = _call(json.loads(body))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _read_llama3(text: str) -> list[ToolCall] | None:
    text = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = text[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        pos = len(text) - len(rest[1:].lstrip())
    return calls or None


def _read_mistral(text: str) -> list[ToolCall] | None:
    text = text.strip().removeprefix("[TOOL_CALLS]").strip()
    try:
        items, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    if not isinstance(items, list) or text[end:].strip():
        return None
    calls = [_call(item) for item in items]
    return None if not calls or None in calls else calls


def _outside_hermes(text: str) -> str:
    return _HERMES_BLOCK.sub("", text)


#: The tool-call parsers, by name (``--tool-call-parser``).
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": ToolCallParser(
        "hermes", re.compile(re.escape("<tool_call>")), True, _read_hermes, ("<tool_call>",),
        _outside_hermes,
    ),
    "llama3_json": ToolCallParser(
        "llama3_json", re.compile(r"(<\|python_tag\|>\s*)?\{"), False, _read_llama3,
        ("<|python_tag|>", "{"),
    ),
    "mistral": ToolCallParser(
        "mistral", re.compile(r"(\[TOOL_CALLS\]\s*)?\["), False, _read_mistral,
        ("[TOOL_CALLS]", "["),
    ),
}  # fmt: skip


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
        )
    return TOOL_CALL_PARSERS[name]


def read_forced(choice: ToolChoice, text: str) -> list[ToolCall] | None:
    """The calls of a forced choice's output (``None`` when it does not parse, e.g. an
    output cut by ``max_tokens``)."""
    if choice.mode == "named":
        return [ToolCall(choice.name, text)] if _arguments(text) is not None else None
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [_call(item, ("parameters",)) for item in items]
    return None if not calls or None in calls else calls


#: The opening of a ``"required"`` output's next call, up to its arguments: ``[`` (the
#: first) or the end of the call before and ``,``, then ``{"name": "<name>",
#: "parameters": `` (the constraint's key order; any JSON whitespace).
_REQUIRED_HEAD = re.compile(
    r'\s*(?:\[|\}\s*,)\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"parameters"\s*:\s*'
)


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at ``start`` ends (one past its closing
    bracket), or ``None`` while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_required(text: str) -> list[tuple[str, str, bool]]:
    """A ``"required"`` output, whole or still being generated, as its calls so far: per
    call its name, its arguments' text as generated (compact JSON under the constraint)
    and whether they are complete. A call appears once its name and the opening of its
    arguments are generated; the text the constraint makes is read in its key order."""
    calls, pos = [], 0
    while True:
        head = _REQUIRED_HEAD.match(text, pos)
        if head is None or head.end() >= len(text):
            return calls
        end = _value_end(text, head.end())
        calls.append((head.group(1), text[head.end() : end], end is not None))
        if end is None:
            return calls
        pos = end


def finish(
    choice: ToolChoice, parser: ToolCallParser | None, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall], str | None]:
    """One choice's whole output -> (``content``, ``tool_calls``, ``finish_reason``).

    A named function's output is its call's arguments, and ``"required"``'s are its
    calls (:func:`scan_required`), whole or cut by ``max_tokens`` as they were streamed
    (the arguments' text as generated); a named call keeps its ``finish_reason`` (OpenAI's
    forced calls end with ``"stop"``), ``"required"``'s and a parser's calls turn a
    ``"stop"`` into ``"tool_calls"``. Text that holds no call (cut before the first one's
    arguments, or not in the parser's format) stays the content.
    """
    if choice.mode == "named":
        return None, [ToolCall(choice.name, text)], finish_reason
    if choice.mode == "required":
        calls = [ToolCall(name, args) for name, args, _ in scan_required(text)]
        if not calls:
            return text, [], finish_reason
        return None, calls, "tool_calls" if finish_reason == "stop" else finish_reason
    if choice.mode == "auto" and parser is not None:
        content, calls = parser.parse(text)
        if calls:
            calls = calls if choice.parallel else calls[:1]  # vLLM's rule
            return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
    return text, [], finish_reason


class ToolCallStream:
    """One streamed choice's text -> OpenAI ``delta`` objects.

    - no tools / ``"none"``: ``{"content": text}`` as it comes;
    - a named function: its call's id and name first, then the arguments' text as it
      comes (``{"tool_calls": [{"index": 0, "function": {"arguments": ...}}]}``);
    - ``"required"``: each call's id and name once generated, then its arguments' text
      as it comes (:func:`scan_required`);
    - ``"auto"`` with a parser: content as it comes until calls start (a partial opening
      held back), then the calls when the output ends.

    Args:
        choice: the checked tool choice.
        parser: the server's parser (``"auto"`` only).
    """

    def __init__(self, choice: ToolChoice, parser: ToolCallParser | None = None) -> None:
        self.choice, self.parser = choice, parser
        self.text = ""  # everything generated
        self.sent = 0  # characters of text already sent as content
        self.calls_at: int | None = None  # where calls start ("auto")
        self._named_id = new_call_id() if choice.mode == "named" else None
        self._named_started = False
        self._ids: list[str] = []  # "required": the calls streamed so far
        self._args_sent: list[int] = []  # and how much of each one's arguments

    def push(self, text: str, finish_reason: str | None) -> tuple[dict | None, str | None]:
        """Take the next text (``finish_reason`` set on the last push).

        Returns:
            the delta to send (``None``: nothing yet) and the choice's ``finish_reason``
            (``None`` until the last push).
        """
        self.text += text
        mode = self.choice.mode
        if mode == "named":
            return self._push_named(text, finish_reason)
        if mode == "required":
            return self._push_required(finish_reason)
        if mode == "auto" and self.parser is not None:
            return self._push_buffered(finish_reason)
        if not text and finish_reason is None:
            return None, None
        return {"content": text}, finish_reason

    def _push_named(self, text: str, finish_reason: str | None) -> tuple[dict | None, str | None]:
        # the arguments stream as they come (cut by max_tokens, what was sent is all)
        if not text and self._named_started and finish_reason is None:
            return None, None
        entry: dict = {"index": 0, "function": {"arguments": text}}
        if not self._named_started:
            entry = {"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.choice.name, "arguments": text}}  # fmt: skip
            self._named_started = True
        return {"tool_calls": [entry]}, finish_reason

    def _push_required(self, finish_reason: str | None) -> tuple[dict | None, str | None]:
        calls = scan_required(self.text)
        entries = []
        for i, (name, args, _) in enumerate(calls):
            if i == len(self._ids):  # a new call: its id and name first
                self._ids.append(new_call_id())
                self._args_sent.append(0)
                entries.append({"index": i, "id": self._ids[i], "type": "function",
                                "function": {"name": name, "arguments": ""}})  # fmt: skip
            more = args[self._args_sent[i] :]
            if more:
                if entries and entries[-1]["index"] == i:
                    entries[-1]["function"]["arguments"] += more
                else:
                    entries.append({"index": i, "function": {"arguments": more}})
                self._args_sent[i] = len(args)
        if finish_reason is None:
            return ({"tool_calls": entries} if entries else None), None
        _, made, reason = finish(self.choice, None, self.text, finish_reason)
        if not made:  # cut before any call: the text is all there is
            return {"content": self.text}, reason
        return ({"tool_calls": entries} if entries else {}), reason

    def _push_buffered(self, finish_reason: str | None) -> tuple[dict | None, str | None]:
        if finish_reason is None:
            if self.calls_at is not None:
                return None, None
            start = self.parser.split(self.text)
            if start is not None:
                self.calls_at = start
                end = start
            else:
                end = len(self.text) - self.parser.held_back(self.text)
            if end <= self.sent or not self.text[:end].strip():
                return None, None  # nothing new, or only whitespace so far (null if calls follow)
            out, self.sent = self.text[self.sent : end], end
            return {"content": out}, None
        content, calls, reason = finish(self.choice, self.parser, self.text, finish_reason)
        delta: dict = {}
        if calls:
            rest = (content or "")[self.sent :]
            if rest:
                delta["content"] = rest
            delta["tool_calls"] = [c.openai(i) for i, c in enumerate(calls)]
        else:
            rest = self.text[self.sent :]
            delta["content"] = rest
        self.sent = len(self.text)
        return delta, reason


def template_tool_calls(calls, where: str = "tool_calls") -> list[dict]:
    """An assistant message's ``tool_calls`` (OpenAI's form: ``[{"id", "type": "function",
    "function": {"name", "arguments": JSON text}}]``) as chat templates read them: the
    arguments a JSON object, not its text (transformers' convention, which vLLM follows;
    templates write them with ``tojson``).

    Raises:
        ValueError: not a list of function calls with a name and arguments that are a JSON
            object (or its text), naming the entry (``where[i]``).
    """
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where} must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and call.get("type", "function") == "function"):  # fmt: skip
            raise ValueError(
                f'{where}[{i}] must be {{"id", "type": "function", "function": {{"name", '
                '"arguments"}}'
            )
        args = fn.get("arguments", "{}")
        text = _arguments(args)
        if text is None:
            raise ValueError(f"{where}[{i}].function.arguments must be a JSON object (as text)")
        entry = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": json.loads(text)},
        }
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out
