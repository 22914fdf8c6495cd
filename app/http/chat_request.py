"""The body of `POST /v1/chat/completions`: every field chatkv knows, and what it does with each.

Every field the official `openai` client can send is declared, and so are chatkv's and vLLM's
extensions; any other field is refused with 400 `unrecognized_request_argument` naming it
(OpenAI's "Unrecognized request argument supplied: foo"), never silently ignored
(`app.http.api_errors.unrecognized_fields`). Each declared field is one of:

- **honoured**: `model`, `messages`, `max_tokens`, `max_completion_tokens`, `temperature`,
  `top_p`, `seed`, `stop`, `stream`, `stream_options.include_usage`, `n` (1), and the extensions
  `session_id`, `min_tokens` and `ignore_eos` (`TurnOptions`);
- **accepted, no effect on the reply**: labels and hints that change nothing chatkv computes
  (`user`, `safety_identifier`, `metadata`, `store` true, `prompt_cache_*`, `service_tier`,
  `parallel_tool_calls`, `prediction`, `modalities` `["text"]`, `stream_options.include_obfuscation`);
- **refused unless neutral** (400 `unsupported_parameter` naming it): a value that would change
  the reply in a way chatkv does not implement (tools, logprobs, penalties, `top_k`, ...); the
  neutral value (absent, null, or the field's no-op value) is accepted.

docs/openai.md has the same as a table; keep the two together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.http.api_errors import unsupported
from app.http.api_turns import SESSION_HEADER, check_openai_ranges
from sessions import TurnOptions

DEFAULT_MAX_TOKENS = 256
NO_EFFECT = "Accepted; no effect on the reply."


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str = Field(description="`text`; other kinds (images, audio, files) are refused.")
    text: str | None = Field(default=None, description="The text of a `text` part.")


class ChatMessage(BaseModel):
    # Lenient: clients post back the assistant messages they got, with OpenAI's extra fields
    # (`refusal`, `annotations`, `audio`: null).
    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(description="`system` (or `developer`), `user` or `assistant`.")
    content: str | list[ContentPart] | None = Field(
        default=None, description="The text, or a list of `text` parts (joined)."
    )
    name: str | None = Field(default=None, description="Accepted and ignored.")
    tool_calls: list[Any] | None = Field(default=None, description="Refused: tools are not supported.")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(default=False, description="Send a last chunk with `usage` before `[DONE]`.")
    include_obfuscation: bool | None = Field(default=None, description=f"{NO_EFFECT} (No obfuscation field is sent.)")


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request: the fields chatkv honours, those it accepts without
    effect, those it refuses unless neutral (`refuse_unsupported`); any other is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # -- honoured --------------------------------------------------------------------------------
    model: str = Field(description="The served model's id (`GET /v1/models`).")
    messages: list[ChatMessage] = Field(
        min_length=1,
        description="An optional system message, then alternating user and assistant messages ending with a "
        "user message. With a session id: only the new user message (and optionally the session's system "
        "message).",
    )
    max_tokens: int | None = Field(default=None, description=f"Most tokens to generate (default {DEFAULT_MAX_TOKENS}).")
    max_completion_tokens: int | None = Field(default=None, description="Same as `max_tokens`; takes precedence.")
    temperature: float | None = Field(default=None, description="Sampling temperature, >= 0 (default 1; 0 is greedy).")
    top_p: float | None = Field(default=None, description="Nucleus sampling mass in (0, 1] (default 1).")
    seed: int | None = Field(default=None, description="Makes sampling at temperature > 0 reproducible.")
    stop: str | list[str] | None = Field(
        default=None, description="Up to 4 strings; the reply ends before the first one it produces."
    )
    stream: bool = Field(default=False, description="Answer with server-sent `chat.completion.chunk` events.")
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, description="Must be 1 when given.")
    # -- extensions (chatkv's, vLLM's) -------------------------------------------------------------
    session_id: str | None = Field(
        default=None, description=f"chatkv: continue this session (same as the `{SESSION_HEADER}` header)."
    )
    min_tokens: int | None = Field(
        default=None,
        description="vLLM: no end-of-turn token or stop string ends the reply before it has this many tokens "
        "(at most the token limit).",
    )
    ignore_eos: bool | None = Field(
        default=None,
        description="vLLM: the end-of-turn token is never sampled, so the reply runs to the token limit "
        "(stop strings still end it).",
    )
    # -- accepted, no effect on the reply ------------------------------------------------------------
    user: str | None = Field(default=None, description=NO_EFFECT)
    safety_identifier: str | None = Field(default=None, description=NO_EFFECT)
    metadata: dict[str, str] | None = Field(default=None, description=NO_EFFECT)
    store: bool | None = Field(
        default=None, description="`true` or null (chatkv stores every turn in its session); `false` is refused."
    )
    prompt_cache_key: str | None = Field(default=None, description=f"{NO_EFFECT} (chatkv caches every session.)")
    prompt_cache_retention: str | None = Field(default=None, description=NO_EFFECT)
    prompt_cache_options: dict[str, Any] | None = Field(default=None, description=NO_EFFECT)
    service_tier: str | None = Field(default=None, description=NO_EFFECT)
    parallel_tool_calls: bool | None = Field(default=None, description=f"{NO_EFFECT} (No tools.)")
    prediction: dict[str, Any] | None = Field(default=None, description=NO_EFFECT)
    modalities: list[str] | None = Field(default=None, description='`["text"]` or null; audio is refused.')
    # -- refused unless neutral -------------------------------------------------------------------
    tools: list[Any] | None = Field(default=None, description="Refused: tools are not supported.")
    tool_choice: Any = Field(default=None, description="Refused unless `none`.")
    functions: list[Any] | None = Field(default=None, description="Refused: functions are not supported.")
    function_call: Any = Field(default=None, description="Refused unless `none`.")
    logprobs: bool | None = Field(default=None, description="Refused when true.")
    top_logprobs: int | None = Field(default=None, description="Refused unless null or 0.")
    logit_bias: dict[str, float] | None = Field(default=None, description="Refused unless empty.")
    presence_penalty: float | None = Field(default=None, description="Refused unless 0.")
    frequency_penalty: float | None = Field(default=None, description="Refused unless 0.")
    response_format: dict[str, Any] | None = Field(default=None, description='Refused unless `{"type": "text"}`.')
    audio: dict[str, Any] | None = Field(default=None, description="Refused.")
    reasoning_effort: str | None = Field(default=None, description="Refused (the model does not reason).")
    verbosity: str | None = Field(default=None, description="Refused.")
    web_search_options: dict[str, Any] | None = Field(default=None, description="Refused.")
    moderation: dict[str, Any] | None = Field(default=None, description="Refused.")
    top_k: int | None = Field(default=None, description="vLLM: refused unless -1 or 0 (off).")
    min_p: float | None = Field(default=None, description="vLLM: refused unless 0.")
    repetition_penalty: float | None = Field(default=None, description="vLLM: refused unless 1.")
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM: refused unless empty.")
    include_stop_str_in_output: bool | None = Field(default=None, description="vLLM: refused when true.")


def _off(value: Any) -> bool:
    return not value


def _none_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in neutral


_TOOLS = "tools and functions are"
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_none_or(1), "`n` other than 1 is"),
    "tools": (_off, _TOOLS),
    "functions": (_off, _TOOLS),
    "tool_choice": (_none_or("none"), _TOOLS),
    "function_call": (_none_or("none"), _TOOLS),
    "logprobs": (_off, "logprobs are"),
    "top_logprobs": (_off, "logprobs are"),
    "logit_bias": (_off, "`logit_bias` is"),
    "presence_penalty": (_off, "`presence_penalty` is"),
    "frequency_penalty": (_off, "`frequency_penalty` is"),
    "response_format": (_none_or({"type": "text"}), "a `response_format` other than text is"),
    "audio": (_none_or(), "audio output is"),
    "modalities": (_none_or(["text"]), "a modality other than text is"),
    "store": (_none_or(True), "`store: false` (chatkv keeps every turn in its session) is"),
    "reasoning_effort": (_none_or(), "`reasoning_effort` (the model does not reason) is"),
    "verbosity": (_none_or(), "`verbosity` is"),
    "web_search_options": (_none_or(), "web search is"),
    "moderation": (_none_or(), "moderation is"),
    "top_k": (_none_or(-1, 0), "`top_k` is"),
    "min_p": (_off, "`min_p` is"),
    "repetition_penalty": (_none_or(1), "`repetition_penalty` is"),
    "stop_token_ids": (_off, "`stop_token_ids` is"),
    "include_stop_str_in_output": (_off, "`include_stop_str_in_output` is"),
}


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """Raises `ApiError` 400 `unsupported_parameter` naming the first field whose value chatkv
    would have to ignore (tools, logprobs, penalties, ...); neutral values pass."""
    for name, (neutral, what) in _REFUSED.items():
        if not neutral(getattr(body, name)):
            raise unsupported(what, name)


def turn_options(body: ChatCompletionRequest) -> TurnOptions:
    """The turn's parameters, with OpenAI's defaults. Raises `InvalidInput` for bad values."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    check_openai_ranges(
        temperature=body.temperature,
        max_tokens=max_tokens,
        max_tokens_name="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        min_tokens=body.min_tokens,
        stop_strings=len(stop),
    )
    return TurnOptions(
        max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=stop,
        min_new_tokens=body.min_tokens or 0,
        ignore_eos=bool(body.ignore_eos),
    )
