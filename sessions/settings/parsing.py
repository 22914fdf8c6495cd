"""Text to setting values: how a `CHATKV_<FIELD>` variable is read. Byte sizes accept plain
integers or units (`512MiB`, `2GB`); durations seconds or `30m`, `12h`, `7d`; booleans `1/0`,
`true/false`, `yes/no`, `on/off`; integers ASCII digits only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

MAX_DURATION_S = 100 * 365 * 86400.0
"""Durations beyond a century are refused: they overflow timestamp arithmetic and mean 'never'."""

_INTEGER_FIELDS = frozenset(
    {
        "context_budget_tokens",
        "quant_residual_tokens",
        "window_recent_tokens",
        "window_observation_tokens",
        "window_rebuild_chunk_tokens",
        "threads",
        "max_step_tokens",
        "max_prefill_tokens",
        "max_running_requests",
        "max_running_per_tenant",
        "max_batch_requests",
        "max_concurrent_requests_per_tenant",
        "forward_queue_limit",
    }
)
_BOOLEAN_FIELDS = frozenset(
    {
        "pin_first_turn",
        "share_base",
        "metrics_tenant_labels",
        "reuse_kv",
        "redis_cluster",
        "fork_sessions",
        "restore_or_recompute",
    }
)
_PATH_FIELDS = frozenset({"home", "model_cache_dir"})


def parse_bytes(text: str) -> int:
    """Parse `"1500"`, `"512MiB"`, `"2 GB"` into bytes. Raises `ValueError` naming the bad value."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 1048576, 512MiB, 2GB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration_s(text: str) -> float:
    """Parse `"90"`, `"30m"`, `"12h"`, `"7d"` into seconds (at most 100 years). Raises `ValueError`
    naming the bad value."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdSMHD]?)\s*", text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (examples: 90, 30m, 12h, 7d)")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
    if seconds > MAX_DURATION_S:
        raise ValueError(f"duration too long: {text!r} (at most 100 years)")
    return seconds


def env_variable(name: str) -> str:
    """The environment variable of a `Settings` field: `device_budget_bytes` -> `CHATKV_DEVICE_BUDGET_BYTES`."""
    return f"CHATKV_{name.upper()}"


def parse_field(name: str, raw: str) -> Any:
    """The value of `Settings` field `name` written as `raw` (by its name: `_bytes` a byte size,
    `_s` a duration, else integer, boolean, path or text). Raises `ValueError` naming the bad text."""
    if name.endswith("_bytes"):
        return parse_bytes(raw)
    if name.endswith("_s"):
        return parse_duration_s(raw)
    if name in _INTEGER_FIELDS:
        if not re.fullmatch(r"\s*-?[0-9]+\s*", raw):
            raise ValueError(f"not an integer: {raw!r}")
        return int(raw)
    if name in _BOOLEAN_FIELDS:
        lowered = raw.strip().lower()
        if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"not a boolean: {raw!r}")
        return lowered in ("1", "true", "yes", "on")
    if name in _PATH_FIELDS:
        return Path(raw)
    return raw
