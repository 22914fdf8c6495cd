"""Typed identifiers shared by the cache and the session layer.

`NewType`s so that a tenant id cannot be passed where a session id is expected (mypy catches it);
at run time they are plain strings.
"""

from typing import NewType

TenantId = NewType("TenantId", str)
SessionId = NewType("SessionId", str)
PrefixKey = NewType("PrefixKey", str)
"""Hex digest naming a base layer in the prefix pool; salted with tenant id and model fingerprint."""
