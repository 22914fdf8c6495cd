"""Models named by a Hugging Face hub id (`owner/name`), loaded through transformers' own download
and cache (`from_pretrained`, `HF_HOME`), with a clear error when the hub cannot be reached.

A model already in the local Hugging Face cache loads without the network. Otherwise, before
transformers' own attempt (which retries for about 30 s when the network is down), a TCP connect to
the hub's endpoint with a short timeout tells at once that it cannot be reached; `HF_HUB_OFFLINE=1`
says so without trying.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from huggingface_hub import constants as hub_constants

from sessions.errors import ModelNotFound

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
"""`owner/name`, as the hub spells repository ids."""

PROBE_TIMEOUT_S = 5.0
"""How long the reachability check waits for a TCP connection to the hub."""

_LOCAL_HINT = "point --model (CHATKV_MODEL) at a local model folder or a .gguf file instead"
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")

_Loaded = TypeVar("_Loaded")


def is_hub_id(model: str) -> bool:
    return HUB_ID.fullmatch(model) is not None


def hub_unreachable_reason(endpoint: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub's endpoint (`HF_ENDPOINT`, default https://huggingface.co) cannot be reached,
    or `None` when a TCP connection to it opens (or a proxy is configured: the proxy decides)."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    url = urlsplit(endpoint or hub_constants.ENDPOINT)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"


def load_from_hub(hub_id: str, load: Callable[..., _Loaded]) -> _Loaded:
    """`load(hub_id, local_files_only=...)` from the local Hugging Face cache if it is complete
    there, else downloading through transformers.

    Raises:
        ModelNotFound: the hub cannot be reached (`HF_HUB_OFFLINE` set, no connection) and the model
            is not in the local cache, or the hub has no such model (one line, saying what to do).
    """
    try:
        return load(hub_id, local_files_only=True)
    except OSError:
        pass  # not (completely) in the local cache: download it
    if hub_constants.HF_HUB_OFFLINE:
        raise ModelNotFound(
            f"cannot download {hub_id}: the Hugging Face hub is not reachable (HF_HUB_OFFLINE is set) and the "
            f"model is not in the local Hugging Face cache; {_LOCAL_HINT}"
        )
    reason = hub_unreachable_reason()
    if reason is not None:
        raise ModelNotFound(
            f"cannot download {hub_id}: the Hugging Face hub could not be reached ({reason}) and the model is "
            f"not in the local Hugging Face cache; {_LOCAL_HINT}"
        )
    log.info("downloading %s from the Hugging Face hub into %s", hub_id, hub_constants.HF_HUB_CACHE)
    try:
        return load(hub_id, local_files_only=False)
    except OSError as exc:  # no such repository, a gated one, or the connection broke
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFound(f"cannot load {hub_id} from the Hugging Face hub: {first_line}; {_LOCAL_HINT}") from exc


def snapshot_dir(hub_id: str) -> Any:
    """The local snapshot folder a loaded hub model's files are in (for display), else the id."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(hub_id, "config.json")
    return os.path.dirname(found) if isinstance(found, str) else hub_id
