"""What one setting's value must be, whoever holds it (`Settings` or one of its sub-configs): one
table of rules, so a bad value gets the same message naming the setting wherever it is checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from sessions.settings.parsing import MAX_DURATION_S

Precision = Literal["exact", "int8", "int4"]
PersistMode = Literal["on_evict", "write_back"]
WindowPolicyName = Literal["turns", "attention", "agnostic"]
BudgetAllocation = Literal["uniform", "per_head"]
DtypeName = Literal["float32", "bfloat16", "float16"]
DtypeSetting = Literal["auto", "float32", "bfloat16", "float16"]
"""`auto`: bfloat16 on CUDA (float16 without bfloat16 support), float32 elsewhere
(`sessions.device_defaults.default_dtype`)."""
RoutingMode = Literal["forward", "handover"]

_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "persist": (lambda v: v in ("on_evict", "write_back"), "'on_evict' or 'write_back'"),
    "offload_precision": (lambda v: v in ("exact", "int8", "int4"), "'exact', 'int8' or 'int4'"),
    "dtype": (lambda v: v in ("auto", "float32", "bfloat16", "float16"), "auto, float32, bfloat16 or float16"),
    "device": (lambda v: isinstance(v, str) and _DEVICE.fullmatch(v) is not None, "auto, cpu, cuda, cuda:N or mps"),
    "quant_residual_tokens": (lambda v: v >= 0, ">= 0"),
    "window_policy": (lambda v: v in ("turns", "attention", "agnostic"), "'turns', 'attention' or 'agnostic'"),
    "window_budget_allocation": (lambda v: v in ("uniform", "per_head"), "'uniform' or 'per_head'"),
    "window_recent_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "window_observation_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "window_rebuild_chunk_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "context_budget_tokens": (lambda v: v >= 16, ">= 16"),
    "threads": (lambda v: v >= 1, ">= 1"),
    "max_concurrent_requests_per_tenant": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "session_retention_s": (lambda v: 0 < v <= MAX_DURATION_S, "in (0, 100 years]"),
    "implicit_retention_s": (lambda v: 0 < v <= MAX_DURATION_S, "in (0, 100 years]"),
    "redis_url": (
        lambda v: isinstance(v, str) and re.fullmatch(r"rediss?://\S+", v) is not None,
        "redis://... or rediss://...",
    ),
    "redis_ttl_s": (lambda v: 1 <= v <= MAX_DURATION_S, "in [1 s, 100 years]"),
    "redis_prefix": (lambda v: isinstance(v, str) and _NAME.fullmatch(v) is not None, "1-32 of A-Z a-z 0-9 _ . -"),
    "replica_id": (lambda v: isinstance(v, str) and _NAME.fullmatch(v) is not None, "1-32 of A-Z a-z 0-9 _ . -"),
    "replica_url": (lambda v: isinstance(v, str) and re.fullmatch(r"https?://\S+", v) is not None, "http(s)://..."),
    "ownership_lease_s": (lambda v: 0.5 <= v <= 3600, "in [0.5, 3600] seconds"),
    "ownership_wait_s": (lambda v: 0 <= v <= 3600, "in [0, 3600] seconds"),
    "ownership_idle_s": (lambda v: 0.1 <= v <= MAX_DURATION_S, "in [0.1 s, 100 years]"),
    "routing": (lambda v: v in ("forward", "handover"), "'forward' or 'handover'"),
    "forward_queue_limit": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
}
"""What one field's value must be on its own (combinations are checked by the object holding both)."""


def check_field(name: str, value: Any) -> None:
    """Raises `ValueError` naming the field when `value` cannot be field `name` (`None`: the derived default)."""
    if value is None:
        return
    if name.endswith("_bytes"):
        rule: tuple[Callable[[Any], bool], str] | None = (lambda v: v > 0, "> 0 bytes")
    else:
        rule = _RULES.get(name)
    if rule is not None and not rule[0](value):
        raise ValueError(f"{name} must be {rule[1]}, got {value!r}")


def check_set(name: str, value: Any) -> None:
    """Raises `ValueError` naming the field when `value` is `None` (a sub-config holds resolved values)."""
    if value is None:
        raise ValueError(f"{name} must be set, got None")
