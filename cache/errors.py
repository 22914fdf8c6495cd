"""The root of the cache layer's errors: every exception class declared in `cache/` derives from
`CacheError`. Each class lives beside the code that raises it or the protocol that names it
(`LeaseHeld` in tier_manager.py, `BlobRejected`, `BlobMissing`, `StoreUnavailable` and `SealFailed`
in tiers.py, `ContextOverflow` in window_policy.py, `MalformedCache` in serialization.py);
`sessions/` catches them by name and translates them into domain errors.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class of the cache layer's errors."""
