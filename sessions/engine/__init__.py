"""The engine: the front (`Engine`) over the model runner (`ModelRunner`: the loaded model, one
forward pass) and the loop that batches every running request into each forward pass (`loop`,
`scheduler`, `batch`, `request`). See docs/architecture.md, "Engine loop".

Names are imported on first use, so `sessions.engine.config` stays importable without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sessions.engine.config import SchedulerConfig
    from sessions.engine.engine import Engine
    from sessions.engine.model_runner import KVLayout, ModelRunner
    from sessions.engine.request import Request, RequestCancelled, RequestResult, RequestState

_HOMES = {
    "Engine": "engine",
    "KVLayout": "model_runner",
    "ModelRunner": "model_runner",
    "Request": "request",
    "RequestCancelled": "request",
    "RequestResult": "request",
    "RequestState": "request",
    "SchedulerConfig": "config",
}

__all__ = [
    "Engine",
    "KVLayout",
    "ModelRunner",
    "Request",
    "RequestCancelled",
    "RequestResult",
    "RequestState",
    "SchedulerConfig",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'sessions.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sessions.engine.{_HOMES[name]}"), name)
