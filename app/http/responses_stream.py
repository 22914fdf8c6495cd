"""The Responses event stream (`POST /v1/responses` with `stream: true`): server-sent events, each
`event: <type>` and `data: <json>` with a `sequence_number` counting from 0, in this order:

    response.created            the response, status in_progress, no output yet
    response.in_progress
    response.output_item.added  the assistant message item (in_progress, empty)
    response.content_part.added its output_text part (empty)
    response.output_text.delta  one per reply piece (the deltas joined are the reply)
    response.output_text.done   the whole text
    response.content_part.done
    response.output_item.done   the completed message item
    response.completed          the response as stored (`response.incomplete` when the reply
                                reached `max_output_tokens`)

An error after the stream started (the turn cancelled by `POST /v1/responses/{id}/cancel`, the
session deleted meanwhile) ends it with an `error` event (`code`, `message`); nothing is stored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from app.http.responses_items import output_message


class EventFrames:
    """Numbers and formats the events of one streamed response."""

    def __init__(self) -> None:
        self._sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def response_events(
    frames: EventFrames,
    started: dict[str, Any],
    message_id: str,
    pieces: Iterable[str],
    finish: Callable[[], dict[str, Any]],
) -> Generator[str, None, None]:
    """The events of a response: `started` is the response object while it runs, `pieces` the
    reply's text pieces, `finish()` (called once they are all out) the final response object."""
    yield frames("response.created", response=started)
    yield frames("response.in_progress", response=started)
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    yield frames("response.output_item.added", output_index=0, item=output_message(message_id, "", "in_progress"))
    yield frames("response.content_part.added", **where, part=_text_part(""))
    texts = []
    for piece in _non_empty(pieces):
        texts.append(piece)
        yield frames("response.output_text.delta", **where, delta=piece, logprobs=[])
    text = "".join(texts)
    final = finish()
    yield frames("response.output_text.done", **where, text=text, logprobs=[])
    yield frames("response.content_part.done", **where, part=_text_part(text))
    yield frames("response.output_item.done", output_index=0, item=output_message(message_id, text))
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield frames(kind, response=final)


def error_event(frames: EventFrames, code: str, message: str) -> str:
    return frames("error", code=code, message=message, param=None)


def replayed_events(final: dict[str, Any]) -> Generator[str, None, None]:
    """A recorded response as a stream: its whole text in one delta."""
    item = final["output"][0]
    started = {**final, "status": "in_progress", "output": [], "usage": None, "completed_at": None}
    text = item["content"][0]["text"] if item["content"] else ""
    yield from response_events(EventFrames(), started, item["id"], [text], lambda: final)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _non_empty(pieces: Iterable[str]) -> Iterator[str]:
    return (piece for piece in pieces if piece)
