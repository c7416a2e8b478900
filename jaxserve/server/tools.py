"""Tool calling: reading the calls a model writes, forcing them with a grammar, and rendering tools in a prompt.

A model writes a tool call as text in its chat template's format. Three formats are read here:

* ``hermes`` (Qwen2.5, Qwen3, Hermes, SmolLM3 and most templates that mention ``<tool_call>``)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole answer is one or more JSON objects, separated by ``;``,
  optionally after ``<|python_tag|>``: ``{"name": "get_weather", "parameters": {"city": "Paris"}}``.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list ``[{"name": ..., "arguments": {...}}, ...]`` (or the
  newer ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``).

``ToolCallParser.feed`` reads the output as it streams and returns events (content outside the calls, a call's
start with its name, pieces of its arguments); ``parse`` reads a finished output at once. The format is picked
from the chat template's text (``parser_for_template``) unless the server is told (``--tool-call-parser``).

``tool_call_grammar`` writes a Lark grammar (llguidance's dialect) that only admits calls, in the parser's
format, of the allowed functions with arguments valid under their JSON schemas (each embedded with ``%json``):
how ``tool_choice="required"`` and a named ``tool_choice`` are enforced.

``tools_system_prompt`` renders the tools as a system prompt, for chat templates that ignore ``tools``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from jaxserve.server.errors import APIError

MAX_TOOL_CALLS = 8  # most calls an enforced (tool_choice "required") answer may hold with parallel_tool_calls
# JSON inside an enforced call: one space after ":" and ",", no other free whitespace (a small model would
# otherwise be free to write whitespace forever)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_WS = " \t\r\n"


def new_call_id() -> str:
    """A fresh tool call id, ``call_`` and 24 hex digits (OpenAI's shape)."""
    return "call_" + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------------------------------------------- events
@dataclasses.dataclass
class ContentDelta:
    """Text outside any tool call."""

    text: str


@dataclasses.dataclass
class CallStart:
    """A tool call begins: its index in the answer, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclasses.dataclass
class ArgsDelta:
    """More of the arguments (a JSON text) of call ``index``; the pieces of one call join to its arguments."""

    index: int
    text: str


@dataclasses.dataclass
class ToolCall:
    """A finished call: ``arguments`` is a JSON text (an object)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedOutput:
    """A finished output split into content (None when the answer is only calls) and calls."""

    content: str | None
    calls: list[ToolCall]


# ---------------------------------------------------------------------------------------------------- JSON scan
class _JsonStrings:
    """Where a character-by-character JSON reader is relative to strings (``in_str``, and an escape pending)."""

    in_str = False
    esc = False

    def _string_char(self, ch: str) -> bool:
        """Reads ``ch`` inside a string (``in_str``); returns True when it closes the string."""
        if self.esc:
            self.esc = False
        elif ch == "\\":
            self.esc = True
        elif ch == '"':
            self.in_str = False
            return True
        return False


class _CallScan(_JsonStrings):
    """Reads one JSON object ``{"name": ..., "arguments": ...}`` a piece at a time.

    Tracks strings, nesting and, at the object's top level, each key and where its value starts and ends, so
    the name is known as soon as its string closes and the arguments can be passed on while they are written.
    ``args_keys``: the keys that hold the arguments (the first one present is used).
    """

    def __init__(self, args_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.args_keys = args_keys
        self.text = ""  # the object's text so far (from its "{")
        self.depth = 0
        self.in_str = self.esc = False
        self.phase = "start"  # start, key, colon, value, after
        self.key: str | None = None
        self.key_start = -1
        self.value_start: int | None = None
        self.values: dict[str, tuple[int, int]] = {}  # top-level key -> (start, end) of its value's text
        self.first_key: str | None = None
        self.done = False  # the object closed
        self.invalid = False  # not an object (the first character is not "{")

    def feed(self, s: str) -> int:
        """Reads ``s``; returns how many of its characters belong to the object (fewer once it has closed)."""
        for i, ch in enumerate(s):
            if self.done or self.invalid:
                return i
            if self.phase == "start":
                if ch in _WS:
                    continue
                if ch != "{":
                    self.invalid = True
                    return i
                self.text, self.depth, self.phase = "{", 1, "key"
                continue
            pos = len(self.text)
            self.text += ch
            self._char(ch, pos)
            if self.done:
                return i + 1
        return len(s)

    def _char(self, ch: str, pos: int) -> None:
        if self.in_str:
            if self._string_char(ch) and self.depth == 1:
                self._string_end(pos)
            return
        if ch == '"':
            self.in_str = True
            if self.depth == 1:
                if self.phase == "key":
                    self.key_start = pos
                elif self.phase == "value" and self.value_start is None:
                    self.value_start = pos
            return
        if ch in "{[":
            if self.depth == 1 and self.phase == "value" and self.value_start is None:
                self.value_start = pos
            self.depth += 1
            return
        if ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                if self.phase == "value" and self.value_start is not None:
                    self._value_end(pos)
                self.done = True
            elif self.depth == 1 and self.phase == "value":
                self._value_end(pos + 1)
            return
        if self.depth != 1:
            return
        if ch == ":" and self.phase == "colon":
            self.phase, self.value_start = "value", None
        elif ch == ",":
            if self.phase == "value" and self.value_start is not None:
                self._value_end(pos)
            self.phase = "key"
        elif ch not in _WS and self.phase == "value" and self.value_start is None:
            self.value_start = pos  # a number, true, false or null

    def _string_end(self, pos: int) -> None:
        if self.phase == "key":
            try:
                self.key = json.loads(self.text[self.key_start : pos + 1])
            except ValueError:
                self.key = None
            if self.first_key is None:
                self.first_key = self.key
            self.phase = "colon"
        elif self.phase == "value" and self.value_start is not None and self.text[self.value_start] == '"':
            self._value_end(pos + 1)

    def _value_end(self, end: int) -> None:
        raw = self.text[self.value_start : end].rstrip(_WS)
        if self.key is not None:
            self.values.setdefault(self.key, (self.value_start, self.value_start + len(raw)))
        self.phase = "after"

    # -- what is known so far
    @property
    def name(self) -> str | None:
        """The function's name once its string is complete (None before, or when it is not a string)."""
        span = self.values.get("name")
        if span is None:
            return None
        try:
            v = json.loads(self.text[span[0] : span[1]])
        except ValueError:
            return None
        return v if isinstance(v, str) else None

    def _args_key(self) -> str | None:
        for k in self.args_keys:
            if k in self.values:
                return k
        if self.phase == "value" and self.key in self.args_keys:
            return self.key
        return None

    def args_so_far(self) -> str:
        """The arguments' JSON text as far as it can be passed on now: an object or list while it is written,
        a string argument (JSON inside a string) or a scalar once complete, ``{}`` if the object ended without
        arguments."""
        key = self._args_key()
        if key is None:
            return "{}" if self.done else ""
        span = self.values.get(key)
        if span is not None:
            raw = self.text[span[0] : span[1]]
            if raw.startswith('"'):
                try:
                    return json.loads(raw)
                except ValueError:
                    return raw
            return "{}" if raw == "null" else raw
        start = self.value_start
        if start is None or self.text[start] not in "{[":
            return ""  # a string or scalar is passed on when complete
        return self.text[start:]


# ---------------------------------------------------------------------------------------------------- parsers
class ToolCallParser:
    """Splits a model's output into content and tool calls, incrementally (``feed`` / ``finish``).

    Subclasses say where calls start (``markers``) and read what follows a marker (``_read_calls``). Whitespace
    next to a call is not content; text that might be the start of a marker is held back until it is known.
    """

    name = ""
    markers: tuple[str, ...] = ()
    args_key = "arguments"  # the key of the arguments in this format's calls

    def __init__(self):
        self.pending = ""  # text not yet handed on
        self.mode = "text"
        self.calls: list[ToolCall] = []
        self.invalid = False  # a call region that did not hold valid calls (its text went out as content)
        self.seen_text = False  # non-whitespace content was handed on
        self._scan: _CallScan | None = None
        self._raw = ""  # the text of the call region being read (handed on as content if it is not a call)
        self._started = False  # the current scan's call was announced (CallStart)
        self._args_sent = 0
        self._events: list = []
        self._after_call = False

    # -- public
    def feed(self, text: str) -> list:
        """Reads more output; returns the events it completes (ContentDelta, CallStart, ArgsDelta)."""
        self.pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list:
        """The output ended: hands on whatever was held back and closes an unfinished call."""
        self._run(final=True)
        if self.mode != "text":
            self._abandon_region()
            self._run(final=True)
        return self._take()

    def parse(self, text: str) -> ParsedOutput:
        """A whole output at once. If any call in it is malformed, the whole text is content and no call is
        returned (a streamed answer cannot take back what it sent, so it keeps the well-formed calls)."""
        events = self.feed(text) + self.finish()
        if self.invalid or any(not _is_json_object(c.arguments) for c in self.calls):
            return ParsedOutput(text, [])
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return ParsedOutput(content or (None if self.calls else ""), list(self.calls))

    # -- machinery
    def _take(self) -> list:
        events, self._events = self._events, []
        return _merge_content(events)

    def _content(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))
            self.seen_text = self.seen_text or bool(text.strip(_WS))

    def _run(self, final: bool) -> None:
        while True:
            before = (self.mode, len(self.pending))
            if self.mode == "text":
                self._read_text(final)
            else:
                self._read_calls(final)
            if (self.mode, len(self.pending)) == before:
                return

    def _region_start(self, text: str) -> tuple[int, str] | None:
        """Where the earliest call region starts in ``text`` (index, marker), or None."""
        hits = [(text.find(m), m) for m in self.markers if m in text]
        return min(hits) if hits else None

    def _read_text(self, final: bool) -> None:
        text = self.pending
        if self._after_call:  # whitespace right after a call is not content
            stripped = text.lstrip(_WS)
            if not stripped:
                self.pending = ""
                return
            text, self._after_call = stripped, False
        hit = self._region_start(text)
        if hit is not None:
            at, marker = hit
            self._content(text[:at].rstrip(_WS))  # nor is whitespace right before one
            self.pending = text[at + len(marker) :]
            self._enter_region(marker)
            return
        if final:
            self._content(text.rstrip(_WS) if self.calls else text)
            self.pending = ""
            return
        out = text[: len(text) - _held_back(text, self.markers)]
        body = out.rstrip(_WS)  # trailing whitespace waits: a call may follow it
        self._content(body)
        self.pending = text[len(body) :]

    def _enter_region(self, marker: str) -> None:
        self.mode = "calls"
        self._raw = marker
        self._new_scan()

    def _new_scan(self) -> None:
        self._scan = _CallScan((self.args_key, "arguments", "parameters"))
        self._started = False
        self._args_sent = 0

    def _advance_scan(self):
        """Feeds the pending text to the open JSON object; a complete valid one ends it, an invalid one abandons the
        region (its text stays content)."""
        if self._feed_scan():
            if self._object_done_valid():
                self._scan = None
        elif self._scan.invalid:
            self._abandon_region()

    def _feed_scan(self) -> bool:
        """Feeds pending text to the current object; emits its call's progress; True once the object closed."""
        scan = self._scan
        used = scan.feed(self.pending)
        self._raw += self.pending[:used]
        self.pending = self.pending[used:]
        if scan.invalid:
            return False
        self._progress(scan.name, scan.args_so_far(), scan.done)
        return scan.done

    def _progress(self, name: str | None, args: str, done: bool) -> None:
        """Announces the current call once its name is known, then passes on new argument text."""
        if not self._started:
            if name is None:
                return
            self.calls.append(ToolCall(new_call_id(), name, ""))
            self._events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))
            self._started = True
        call = self.calls[-1]
        if len(args) > self._args_sent and args.startswith(call.arguments):
            piece = args[self._args_sent :]
            call.arguments = args
            self._args_sent = len(args)
            self._events.append(ArgsDelta(len(self.calls) - 1, piece))
        if done and not call.arguments:
            call.arguments = "{}"
            self._events.append(ArgsDelta(len(self.calls) - 1, "{}"))

    def _abandon_region(self) -> None:
        """The region ended without a complete call: an announced call stays (it is malformed); text of a call
        never announced goes out as content."""
        if self._started:
            self.invalid = True
        else:
            self._content(self._raw)
            if self.calls:
                self.invalid = True
        self._raw = ""
        self._scan = None
        self.mode = "text"

    def _close_region(self) -> None:
        self._raw = ""
        self._scan = None
        self.mode = "text"
        self._after_call = True

    def _read_calls(self, final: bool) -> None:  # pragma: no cover - each format reads its own
        raise NotImplementedError

    def _object_done_valid(self) -> bool:
        """After an object closed: whether it was a call (a string name); if not, the region is abandoned."""
        if self._scan.name is None:
            self._abandon_region()
            return False
        return True

    # -- prompts and grammars
    def format_call(self, name: str, arguments: dict | str) -> str:
        """One call in this format, as a model would write it (for replaying past calls as text)."""
        raise NotImplementedError

    def instructions(self) -> str:
        """How to call a function, for the tools system prompt."""
        raise NotImplementedError

    def grammar(self, functions: list[str], max_calls: int, marker_rule: str | None = None) -> str:
        """A Lark grammar admitting 1 to ``max_calls`` calls; ``functions`` are the ``%json`` rules' texts, one
        per allowed function; ``marker_rule``: how to write the marker when it is a special token."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, with text around them."""

    name = "hermes"
    markers = ("<tool_call>",)
    end = "</tool_call>"

    def _read_calls(self, final: bool) -> None:
        if self._scan is None:  # the object closed: whitespace, then the end tag
            text = self.pending.lstrip(_WS)
            if text.startswith(self.end):
                self.pending = text[len(self.end) :]
                self._close_region()
            elif text and not self.end.startswith(text):
                self.pending = text  # no end tag: carry on with the text
                self._close_region()
            elif final:
                self.pending = ""
                self._close_region()
            return
        self._advance_scan()

    def format_call(self, name, arguments):
        args = arguments if isinstance(arguments, dict) else _loads_or(arguments)
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"

    def instructions(self):
        return (
            "For each function call, return a JSON object with the function name and its arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def grammar(self, functions, max_calls, marker_rule=None):
        start = marker_rule or json.dumps("<tool_call>")
        rep = f' ("\\n" call){{0,{max_calls - 1}}}' if max_calls > 1 else ""
        return f'start: call{rep}\ncall: {start} "\\n" fn "\\n" {json.dumps(self.end)}\n' + _fn_rules(functions)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1's JSON calls: the answer starts with ``{"name": ..., "parameters": {...}}`` (or with
    ``<|python_tag|>``), more calls separated by ``;``. An answer that starts otherwise is content."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    args_key = "parameters"

    def _region_start(self, text):
        if not self.seen_text and not self.calls:
            stripped = text.lstrip(_WS)
            if stripped.startswith("{"):
                return len(text) - len(stripped), ""
        return super()._region_start(text)

    def _read_calls(self, final):
        if self._scan is None:  # between objects: whitespace and ";", then "{" (another call) or the end
            text = self.pending.lstrip(_WS + ";")
            if text.startswith("{"):
                self.pending = text
                self._raw = ""
                self._new_scan()
            elif text or final:
                self.pending = text
                self._close_region()
            return
        self._advance_scan()

    def format_call(self, name, arguments):
        args = arguments if isinstance(arguments, dict) else _loads_or(arguments)
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)

    def instructions(self):
        return (
            'To call a function, answer with only a JSON object of the form {"name": <function-name>, '
            '"parameters": <args-json-object>}; separate several calls with "; ".'
        )

    def grammar(self, functions, max_calls, marker_rule=None):
        rep = f' ("; " fn){{0,{max_calls - 1}}}' if max_calls > 1 else ""
        return f"start: fn{rep}\n" + _fn_rules(functions)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def __init__(self):
        super().__init__()
        self._list = False  # inside "[...]"
        self._named: str | None = None  # the [ARGS] form: the name read
        self._value: _ValueScan | None = None

    def _read_calls(self, final):
        if self._value is not None:  # [ARGS] form: the arguments value
            used = self._value.feed(self.pending)
            self._raw += self.pending[:used]
            self.pending = self.pending[used:]
            self._progress(
                self._named,
                self._value.text if self._value.text[:1] in "{[" or self._value.done else "",
                self._value.done,
            )
            if self._value.invalid:
                self._abandon_region()
            elif self._value.done:
                self._value = self._named = None
                self._close_region()
            return
        if self._scan is None or (not self._list and not self._scan.text):
            text = self.pending.lstrip(_WS)
            if not text and not final:
                return
            if self._list:  # after a call in the list: "," or "]"
                if text.startswith(","):
                    self.pending = text[1:]
                    self._new_scan()
                elif text.startswith("]"):
                    self.pending = text[1:]
                    self._list = False
                    self._close_region()
                else:
                    self.pending = text
                    self._list = False
                    self._close_region()
                return
            if text.startswith("["):
                self._list = True
                self.pending = text[1:]
                self._raw += "["
                self._new_scan()
                return
            if not text.startswith("{"):  # the [ARGS] form: a name up to "[ARGS]"
                at = text.find("[ARGS]")
                if at < 0:
                    if final or len(text) > 128:
                        self.pending = text
                        self._abandon_region()
                    return
                self._named = text[:at].strip(_WS)
                self._raw += text[: at + 6]
                self.pending = text[at + 6 :]
                self._new_scan()
                self._value = _ValueScan()
                return
            self.pending = text  # one bare object
        if self._feed_scan():
            if self._object_done_valid():
                self._scan = None
                if not self._list:
                    self._close_region()
        elif self._scan.invalid:
            self._abandon_region()

    def _abandon_region(self):
        self._list = False
        self._value = self._named = None
        super()._abandon_region()

    def format_call(self, name, arguments):
        args = arguments if isinstance(arguments, dict) else _loads_or(arguments)
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}], ensure_ascii=False)

    def instructions(self):
        return (
            "To call functions, answer with [TOOL_CALLS] followed by a JSON list of the calls: "
            '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
        )

    def grammar(self, functions, max_calls, marker_rule=None):
        start = marker_rule or json.dumps("[TOOL_CALLS]")
        rep = f' (", " fn){{0,{max_calls - 1}}}' if max_calls > 1 else ""
        return f'start: {start} "[" fn{rep} "]"\n' + _fn_rules(functions)


