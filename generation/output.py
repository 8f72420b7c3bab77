"""Turning generated text into protocol output items and stream events.

The assembler is fed the model's text as it is decoded and answers with the
events that text makes: a message item and its deltas, a reasoning item for
``<think>...</think>``, a function call for ``<tool_call>{...}</tool_call>``.
Markers may arrive split over several chunks, so the tail of the text that
could still become a marker is held back until it is decided. When a call is
forced, the prompt already opened it (``opens_call``): the output is the
call's JSON alone, and the assembler starts inside the call.

Its whole state is a JSON dict (``state()``). A checkpoint stores it
without the text of its items (``compact_state()``), which the event log
holds already as deltas, so that writing a checkpoint costs the same at any
length of the answer; a new attempt after a lost worker puts the text back
from the logged deltas (``restore``) and goes on with the next events.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lmsp_core import protocol
from lmsp_core.ids import new_id

if TYPE_CHECKING:
    from .params import GenerationParams
    from .registry import ModelSpec

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The events whose deltas hold the text of message and reasoning items.
TEXT_DELTA_EVENTS = ("response.output_text.delta", "response.reasoning_summary_text.delta")
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# What the prompt ends with when it opens a forced call (``opens_call``).
CALL_OPENING = f"{TOOL_OPEN}\n"


def opens_call(params: GenerationParams, spec: ModelSpec) -> bool:
    """Whether the prompt ends with a call's opening tag (``CALL_OPENING``), so
    that the output is the call's JSON alone, ended by the model's end token.

    When a call is forced (``tool_choice`` ``required`` or a named tool) its
    tags say nothing the request has not decided, yet greedy SmolLM2 spent 12
    output tokens of 32 on them. Opened in the prompt, the tag still shows the
    model the format it was told, and the closing tag is left out: the
    grammar ends with the JSON, and then only an end token is allowed. The
    prompt (``prompts``), the grammar (``schemas``) and the output parser
    (``OutputAssembler.for_generation``) all ask here, so that they agree.
    Only for models that write calls in these tags (``tool_format`` hermes:
    SmolLM2 told so by the tools preamble, Qwen3 by its own chat template),
    the format the grammar forces in any case.
    """
    return params.forces_call and spec.tool_format == "hermes"


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _call_end(body: str) -> int:
    """Where the closing tag of the call ``body`` begins; -1 while none.

    A closing tag inside one of the JSON's strings does not close the call:
    sampled text may write one into an argument (seen at temperature 0.7,
    where the grammar then made it go on with the string), and cut there the
    call's JSON was no call and its markup became the message's text.
    """
    index = body.find(TOOL_CLOSE)
    while index >= 0 and _inside_json_string(body[:index]):
        index = body.find(TOOL_CLOSE, index + 1)
    return index


def _inside_json_string(text: str) -> bool:
    """Whether JSON text ``text`` ends inside a string."""
    inside = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside


def _text_parts(item: dict[str, Any]) -> list[dict[str, Any]]:
    """The parts of an item whose text grows with deltas (none for a function call)."""
    parts: list[dict[str, Any]] = []
    if item["type"] == "message":
        parts = item["content"]
    elif item["type"] == "reasoning":
        parts = item["summary"]
    return parts


def _parse_call(body: str) -> tuple[str, object] | None:
    """The name and arguments of a call's JSON body; None when it is not one."""
    try:
        call = json.loads(body)
        name = call["name"]
        arguments = call.get("arguments", {})
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return (name, arguments) if isinstance(name, str) else None


