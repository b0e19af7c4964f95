"""Incremental Server-Sent Events parser over raw bytes.

Pure: no I/O. Feed it whatever the network hands over, in any split; it returns the events
completed by that chunk. It follows the WHATWG event-stream rules with the two liberties a
measuring client needs: an event left without its blank line at EOF is still dispatched by
``finish()``, and comment lines are counted (keep-alives) rather than silently dropped.

Lines are split on bytes before decoding. The terminators (CR, LF) are ASCII and never occur
inside a multi-byte UTF-8 sequence, so a character split across chunks is always reassembled
before it is decoded.
"""

from __future__ import annotations

import dataclasses

DONE = "[DONE]"


@dataclasses.dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = ""
    id: str = ""


class SSEParser:
    __slots__ = ("_buf", "_skip_lf", "_data", "_event", "_id", "_has_data", "comments", "closed")

    def __init__(self) -> None:
        self._buf = b""  # the bytes of an unterminated line
        self._skip_lf = False  # the last chunk ended with CR: a leading LF belongs to it
        self._data: list[str] = []
        self._event = ""
        self._id = ""
        self._has_data = False
        self.comments = 0
        self.closed = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self.feed_data(chunk, True)

    def feed_data(self, chunk: bytes, full: bool = False) -> list:
        """``feed`` for a caller that needs only each event's ``data`` (the streaming client):
        the same parse, without building an SSEEvent per event (``full``: with them)."""
        if self.closed:
            raise ValueError("SSEParser.feed() called after finish()")
        if not chunk:
            return []
        if (
            not self._buf
            and not self._has_data
            and not self._skip_lf
            and chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
        ):
            # Nearly every read of a stream: one whole event, "data: ..." and its blank line,
            # nothing before it. The same event as the loop below gives, in one step.
            data = chunk[6:-2].decode("utf-8", "replace")
            event = self._event
            self._event = ""
            return [SSEEvent(data, event, self._id) if full else data]
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            # Normalise CRLF and lone CR to LF. A CR at the very end may be the first half of
            # a CRLF split across chunks: treat it as a terminator now, swallow the LF later.
            self._skip_lf = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        events: list = []
        for line in lines:
            # The two lines of nearly every event inline (a token chunk is "data: {...}" and a
            # blank line); the rest of the field rules in _line.
            if not line:
                if self._has_data:
                    data = "\n".join(self._data)
                    events.append(SSEEvent(data, self._event, self._id) if full else data)
                self._data = []
                self._has_data = False
                self._event = ""
            elif line.startswith(b"data: "):
                self._data.append(line[6:].decode("utf-8", "replace"))
                self._has_data = True
            else:
                self._line(line, events)
        return events

    def finish(self) -> list[SSEEvent]:
        """EOF: flush a last line without terminator and an event without its blank line."""
        if self.closed:
            return []
        self.closed = True
        events: list[SSEEvent] = []
        if self._buf:
            self._line(self._buf, events)
            self._buf = b""
        self._line(b"", events)
        return events

    def _line(self, raw: bytes, events: list[SSEEvent]) -> None:
        if not raw:
            if self._has_data:
                events.append(SSEEvent("\n".join(self._data), self._event, self._id))
            # The spec resets the data buffer and event type on every blank line; id persists.
            self._data = []
            self._has_data = False
            self._event = ""
            return
        if raw[0] == 0x3A:  # ":" comment, e.g. ": ping" keep-alive
            self.comments += 1
            return
        line = raw.decode("utf-8", "replace")
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
            self._has_data = True
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\x00" not in value:
                self._id = value
        # "retry" and unknown fields are ignored, as the spec says.