class _ValueScan(_JsonStrings):
    """Reads one JSON object or list a piece at a time, up to its closing bracket."""

    def __init__(self):
        self.text = ""
        self.depth = 0
        self.in_str = self.esc = False
        self.done = self.invalid = False

    def feed(self, s: str) -> int:
        for i, ch in enumerate(s):
            if self.done:
                return i
            if not self.text:
                if ch in _WS:
                    continue
                if ch not in "{[":
                    self.invalid = True
                    return i
            self.text += ch
            if self.in_str:
                self._string_char(ch)
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(s)


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's text calls for: ``[TOOL_CALLS]`` -> mistral, ``<|python_tag|>`` or an
    ``ipython`` role -> llama3_json, otherwise (``<tool_call>`` or no sign at all) hermes."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def get_parser(name: str) -> ToolCallParser:
    """A fresh parser of the named format (one per output: parsers keep state)."""
    return PARSERS[name]()


# ---------------------------------------------------------------------------------------------------- grammars
def _fn_rules(functions: list[str]) -> str:
    names = [f"fn_{i}" for i in range(len(functions))]
    return f"fn: {' | '.join(names)}\n" + "".join(f"{n}: %json {s}\n" for n, s in zip(names, functions))


def _rebase_refs(node, base: str):
    """A copy of a schema whose local ``$ref``s ("#...") point into it at ``base`` of an enclosing schema."""
    if isinstance(node, dict):
        return {
            k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def call_schema(name: str, parameters: dict | None, args_key: str = "arguments") -> dict:
    """The JSON schema of one call object ``{"name": name, args_key: <arguments>}`` (name first). Missing
    parameters mean a function without arguments (``{}``), as in OpenAI's API."""
    params = parameters if parameters else {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: _rebase_refs(params, f"#/properties/{args_key}")},
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": _JSON_STYLE,
    }


