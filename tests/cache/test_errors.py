"""Every exception class that `cache/` declares sits under `CacheError`, and none is a `KeyError`
or `LookupError`: a caller catches cache failures by name or by the root, and a `KeyError` from a
bug is never mistaken for one."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import cache
from cache.errors import CacheError


def cache_exception_classes() -> dict[str, type[BaseException]]:
    """`module.Class` -> class, for every exception class declared in a `cache` module."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.iter_modules(cache.__path__, "cache."):
        module = importlib.import_module(info.name)
        for name, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_cache_error_derives_from_cache_error() -> None:
    classes = cache_exception_classes()
    named = {
        "cache.tier_manager.LeaseHeld",
        "cache.tiers.BlobRejected",
        "cache.tiers.BlobMissing",
        "cache.tiers.StoreUnavailable",
        "cache.tiers.SealFailed",
        "cache.window_policy.ContextOverflow",
        "cache.serialization.MalformedCache",
    }
    assert named <= classes.keys()
    assert [name for name, cls in classes.items() if not issubclass(cls, CacheError)] == []


def test_no_cache_error_is_a_lookup_error() -> None:
    assert [name for name, cls in cache_exception_classes().items() if issubclass(cls, LookupError)] == []
