"""Responses' `input` is checked by the chat completions' message rules: its errors name `input`."""

from __future__ import annotations

import pytest

from app.http.api_errors import ApiError
from app.http.responses_items import ResponseRequest, parse_input
from sessions import InvalidInput


def _request(items: object) -> ResponseRequest:
    return ResponseRequest.model_validate({"model": "m", "input": items})


def test_over_2048_input_items_is_refused_naming_input_not_messages() -> None:
    with pytest.raises(ApiError) as refused:
        parse_input(_request([{"role": "user", "content": "a"}] * 2049))
    assert refused.value.param == "input"
    assert "Invalid 'input': array too long" in str(refused.value)
    assert "messages" not in str(refused.value)


@pytest.mark.parametrize(
    "items",
    [
        [{"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [{"role": "user", "content": "   "}],
    ],
)
def test_an_input_of_the_wrong_shape_is_refused_naming_input_not_messages(items: object) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_input(_request(items))
    assert str(refused.value).startswith("input"), refused.value
