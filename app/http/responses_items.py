"""The objects of the Responses API (`app.http.responses_api`): the request chatkv takes, its input
items as chatkv's turn (system prompt, earlier turns, new user message), and the `response`
objects and items it answers with, shaped as the official client's `openai.types.responses` parse.

    input "Hi"                                       -> one user message
    input [{role: system|developer, content}, ...]   -> the system prompt (after `instructions`)
          then {role: user}, {role: assistant}, ... {role: user}
                                                     -> earlier turns, then the new user message
    content: a string, or `input_text` parts (`output_text` for assistant items), joined

Not supported, refused with 400 `unsupported_parameter` naming the parameter: tools and tool
choices other than `none`/`auto`, `reasoning`, `background`, `n`, `include`, `prompt`, a `text`
format other than text, `top_logprobs`, items other than messages (function calls, reasoning,
item references) and content parts other than text (images, files, audio).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.http.api_errors import ApiError, unsupported
from app.http.api_turns import Posted, check_message, check_openai_ranges
from app.http.chat_request import DEFAULT_MAX_TOKENS, ChatMessage
from app.http.openai_api import parse_messages
from sessions import MAX_MESSAGE_CHARS, InvalidInput, Reply, TurnOptions, check_text

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
"""OpenAI's limits of `metadata`: 16 pairs, keys up to 64 characters, values up to 512."""

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = {"input_text", "output_text", "text"}


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str = Field(description="`input_text` (`output_text` in assistant items); others are refused.")
    text: str | None = None