def tool_call_grammar(parser: str, tools: list[dict], max_calls: int, marker_token_id: int | None = None) -> str:
    """A Lark grammar (llguidance's dialect) admitting only 1 to ``max_calls`` calls of these functions, in the
    named parser's format, each call's arguments valid under its function's ``parameters`` schema.

    Args:
        tools: OpenAI function definitions (``{"name", "parameters", ...}``), the allowed ones.
        marker_token_id: the token id of the format's marker when the tokenizer has it as a special token (the
            grammar then asks for that token, not the marker's spelling).
    """
    p = PARSERS[parser]
    rules = [json.dumps(call_schema(t["name"], t.get("parameters"), p.args_key), ensure_ascii=False) for t in tools]
    marker = f"<[{marker_token_id}]>" if marker_token_id is not None else None
    return p().grammar(rules, max_calls, marker)


# ---------------------------------------------------------------------------------------------------- prompts
def tools_system_prompt(tools: list[dict], parser: str) -> str:
    """The tools as a system prompt (Hermes style: the definitions in ``<tools>``, then how to call), for chat
    templates that do not render ``tools`` themselves."""
    defs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{defs}\n</tools>"
        f"\n\n{PARSERS[parser]().instructions()}"
    )


# ---------------------------------------------------------------------------------------------------- requests
@dataclasses.dataclass
class ToolPlan:
    """What a chat request asks of tools.

    ``tools``: the OpenAI tool definitions to render (empty: none); ``functions``: their function parts;
    ``parse``: read tool calls out of the output; ``forced``: the functions a call must be made to (enforced by
    a grammar), or None; ``max_calls``: most calls when forced; ``legacy``: the request used ``functions`` /
    ``function_call`` (answered with ``message.function_call``).
    """

    tools: list[dict]
    functions: list[dict]
    parse: bool
    forced: list[dict] | None
    max_calls: int
    legacy: bool


