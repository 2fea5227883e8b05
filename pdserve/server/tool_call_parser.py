"""Tool calls read out of a chat answer's text as it streams, a character at a time; the blocking answer is the same
parser run over the whole text, so a stream's deltas always add up to the blocking answer.

The parser never emits what it may have to take back: text that might still become part of a call is held until it
is decided. It yields three kinds of pieces:
- `Content`: message content (tool_choice `auto` only). Whitespace that touches a call is dropped; a candidate call
  that turns out not to be one (no string `name` before its object closes, not JSON) is given back as content.
- `CallStart`: a call's index, id and name, as soon as its name has been read: from then on the call stands.
- `Arguments`: the next fragment of a call's `arguments`: the JSON value exactly as the model wrote it (canonical
  form: the model's own text, not a re-serialisation; for `required` and named calls the grammar made it JSON that
  validates against the function's `parameters`). A call cut off by `max_tokens` keeps the arguments written so far;
  a call without arguments gets `{}` when its object closes.

Formats (`--tool-call-parser`, for `auto`; `required` and a named function are grammar-enforced JSON):
- `qwen25`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks anywhere in the text; the rest of a
  block after its call object, up to `</tool_call>`, is dropped.
- `llama3`: an answer that starts (after an optional `<|python_tag|>`) with a call object `{"name": ..., "parameters":
  ...}`, then more separated by `;`; any other answer is content, and so is free text after the calls.
- `required`: a JSON array of call objects; a named function: the whole output is that call's arguments.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass
from enum import Enum, auto

from pdserve.server.tool_calls import LLAMA3_PYTHON_TAG, ToolChoice

QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")


@dataclass(slots=True, frozen=True)
class Content:
    text: str


@dataclass(slots=True, frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True, frozen=True)
class Arguments:
    index: int
    text: str


Piece = Content | CallStart | Arguments


class Push(Enum):
    TAKEN = auto()  # the character belongs to the object
    CLOSED = auto()  # ... and was its closing brace
    BAD = auto()  # the character does not fit: the object is malformed there (the character is not taken)


class _Field(Enum):
    KEY_OR_END = auto()
    KEY = auto()
    COLON = auto()
    VALUE_START = auto()
    VALUE = auto()
    AFTER_VALUE = auto()


class CallObject:
    """One call object `{"name": ..., "arguments" | "parameters": ...}`, read a character at a time after its `{`.
    `name` is set once its value has been read; `arguments` gathers the text of the first arguments (or parameters)
    value, for its reader to take."""

    __slots__ = ("state", "raw", "key", "opener", "depth", "in_string", "escaped", "capturing", "name", "arguments",
                 "has_arguments")

    def __init__(self) -> None:
        self.state = _Field.KEY_OR_END
        self.raw = ""  # the key being read, or the name's value
        self.key: str | None = None
        self.opener = ""  # the first character of the value being read
        self.depth = 0  # nesting inside a compound value
        self.in_string = self.escaped = False
        self.capturing = False  # the value being read is the call's arguments
        self.name: str | None = None
        self.arguments = ""
        self.has_arguments = False

    def push(self, c: str) -> Push:
        state = self.state
        if state is _Field.KEY_OR_END:
            return self._key_or_end(c)
        if state is _Field.KEY:
            return self._key(c)
        if state is _Field.COLON:
            return self._colon(c)
        if state is _Field.VALUE_START:
            return self._value_start(c)
        if state is _Field.VALUE:
            return self._value(c)
        if c == ",":
            self.state = _Field.KEY_OR_END
            return Push.TAKEN
        return self._end(c)

    def _key_or_end(self, c: str) -> Push:
        if c == '"':
            self.state, self.raw, self.escaped = _Field.KEY, c, False
            return Push.TAKEN
        return self._end(c)

    def _end(self, c: str) -> Push:
        if c.isspace():
            return Push.TAKEN
        return Push.CLOSED if c == "}" and self.name is not None else Push.BAD

    def _key(self, c: str) -> Push:
        self.raw += c
        if self._string_ends(c):
            try:
                self.key = json.loads(self.raw)
            except json.JSONDecodeError:
                return Push.BAD
            self.state = _Field.COLON
        return Push.TAKEN

    def _colon(self, c: str) -> Push:
        if c == ":":
            self.state = _Field.VALUE_START
            return Push.TAKEN
        return Push.TAKEN if c.isspace() else Push.BAD

    def _string_ends(self, c: str) -> bool:
        """After `c`, inside a string opened before it: whether `c` closed it."""
        if self.escaped:
            self.escaped = False
            return False
        self.escaped = c == "\\"
        return c == '"'

    def _value_start(self, c: str) -> Push:
        if c.isspace():
            return Push.TAKEN
        if c not in '{["' and c not in SCALAR_CHARS:
            return Push.BAD
        self.state, self.opener, self.raw = _Field.VALUE, c, ""
        self.depth, self.in_string, self.escaped = (1 if c in "{[" else 0), False, False
        self.capturing = self.key in ARGUMENT_KEYS and not self.has_arguments
        self.has_arguments = self.has_arguments or self.capturing
        self._keep(c)
        return Push.TAKEN

    def _value(self, c: str) -> Push:
        if self.opener not in '{["' and c not in SCALAR_CHARS:
            return self._value_done() or self.push(c)  # a scalar ends at the first character not its own
        self._keep(c)
        if self._value_ends(c):
            return self._value_done() or Push.TAKEN
        return Push.TAKEN

    def _keep(self, c: str) -> None:
        """Only the name's value is kept whole (to be decoded); the arguments' text goes to its reader."""
        if self.key == "name":
            self.raw += c
        if self.capturing:
            self.arguments += c

    def _value_ends(self, c: str) -> bool:
        if self.opener == '"':
            return self._string_ends(c)
        if self.opener not in "{[":
            return False
        if self.in_string:
            self.in_string = not self._string_ends(c)
        elif c == '"':
            self.in_string, self.escaped = True, False
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
        return self.depth == 0

    def _value_done(self) -> Push | None:
        """The value ended: a `name` must be a string (else the object is no call: BAD); None to go on."""
        self.state, self.capturing = _Field.AFTER_VALUE, False
        if self.key != "name" or self.name is not None:
            return None
        try:
            name = json.loads(self.raw)
        except json.JSONDecodeError:
            return Push.BAD
        if not isinstance(name, str):
            return Push.BAD
        self.name = name
        return None


class ToolCallStream:
    """The pieces of one choice's answer, fed its text as it arrives; `finish` once the text has ended."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.num_calls = 0
        self.call: CallObject | None = None
        self.committed = False  # the call being read has started (its name is known)
        self.held = ""  # text of a candidate call, given back as content if it is none
        self.pending_ws = ""  # content whitespace, emitted once text that is no call follows it
        self.after_call = False  # whitespace right after a call is dropped

    def feed(self, text: str) -> list[Piece]:
        for c in text:
            self._char(c)
        return self._take()

    def finish(self) -> list[Piece]:
        self._flush()
        if self.pending_ws:
            self.pieces.append(Content(self.pending_ws))
            self.pending_ws = ""
        return self._take()

    def _char(self, c: str) -> None:
        """Read one character of the answer; each parser reads its own format, plain text is all content."""
        self._content(c)

    def _flush(self) -> None:
        """Give back the text of a candidate call still undecided at the end of the text."""
        self._content(self.held)
        self.held = ""

    def _take(self) -> list[Piece]:
        """The pieces so far, each run of content or of one call's arguments joined into one piece."""
        merged: list[Piece] = []
        for _, run in itertools.groupby(self.pieces, key=_run_key):
            first, *rest = run
            if isinstance(first, CallStart) or not rest:
                merged.append(first)
            else:
                text = first.text + "".join(piece.text for piece in rest)
                merged.append(Content(text) if isinstance(first, Content) else Arguments(first.index, text))
        self.pieces = []
        return merged

    def _content(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        body = text.rstrip()
        if body:
            self.pieces.append(Content(self.pending_ws + body))
            self.pending_ws = ""
        self.pending_ws += text[len(body):]

    def _start_call(self, name: str) -> None:
        self.pieces.append(CallStart(self.num_calls, f"call_{uuid.uuid4().hex[:24]}", name))
        self.num_calls += 1
        self.committed, self.held, self.pending_ws = True, "", ""

    def _open_call(self) -> None:
        self.call, self.committed = CallObject(), False

    def _push_call(self, c: str) -> Push:
        """`c` into the call object; the call starts once its name is known, its arguments follow as they come.
        A call that ended (closed, or malformed once started) is done with."""
        call = self.call
        result = call.push(c)
        if not self.committed and call.name is not None:
            self._start_call(call.name)
        if self.committed and call.arguments:
            self.pieces.append(Arguments(self.num_calls - 1, call.arguments))
            call.arguments = ""
        if result is Push.CLOSED and not call.has_arguments:
            self.pieces.append(Arguments(self.num_calls - 1, "{}"))
        if result is Push.TAKEN and not self.committed:
            self.held += c
        if result is Push.CLOSED or result is Push.BAD and self.committed:
            self.call, self.after_call = None, True
        return result


def _run_key(piece: Piece) -> object:
    if isinstance(piece, Arguments):
        return piece.index
    return "content" if isinstance(piece, Content) else id(piece)


class _Qwen(Enum):
    TEXT = auto()
    OPEN = auto()  # after <tool_call>, before the object's `{`
    CALL = auto()
    CLOSE = auto()  # after the call object, up to </tool_call>


class QwenToolCalls(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = _Qwen.TEXT
        self.tag = ""  # the text state's possible start of <tool_call>; the close state's last characters

    def feed(self, text: str) -> list[Piece]:
        """Text away from any `<` is content at once; the rest is read a character at a time."""
        start = 0
        while start < len(text):
            if self.state is _Qwen.TEXT and not self.tag:
                end = text.find("<", start)
                end = len(text) if end < 0 else end
                self._content(text[start:end])
                start = end
                if start == len(text):
                    break
            self._char(text[start])
            start += 1
        return self._take()

    def _char(self, c: str) -> None:
        if self.state is _Qwen.TEXT:
            self._text(c)
        elif self.state is _Qwen.OPEN:
            self._open(c)
        elif self.state is _Qwen.CALL:
            self._in_call(c)
        else:
            self._close(c)

    def _text(self, c: str) -> None:
        self.tag += c
        while self.tag and not QWEN_OPEN.startswith(self.tag):
            self._content(self.tag[0])
            self.tag = self.tag[1:]
        if self.tag == QWEN_OPEN:
            self.held, self.pending_ws, self.tag, self.state = self.pending_ws + QWEN_OPEN, "", "", _Qwen.OPEN

    def _open(self, c: str) -> None:
        if c.isspace() or c == "{":
            self.held += c
            if c == "{":
                self._open_call()
                self.state = _Qwen.CALL
        else:
            self._give_back(c)

    def _in_call(self, c: str) -> None:
        result = self._push_call(c)
        if self.call is None:
            self.state = _Qwen.CLOSE
            if result is Push.BAD:
                self._close(c)
        elif result is Push.BAD:
            self.call = None
            self._give_back(c)

    def _give_back(self, c: str) -> None:
        """The candidate is no call: its text is content, and `c` is read as text again."""
        held, self.held, self.state = self.held, "", _Qwen.TEXT
        self._content(held)
        self._text(c)

    def _close(self, c: str) -> None:
        self.tag = (self.tag + c)[-len(QWEN_CLOSE):]
        if self.tag == QWEN_CLOSE:
            self.tag, self.state = "", _Qwen.TEXT

    def _flush(self) -> None:
        if self.state is _Qwen.TEXT:
            self._content(self.tag)
        self.tag = ""
        super()._flush()


class _Llama3(Enum):
    START = auto()  # before the first call: whitespace and the python tag
    CALL = auto()
    BETWEEN = auto()  # after a call: whitespace and `;` before the next one
    TEXT = auto()  # content to the end


class Llama3ToolCalls(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = _Llama3.START

    def feed(self, text: str) -> list[Piece]:
        if self.state is not _Llama3.TEXT:
            return super().feed(text)
        self._content(text)
        return self._take()

    def _char(self, c: str) -> None:
        if self.state is _Llama3.START:
            self._start(c)
        elif self.state is _Llama3.CALL:
            self._in_call(c)
        elif self.state is _Llama3.BETWEEN:
            self._between(c)
        else:
            self._content(c)

    def _start(self, c: str) -> None:
        self.held += c
        head = self.held.lstrip()
        if not head or LLAMA3_PYTHON_TAG.startswith(head):
            return
        rest = head.removeprefix(LLAMA3_PYTHON_TAG).lstrip()
        if rest == "{":
            self._open_call()
            self.state = _Llama3.CALL
        elif rest:
            self._give_back("")

    def _in_call(self, c: str) -> None:
        result = self._push_call(c)
        if self.call is None:
            self.state = _Llama3.BETWEEN
            if result is Push.BAD:
                self._between(c)
        elif result is Push.BAD:
            self.call = None
            self._give_back(c)

    def _give_back(self, c: str) -> None:
        held, self.held, self.state = self.held, "", _Llama3.TEXT
        self._content(held + c)

    def _between(self, c: str) -> None:
        if c == "{":
            self.held = c
            self._open_call()
            self.state = _Llama3.CALL
        elif not c.isspace() and c != ";":
            self.state = _Llama3.TEXT
            self._content(c)


class _Array(Enum):
    START = auto()
    ITEM = auto()
    CALL = auto()
    AFTER = auto()
    DONE = auto()


class RequiredToolCalls(ToolCallStream):
    """tool_choice `required`: the grammar's JSON array of call objects; no content."""

    def __init__(self) -> None:
        super().__init__()
        self.state = _Array.START

    def _char(self, c: str) -> None:
        if self.state is _Array.CALL:
            result = self._push_call(c)
            if result is not Push.TAKEN:
                self.call, self.held, self.state = None, "", _Array.AFTER
                if result is Push.BAD:
                    self._char(c)
        elif not c.isspace():
            self.state = self._after_punctuation(c)

    def _after_punctuation(self, c: str) -> _Array:
        state = self.state
        if state is _Array.START and c == "[" or state is _Array.AFTER and c == ",":
            return _Array.ITEM
        if state is _Array.ITEM and c == "{":
            self._open_call()
            return _Array.CALL
        return _Array.DONE

    def _flush(self) -> None:
        self.held = ""  # no content: an unfinished call object without a name is dropped


class NamedToolCall(ToolCallStream):
    """A named function: the whole output is its arguments (outer whitespace dropped)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.started = False  # the first non-whitespace character of the arguments came

    def feed(self, text: str) -> list[Piece]:
        if not self.num_calls:
            self._start_call(self.name)
        return super().feed(text)

    def finish(self) -> list[Piece]:
        if not self.num_calls:
            self._start_call(self.name)
        self.pending_ws = ""
        return self._take()

    def _char(self, c: str) -> None:
        if c.isspace():
            self.pending_ws += c if self.started else ""
        else:
            self.pieces.append(Arguments(0, self.pending_ws + c))
            self.pending_ws, self.started = "", True


class PlainContent(ToolCallStream):
    """tool_choice `none`: the text as it is."""

    def feed(self, text: str) -> list[Piece]:
        return [Content(text)] if text else []

    def finish(self) -> list[Piece]:
        return []


def tool_call_stream(choice: ToolChoice, parser: str) -> ToolCallStream:
    if choice.mode == "none":
        return PlainContent()
    if choice.mode == "named":
        return NamedToolCall(choice.name)
    if choice.mode == "required":
        return RequiredToolCalls()
    return Llama3ToolCalls() if parser == "llama3" else QwenToolCalls()


def parse_tool_calls(text: str, choice: ToolChoice, parser: str = "qwen25") -> tuple[str | None, list[dict]]:
    """(the message's content, its OpenAI tool_calls) of a whole answer: the stream's pieces put together."""
    stream = tool_call_stream(choice, parser)
    return assemble(stream.feed(text) + stream.finish())


def assemble(pieces: list[Piece]) -> tuple[str | None, list[dict]]:
    content, calls = "", []
    for piece in pieces:
        if isinstance(piece, Content):
            content += piece.text
        elif isinstance(piece, CallStart):
            calls.append({"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}})
        else:
            calls[piece.index]["function"]["arguments"] += piece.text
    return (content or None) if calls else content, calls
