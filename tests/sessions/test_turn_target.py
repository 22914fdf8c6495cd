"""The door's values without a model: a target names one place at most, and a plan says what its
first step does."""

from __future__ import annotations

import pytest

from sessions.errors import InvalidInput
from sessions.replicas.routing import Route
from sessions.turn_target import Continue, Fork, New, TurnPlan, TurnTarget


@pytest.mark.parametrize(
    "names",
    [
        {"session": "s_1", "previous_response": "resp_1"},
        {"session": "s_1", "conversation": "conv_1"},
        {"previous_response": "resp_1", "conversation": "conv_1"},
        {"session": "s_1", "new_session": True},
        {"conversation": "conv_1", "new_session": True},
    ],
)
def test_a_target_naming_two_places_is_invalid_input(names: dict[str, str]) -> None:
    with pytest.raises(InvalidInput, match="not several"):
        TurnTarget(**names)  # type: ignore[arg-type]


@pytest.mark.parametrize("names", [{}, {"previous_response": "resp_1"}, {"session": "s_1", "create": True}])
def test_a_fork_point_without_a_session_to_fork_is_invalid_input(names: dict[str, object]) -> None:
    with pytest.raises(InvalidInput, match="fork_turns forks the session"):
        TurnTarget(fork_turns=1, **names)  # type: ignore[arg-type]


@pytest.mark.parametrize("posted", [{"history": [("u1", "a1")]}, {"system_prompt": "Be brief."}])
def test_a_fork_point_with_a_posted_conversation_is_invalid_input(posted: dict[str, object]) -> None:
    """A fork holds the parent's first turns under its system prompt: a posted history or system
    prompt would be silently dropped (a plain `session` target checks them against the session's)."""
    with pytest.raises(InvalidInput, match="fork_turns"):
        TurnTarget(session="s_1", fork_turns=1, **posted)  # type: ignore[arg-type]


def test_a_plan_says_what_its_first_step_does() -> None:
    target = TurnTarget("S", [("u1", "a1")])
    assert target.history == (("u1", "a1"),)
    steps = (
        ((Continue("s_a", 1), Fork("s_b", 1, "implicit")), ("continue", "s_a", 1)),
        ((Fork("s_b", 1, "implicit"),), ("fork", "s_b", None)),
        ((New("S", (("u1", "a1"),), "implicit"),), ("new", None, None)),
    )
    for planned, expected in steps:
        plan = TurnPlan(target, planned, Route("local", expected[1]))
        assert (plan.action, plan.session_id, plan.expected_turns) == expected
