"""Every exception class that `storage/` declares sits under `StorageError`, and none is a
`KeyError` or `LookupError`: a caller catches storage failures by name or by the root, and a
`KeyError` from a bug is never mistaken for one."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import storage
from storage.errors import StorageError


def storage_exception_classes() -> dict[str, type[BaseException]]:
    """`module.Class` -> class, for every exception class declared in a `storage` module (the
    migrations package is left out: importing its `env` runs Alembic)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.iter_modules(storage.__path__, "storage."):
        if info.name == "storage.migrations":
            continue
        module = importlib.import_module(info.name)
        for name, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_storage_error_derives_from_storage_error() -> None:
    classes = storage_exception_classes()
    assert {"storage.blob_stores.BlobNotFound", "storage.home_lock.HomeLockedError"} <= classes.keys()
    assert [name for name, cls in classes.items() if not issubclass(cls, StorageError)] == []


def test_no_storage_error_is_a_lookup_error() -> None:
    assert [name for name, cls in storage_exception_classes().items() if issubclass(cls, LookupError)] == []