class InputItem(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str | None = Field(default=None, description="`message` (the default); other item types are refused.")
    role: str | None = Field(default=None, description="`user`, `assistant`, `system` or `developer`.")
    content: str | list[InputPart] | None = None


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str


class ResponseRequest(BaseModel):
    """OpenAI's `POST /v1/responses` request (the subset chatkv serves)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(description="The served model's id (`GET /v1/models`).")
    input: str | list[InputItem] = Field(
        description="The new user message, or message items: an optional system prompt, then alternating "
        "user and assistant messages ending with a user message. With `previous_response_id`: only the new "
        "user message."
    )
    instructions: str | None = Field(
        default=None,
        description="The system prompt. With `previous_response_id`: omitted or the same keeps the session; "
        "another starts a new session holding the earlier turns under it.",
    )
    previous_response_id: str | None = Field(
        default=None,
        description="Continue after this response: its session's latest response continues the session, "
        "an earlier one forks it (a branch, warm from its KV).",
    )
    store: bool | None = Field(default=None, description="Keep the response (default true); false keeps nothing.")
    stream: bool = Field(default=False, description="Answer with the Responses event stream.")
    max_output_tokens: int | None = Field(default=None, description=f"Most tokens to generate ({DEFAULT_MAX_TOKENS}).")
    temperature: float | None = Field(default=None, description="Sampling temperature, >= 0 (default 1; 0 is greedy).")
    top_p: float | None = Field(default=None, description="Nucleus sampling mass in (0, 1] (default 1).")
    metadata: dict[str, str] | None = Field(default=None, description="Up to 16 string pairs, returned as given.")
    seed: int | None = Field(default=None, description="chatkv's extension: makes sampling reproducible.")
    conversation: str | ConversationRef | None = Field(
        default=None,
        description="A conversation id (or `{id}`): the turn runs after its items, and its input and output "
        "are appended to them. Not with `previous_response_id`, nor with `store: false`.",
    )

    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation


KNOWN_EXTRA_FIELDS = frozenset(
    {
        # refused unless neutral (`refuse_unsupported`)
        *("tools", "tool_choice", "reasoning", "include", "prompt", "context_management", "image", "background"),
        *("n", "top_logprobs", "text", "moderation", "access_programs", "background_options", "max_tool_calls"),
        "truncation",
        # labels and hints that change nothing chatkv computes
        *("user", "safety_identifier", "service_tier", "parallel_tool_calls", "stream_options"),
        *("prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"),
    }
)
"""Fields of OpenAI's Responses request (as the official client sends them) beyond those
`ResponseRequest` declares; any other field is refused with 400 `unrecognized_request_argument`."""


def refuse_unsupported(body: ResponseRequest) -> None:
    """Raise `ApiError` (400 `unsupported_parameter`) for the first parameter chatkv does not serve,
    or (400 `unrecognized_request_argument`) naming fields OpenAI's Responses request does not have."""
    extra = body.model_extra or {}
    if extra.get("tools"):
        raise unsupported("tools are", "tools")
    if extra.get("tool_choice") not in (None, "none", "auto"):
        raise unsupported("tools are", "tool_choice")
    for name in ("reasoning", "include", "prompt", "context_management", "image"):
        if extra.get(name):
            raise unsupported(f"`{name}` is", name)
    if extra.get("background"):
        raise unsupported("background responses are", "background")
    if extra.get("n") not in (None, 1):
        raise unsupported("`n` other than 1 is", "n")
    if extra.get("top_logprobs"):
        raise unsupported("logprobs are", "top_logprobs")
    text = extra.get("text")
    if text is not None and (not isinstance(text, dict) or text.get("format", {"type": "text"}) != {"type": "text"}):
        raise unsupported("a `text` format other than text is", "text")
    for name in ("moderation", "access_programs", "background_options", "max_tool_calls"):
        if extra.get(name):
            raise unsupported(f"`{name}` is", name)
    if extra.get("truncation") not in (None, "disabled"):
        raise unsupported("`truncation` other than disabled is", "truncation")
    unknown = [name for name in extra if name not in KNOWN_EXTRA_FIELDS]
    if unknown:
        noun = "argument" if len(unknown) == 1 else "arguments"
        raise ApiError(
            400,
            f"Unrecognized request {noun} supplied: {', '.join(unknown)}",
            "unrecognized_request_argument",
            param=unknown[0],
        )


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """`metadata` within OpenAI's limits. Raises `InvalidInput`."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidInput(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidInput(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                f"{MAX_METADATA_VALUE_CHARS}; {key[:80]!r} is over"
            )
        check_text(key, "a metadata key", MAX_METADATA_KEY_CHARS)  # storable: no lone surrogate, no NUL
        check_text(value, f"metadata[{key!r}]", MAX_METADATA_VALUE_CHARS)
    return metadata


def turn_options(body: ResponseRequest) -> TurnOptions:
    """The turn's parameters, with OpenAI's defaults. Raises `ApiError` or `InvalidInput` for bad values."""
    check_openai_ranges(
        temperature=body.temperature, max_tokens=body.max_output_tokens, max_tokens_name="max_output_tokens"
    )
    return TurnOptions(
        max_new_tokens=DEFAULT_MAX_TOKENS if body.max_output_tokens is None else body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
    )


def parse_input(body: ResponseRequest, earlier: Sequence[InputItem] = ()) -> Posted:
    """The request's input, after the `earlier` items of its conversation, as a turn: system
    prompt (`instructions`, then leading system items), earlier turns, the new user message.

    Raises:
        ApiError: 400 `unsupported_parameter` for items or content parts that are not text messages.
        InvalidInput: for any other shape chatkv cannot take.
    """
    if body.instructions is not None:
        check_text(body.instructions, "instructions", MAX_MESSAGE_CHARS)
    if isinstance(body.input, str) and not earlier:
        return Posted(body.instructions, [], check_message(body.input, "input"))
    items = input_as_items(body)
    if not items:
        raise InvalidInput("input must hold at least one message")
    system, rest = [], list(enumerate([*earlier, *items], start=-len(earlier)))
    while rest and rest[0][1].role in ("system", "developer"):
        system.append(item_text(*rest.pop(0)))
    prompt = "\n\n".join(filter(None, [body.instructions, *system])) if body.instructions or system else None
    messages = [ChatMessage(role="system", content=prompt)] if prompt is not None else []
    for index, item in rest:
        text = item_text(index, item)  # first: it refuses item types other than messages by name
        messages.append(ChatMessage(role=_role(index, item), content=text))
    return parse_messages(messages, "input")


def input_as_items(body: ResponseRequest) -> list[InputItem]:
    """The input as items (a string is one user message)."""
    return [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else list(body.input)


def stored_items(items: Sequence[InputItem], where: str = "input") -> list[dict[str, Any]]:
    """Message items as a conversation keeps them (`Message` objects: input_text parts, or an
    `output_text` part for an assistant message), each with a new id.

    Raises:
        ApiError, InvalidInput: as `parse_input`, for items that are not text messages.
    """
    stored = []
    for index, item in enumerate(items):
        text = item_text(index, item, where)
        role = _role(index, item, where)
        stored.append(output_message(item_id(), text) if role == "assistant" else _input_message(role, text))
    return stored


def as_input_items(stored: Sequence[dict[str, Any]]) -> list[InputItem]:
    return [InputItem.model_validate(item) for item in stored]


def _role(index: int, item: InputItem, where: str = "input") -> str:
    if item.role not in _ROLES:
        raise InvalidInput(f"{where}[{index}].role must be user, assistant, system or developer, got {item.role!r}")
    return item.role


def item_text(index: int, item: InputItem, where: str = "input") -> str:
    """The text of a message item (its text parts joined).

    Raises:
        ApiError: 400 `unsupported_parameter` for another item type or a non-text part.
        InvalidInput: for a missing role, content or text.
    """
    where = f"{where}[{index}]"
    if item.type not in (None, "message"):
        raise unsupported(f"items of type {item.type!r} are (messages only)", where)
    if item.content is None:
        raise InvalidInput(f"{where}.content is required")
    if isinstance(item.content, str):
        check_text(item.content, f"{where}.content", MAX_MESSAGE_CHARS)
        return item.content
    texts = []
    for number, part in enumerate(item.content):
        if part.type not in _TEXT_PARTS:
            raise unsupported(f"content parts of type {part.type!r} are (text only)", f"{where}.content[{number}]")
        if part.text is None:
            raise InvalidInput(f"{where}.content[{number}].text is required")
        check_text(part.text, f"{where}.content[{number}].text", MAX_MESSAGE_CHARS)
        texts.append(part.text)
    return "".join(texts)


def item_id() -> str:
    return "msg_" + secrets.token_hex(12)


def input_items(conversation: Posted) -> list[dict[str, Any]]:
    """The input items as `input_items.list` returns them (`ResponseInputMessageItem` for user
    messages, `ResponseOutputMessage` for assistant ones); the system prompt is not an item."""
    items = []
    for user, assistant in conversation.history:
        items.append(_input_message("user", user))
        items.append(output_message(item_id(), assistant))
    items.append(_input_message("user", conversation.message))
    return items


def _input_message(role: str, text: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": text}]
    return {"id": item_id(), "type": "message", "role": role, "status": "completed", "content": content}


def output_message(message_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message item (`ResponseOutputMessage`) holding `text`."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def response_usage(reply: Reply) -> dict[str, Any]:
    """The Responses `usage` of a reply: input tokens are those prefilled plus those served from
    chatkv's cache (`cached_tokens`)."""
    stats = reply.stats
    prompt = stats.prefill_tokens + stats.reused_tokens
    output = len(reply.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": stats.reused_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def response_object(
    head: dict[str, Any], *, status: str, output: Sequence[dict[str, Any]] = (), reply: Reply | None = None
) -> dict[str, Any]:
    """A `response` object: `head` (from `response_head`) with its status, output and usage."""
    incomplete = reply is not None and reply.finish_reason == "length"
    return {
        **head,
        "status": "incomplete" if incomplete else status,
        "completed_at": time.time() if reply is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": list(output),
        "usage": response_usage(reply) if reply is not None else None,
    }


def response_head(response_id: str, model: str, body: ResponseRequest, metadata: dict[str, str]) -> dict[str, Any]:
    """The fields of a `response` object known before its reply."""
    conversation = body.conversation_id()
    return {
        "conversation": {"id": conversation} if conversation is not None else None,
        "id": response_id,
        "object": "response",
        "created_at": time.time(),
        "model": model,
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": metadata,
        "parallel_tool_calls": False,
        "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": {"type": "text"}},
        "tool_choice": "none",
        "tools": [],
        "truncation": "disabled",
        "background": False,
        "store": body.store is not False,
    }


def items_page(items: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """One page of items as OpenAI lists them (`SyncCursorPage`): `order` `asc` (oldest first) or
    `desc`, starting after the item `after`.

    Raises:
        ApiError: 400 for an `order` other than asc/desc or a `limit` outside 1-100.
        InvalidInput: for an `after` that is not one of the items.
    """
    ordered = items if not descending(limit, order) else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidInput(f"after: no item {after!r} in this list")
        start = ids.index(after) + 1
    return page_body(ordered[start : start + limit], start + limit < len(ordered))


def descending(limit: int, order: str) -> bool:
    """Whether a list is asked newest first (`order` `desc`).

    Raises:
        ApiError: 400 for an `order` other than asc/desc or a `limit` outside 1-100.
    """
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", "invalid_request", param="order")
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be between 1 and 100, got {limit}", "invalid_request", param="limit")
    return order == "desc"


def page_body(page: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of items as OpenAI's list object."""
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": has_more,
    }


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
