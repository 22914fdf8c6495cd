"""Errors of the storage layer that callers translate into domain errors (`sessions.errors`)."""

from __future__ import annotations


class StorageError(Exception):
    """Base class of storage failures that callers translate into domain errors."""


class AlreadyExists(StorageError):
    """A unique name is taken."""