class OutputAssembler:
    def __init__(
        self,
        response_id: str,
        state: dict[str, Any] | None = None,
        *,
        parse_tools: bool = False,
        parse_reasoning: bool = False,
        in_call: bool = False,
    ) -> None:
        """``in_call``: the prompt opened a call, so the text starts with its
        JSON (``opens_call``); it ends with the generation, no closing tag."""
        self.response_id = response_id
        state = state or {
            "items": [],
            "open": None,
            "mode": "tool" if in_call else "text",
            "buf": "",
            "tools": parse_tools,
            "reasoning": parse_reasoning,
        }
        self._s = state

    @classmethod
    def for_generation(
        cls, response_id: str, params: GenerationParams, spec: ModelSpec
    ) -> OutputAssembler:
        """The assembler for a new generation of ``params`` by the model of
        ``spec``: the one place that says what its output may hold (calls,
        thoughts) and whether it starts inside a call, as its prompt and
        grammar were built."""
        return cls(
            response_id,
            parse_tools=params.calls_tools,
            parse_reasoning=spec.has("reasoning"),
            in_call=opens_call(params, spec),
        )

    # --- state -----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        copied: dict[str, Any] = json.loads(json.dumps(self._s))
        return copied

    def compact_state(self) -> dict[str, Any]:
        """``state()`` without the text of message and reasoning items."""
        compact = copy.deepcopy(self._s)
        for item in compact["items"]:
            for part in _text_parts(item):
                part["text"] = ""
        return compact

    @classmethod
    def restore(
        cls, response_id: str, compact: dict[str, Any], deltas: Iterable[tuple[str, dict[str, Any]]]
    ) -> OutputAssembler:
        """The assembler a ``compact_state()`` came from, its text put back from the
        logged ``TEXT_DELTA_EVENTS`` (event name, data) of the same response."""
        state = copy.deepcopy(compact)
        parts = {item["id"]: _text_parts(item) for item in state["items"]}
        for event, data in deltas:
            if event in TEXT_DELTA_EVENTS and parts.get(data["item_id"]):
                parts[data["item_id"]][0]["text"] += data["delta"]
        return cls(response_id, state)

    @property
    def items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._s["items"]
        return items

    # --- feeding ---------------------------------------------------------------

    def feed(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        s = self._s
        s["buf"] += text
        events: list[tuple[str, dict[str, Any]]] = []
        while True:
            mode, buf = s["mode"], s["buf"]
            if mode == "text":
                markers = self._text_markers()
                found = [(buf.find(m), m) for m in markers if m in buf]
                if found:
                    index, marker = min(found)
                    events += self._text(buf[:index])
                    events += self._close_open()
                    s["buf"] = buf[index + len(marker) :]
                    if marker == THINK_OPEN:
                        s["mode"] = "think"  # the item opens with its first word
                    else:
                        s["mode"] = "tool"
                    continue
                keep = _held_back(buf, markers)
                events += self._text(buf[: len(buf) - keep])
                s["buf"] = buf[len(buf) - keep :]
                return events
            if mode == "think":
                index = buf.find(THINK_CLOSE)
                if index >= 0:
                    events += self._reasoning(buf[:index].rstrip())
                    events += self._close_open()
                    s["buf"] = buf[index + len(THINK_CLOSE) :].lstrip()
                    s["mode"] = "text"
                    continue
                # Trailing whitespace waits too: thoughts end with a line break
                # before the marker, which is not part of the summary.
                said = buf[: len(buf) - _held_back(buf, (THINK_CLOSE,))].rstrip()
                events += self._reasoning(said)
                s["buf"] = buf[len(said) :]
                return events
            # mode == "tool": a call is emitted whole once its closing tag arrives
            # (or, opened by the prompt, at the end: ``close``)
            index = _call_end(buf)
            if index < 0:
                return events
            events += self._tool_call(buf[:index])
            s["buf"] = buf[index + len(TOOL_CLOSE) :]
            s["mode"] = "text"

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """End of generation: settle held-back text and close every item.

        A completed response always has at least one item: a model that says
        nothing at all answers with an empty message.
        """
        events = self.close()
        if not self.items:
            events += self._open("message")
            events += self._close_open()
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """Close what is open, keeping any text held back (cancel, failure, limit).

        A tool call the generation stopped inside is kept only if its JSON is
        already whole (just its closing tag missing); an unfinished one is
        dropped: its arguments are no JSON a client could run, and its markup
        is no text for the message. The response's status (``incomplete``,
        ``cancelled``, ``failed``) says that the output stopped short. A call
        the prompt opened (``in_call``) has no closing tag at all: it is
        emitted here, at the end of the generation, once its JSON is whole.
        """
        s = self._s
        buf, s["buf"] = s["buf"], ""
        mode, s["mode"] = s["mode"], "text"
        if mode == "think":
            events = self._reasoning(buf.rstrip())
        elif mode == "tool":
            buf = buf[: len(buf) - _held_back(buf, (TOOL_CLOSE,))]  # a half closing tag
            whole = _parse_call(buf) is not None
            events = self._close_open() + (self._tool_call(buf) if whole else [])
        else:
            if s["tools"]:  # the start of a call's tag, cut before the tag was whole
                buf = buf[: len(buf) - _held_back(buf, (TOOL_OPEN,))]
            events = self._text(buf)
        return events + self._close_open()

    # --- items -------------------------------------------------------------------

    def _text_markers(self) -> tuple[str, ...]:
        markers: tuple[str, ...] = ()
        if self._s["tools"]:
            markers += (TOOL_OPEN,)
        if self._s["reasoning"] and not self.items:
            markers += (THINK_OPEN,)
        return markers

    def _open(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        if kind == "message":
            item = protocol.message_item(new_id("msg"), "")
            announced = protocol.message_item(item["id"], None)
        else:
            item = protocol.reasoning_item(new_id("rs"), "")
            announced = protocol.reasoning_item(item["id"], None)
        self.items.append(item)
        self._s["open"] = len(self.items) - 1
        return [protocol.item_added_event(self.response_id, self._s["open"], announced)]

    def _close_open(self) -> list[tuple[str, dict[str, Any]]]:
        index = self._s["open"]
        if index is None:
            return []
        self._s["open"] = None
        return [protocol.item_done_event(self.response_id, index, self.items[index])]

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = []
        if self._s["open"] is None:
            text = text.lstrip() if not self.items else text.lstrip("\n")
            if not text:
                return []
            events += self._open("message")
        item = self.items[self._s["open"]]
        item["content"][0]["text"] += text
        events.append(protocol.text_delta_event(self.response_id, item["id"], text))
        return events

    def _reasoning(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """Thoughts, in a reasoning item opened by the first word of them: a
        model that thinks nothing (Qwen3 with thinking off writes an empty
        ``<think></think>``) gets no empty reasoning item."""
        events = []
        if self._s["open"] is None:
            text = text.lstrip()
            if not text:
                return []
            events += self._open("reasoning")
        item = self.items[self._s["open"]]
        item["summary"][0]["text"] += text
        if text:
            events.append(protocol.reasoning_delta_event(self.response_id, item["id"], text))
        return events

    def _tool_call(self, body: str) -> list[tuple[str, dict[str, Any]]]:
        call = _parse_call(body)
        if call is None:
            # Not a call after all: keep what the model wrote as text.
            return self._text(TOOL_OPEN + body)
        name, arguments = call
        if not isinstance(arguments, str):
            arguments = protocol.dumps(arguments)
        item = protocol.function_call_item(new_id("fc"), new_id("call"), name, arguments)
        self.items.append(item)
        index = len(self.items) - 1
        announced = {**item, "arguments": ""}
        return [
            protocol.item_added_event(self.response_id, index, announced),
            protocol.arguments_delta_event(self.response_id, item["id"], arguments),
            protocol.item_done_event(self.response_id, index, item),
        ]
