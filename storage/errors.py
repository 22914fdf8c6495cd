"""The root of the storage layer's errors: every exception class declared in `storage/` derives from
`StorageError`, and callers (`sessions/`) catch them by name and translate them into domain errors
(`sessions.errors`). Each class lives beside the code that raises it (`BlobNotFound` in
blob_stores.py, `KeyRingError` in keyring.py, ...); those raised by more than one module live here.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of storage failures that callers translate into domain errors."""


class AlreadyExists(StorageError):
    """A unique name is taken."""


class SessionGone(StorageError):
    """The session does not exist (for this tenant): never created, or deleted meanwhile (while a
    turn ran). Raised by the metadata store and the replica store, with the session id."""