def plan_tools(req) -> ToolPlan:
    """Reads ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the legacy ``functions`` /
    ``function_call`` of a chat request.

    ``tool_choice``: "none" (tools are not offered: not rendered, not parsed), "auto" (the default with tools:
    the model may call; its calls are parsed), "required" (at least one call, enforced), or a named function
    (exactly one call of it, enforced). ``parallel_tool_calls=false`` allows one call at most.

    Raises:
        APIError: 400 for both ``tools`` and ``functions``, a ``tool_choice`` naming a function not in
            ``tools``, or "required" / a name without tools.
    """
    legacy = req.functions is not None or req.function_call is not None
    if legacy and (req.tools is not None or req.tool_choice is not None):
        raise APIError(
            400, "use tools and tool_choice, or the older functions and function_call, not both", param="functions"
        )
    if legacy:
        functions = [f.model_dump(exclude_none=True) for f in req.functions or []]
        choice, choice_param = req.function_call, "function_call"
    else:
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
        choice, choice_param = req.tool_choice, "tool_choice"
    names = [f["name"] for f in functions]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        field = "functions" if legacy else "tools"
        raise APIError(400, f"{field}: function names must be unique; {dup} appear more than once", param=field)
    if choice is None:
        choice = "auto" if functions else "none"
    named = None if isinstance(choice, str) else (choice.name if legacy else choice.function.name)
    if (named is not None or choice == "required") and not functions:
        raise APIError(
            400,
            f"{choice_param}={json.dumps(choice if named is None else named)} needs "
            f"{'functions' if legacy else 'tools'}, and none were given",
            param=choice_param,
        )
    if named is not None and named not in names:
        raise APIError(
            400,
            f"{choice_param} names the function {named!r}, which is not among the "
            f"{'functions' if legacy else 'tools'} given ({', '.join(names)})",
            param=choice_param,
        )
    if choice == "none":
        return ToolPlan([], [], False, None, 1, legacy)
    tools = [{"type": "function", "function": f} for f in functions]
    one = named is not None or req.parallel_tool_calls is False or legacy
    forced = (
        [f for f in functions if f["name"] == named]
        if named is not None
        else functions
        if choice == "required"
        else None
    )
    return ToolPlan(tools, functions, True, forced, 1 if one else MAX_TOOL_CALLS, legacy)


# ---------------------------------------------------------------------------------------------------- helpers
def _loads_or(text: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could begin a marker (held until more text decides)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _merge_content(events: list) -> list:
    out: list = []
    for e in events:
        if isinstance(e, ContentDelta) and out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + e.text)
        else:
            out.append(e)
    return out
