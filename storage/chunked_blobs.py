"""Chunked sealing: a cache blob as a header and a run of independently sealed chunks, so a reader
can open each chunk as it arrives (the Redis tier stores one value per chunk and reads them
pipelined) and a chunk out of place is caught on its own.

    frame = header | chunk 0 | chunk 1 | ... | chunk n-1
    header (53 bytes) = "CKVC2" | blob id (16 random bytes) | n (u32) | chunk bytes (u32) | payload bytes (u64)
                        | header tag (16 bytes)
    header tag = AES-256-GCM(blob key, nonce = 12 bytes of 0xff, plaintext = "",
                             associated data = the blob's associated data | blob id | n | chunk bytes
                                               | payload bytes | "header")
    chunk i = AES-256-GCM(blob key, nonce = i as 12 bytes, plaintext = payload[i*chunk : (i+1)*chunk],
                          associated data = the blob's associated data | blob id | i | n | chunk bytes | payload bytes)
    blob key = HKDF-SHA256(tenant data key, salt = blob id, info = "chatkv-chunked-blob")

Every chunk's plaintext is `chunk bytes` long but the last (`payload bytes` minus the others, at
least 0: an empty payload is one empty chunk); a sealed chunk is 16 bytes (the tag) longer. Every
write draws a new blob id, hence a new blob key, so a chunk of another blob (another session,
another write of the same session) does not authenticate; the index, count and sizes in the
associated data reject a swapped, reordered, dropped or extra chunk; the blob's associated data
(tenant, name, model fingerprint, format version: `storage.keyring.blob_aad`) rejects a blob moved
to another name. Counter nonces are unique because each blob key seals one blob only (the header
tag's all-ones nonce is no chunk's: the count is a u32); so a tenant's data key no longer spends
one random nonce per chunk.

The header is authenticated on its own, before any chunk is read: a reader checks that its sizes
fit what a cache can hold (`max_payload_bytes`, a bound from the model) and that its tag
authenticates, and only then asks for chunks or allocates the payload. A forged header (a Redis
manifest claiming four billion one-byte chunks) costs one HKDF and one empty AES-GCM, never a
list of keys or a buffer. Frames of the version before header tags (`CKVC1`) do not open: the
cache is rebuilt from its transcript, as for any blob that does not authenticate.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from itertools import chain

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from storage.keyring import KEY_BYTES, NONCE_BYTES, AuthenticationFailed

CHUNKED_MAGIC = b"CKVC2"
_MAGIC_FAMILY = b"CKVC"
"""Every chunked frame's magic starts so (`CKVC1`: before header tags, no longer opened)."""
CHUNK_BYTES = 2 * 1024 * 1024
"""Plaintext bytes per chunk. Streamed from Redis, 1, 2 and 4 MiB chunks restored 2-4x faster than
one GET of the whole value, within noise of each other, 2 MiB best or close at every size
(benchmarks/README.md, `redis_restore.py`); it also bounds what Redis queues for a reader
(`storage.redis_store.READ_WINDOW` chunks)."""
MAX_CHUNK_BYTES = 64 * 1024 * 1024
TAG_BYTES = 16
BLOB_ID_BYTES = 16
_HEADER = struct.Struct(f"<{len(CHUNKED_MAGIC)}s{BLOB_ID_BYTES}sIIQ{TAG_BYTES}s")
HEADER_BYTES = _HEADER.size
_HEADER_NONCE = b"\xff" * NONCE_BYTES
MAPPED_PAYLOAD_BYTES = 2 * 1024 * 1024
"""A payload at least this long is decrypted into a memory mapping of its own (`payload_buffer`)."""
_KDF_INFO = b"chatkv-chunked-blob"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Linux only; elsewhere the pages are faulted in as they are first written."""


def is_chunked(blob: bytes | bytearray | memoryview) -> bool:
    """Whether `blob` starts like a chunked frame of any version (else it is a whole blob of
    `storage.keyring.seal`, written before chunking, or not a sealed blob at all)."""
    return bytes(blob[: len(_MAGIC_FAMILY)]) == _MAGIC_FAMILY


@dataclass(frozen=True)
class ChunkedHeader:
    """What a frame's header says: blob id, chunk count, plaintext bytes per chunk, payload bytes,
    and the tag that authenticates them (`signed`, `authenticate`).

    Raises:
        ValueError: sizes that no frame has (count 0, a chunk size out of 1..MAX_CHUNK_BYTES, a
            payload that does not fill `chunk_count` chunks, a blob id or tag of the wrong length).
    """

    blob_id: bytes
    chunk_count: int
    chunk_bytes: int
    payload_bytes: int
    tag: bytes = bytes(TAG_BYTES)

    def __post_init__(self) -> None:
        if len(self.blob_id) != BLOB_ID_BYTES:
            raise ValueError(f"a blob id is {BLOB_ID_BYTES} bytes, got {len(self.blob_id)}")
        if len(self.tag) != TAG_BYTES:
            raise ValueError(f"a header tag is {TAG_BYTES} bytes, got {len(self.tag)}")
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {self.chunk_bytes}")
        if self.chunk_count != max(1, -(-self.payload_bytes // self.chunk_bytes)):
            raise ValueError(
                f"{self.payload_bytes} payload bytes in chunks of {self.chunk_bytes} are not {self.chunk_count} chunks"
            )

    @classmethod
    def new(cls, payload_bytes: int, chunk_bytes: int) -> ChunkedHeader:
        """The header of a new write: a random blob id (not signed yet)."""
        count = max(1, -(-payload_bytes // chunk_bytes)) if chunk_bytes > 0 else 0
        return cls(os.urandom(BLOB_ID_BYTES), count, chunk_bytes, payload_bytes)

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview) -> ChunkedHeader:
        """The header at the start of `data` (not authenticated: see `authenticate`).

        Raises:
            AuthenticationFailed: no header of this version (bad magic, a `CKVC1` frame written
                before header tags, truncated) or sizes that no frame has.
        """
        if len(data) < HEADER_BYTES or bytes(data[: len(CHUNKED_MAGIC)]) != CHUNKED_MAGIC:
            found = bytes(data[: len(CHUNKED_MAGIC)])
            if is_chunked(data) and found != CHUNKED_MAGIC:
                raise AuthenticationFailed(f"a chunked blob of frame version {found!r}, before header tags")
            raise AuthenticationFailed("not a chunked chatkv blob (bad magic or truncated header)")
        _, blob_id, count, chunk_bytes, payload_bytes, tag = _HEADER.unpack_from(data)
        try:
            return cls(blob_id, count, chunk_bytes, payload_bytes, tag)
        except ValueError as exc:
            raise AuthenticationFailed(f"a chunked blob header that no blob has: {exc}") from exc

    def to_bytes(self) -> bytes:
        return _HEADER.pack(
            CHUNKED_MAGIC, self.blob_id, self.chunk_count, self.chunk_bytes, self.payload_bytes, self.tag
        )

    def plain_bytes(self, index: int) -> int:
        """Plaintext bytes of chunk `index`."""
        return min(self.chunk_bytes, self.payload_bytes - index * self.chunk_bytes)

    def sealed_bytes(self, index: int) -> int:
        """Bytes of sealed chunk `index` (its plaintext plus the tag)."""
        return self.plain_bytes(index) + TAG_BYTES

    @property
    def frame_bytes(self) -> int:
        """Bytes of the whole frame: header and every sealed chunk."""
        return HEADER_BYTES + self.payload_bytes + self.chunk_count * TAG_BYTES

    def _sizes_aad(self, blob_aad: bytes) -> bytes:
        return (
            blob_aad
            + (
                f"|blob={self.blob_id.hex()}|chunks={self.chunk_count}"
                f"|chunk_bytes={self.chunk_bytes}|payload_bytes={self.payload_bytes}|header"
            ).encode()
        )

    def chunk_aad(self, blob_aad: bytes, index: int) -> bytes:
        """Associated data of chunk `index`: the blob's, then everything the header says, then the index."""
        return (
            blob_aad
            + (
                f"|blob={self.blob_id.hex()}|chunk={index}/{self.chunk_count}"
                f"|chunk_bytes={self.chunk_bytes}|payload_bytes={self.payload_bytes}"
            ).encode()
        )

    def cipher(self, data_key: bytes) -> AESGCM:
        """AES-GCM under this blob's own key, derived from the tenant's data key and the blob id."""
        kdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=self.blob_id, info=_KDF_INFO)
        return AESGCM(kdf.derive(data_key))

    def signed(self, cipher: AESGCM, blob_aad: bytes) -> ChunkedHeader:
        """This header with the tag that binds its sizes and blob id to `blob_aad` under `cipher`."""
        return replace(self, tag=cipher.encrypt(_HEADER_NONCE, b"", self._sizes_aad(blob_aad)))

    def authenticate(self, cipher: AESGCM, blob_aads: Sequence[bytes]) -> bytes:
        """The first of `blob_aads` this header's tag authenticates under (`cipher`: its blob key).

        Raises:
            AuthenticationFailed: under none of them (forged, another tenant's key, moved to
                another name, another model or format).
        """
        for blob_aad in blob_aads:
            try:
                cipher.decrypt(_HEADER_NONCE, self.tag, self._sizes_aad(blob_aad))
            except InvalidTag:
                continue
            return blob_aad
        raise AuthenticationFailed(f"the header of a chunked blob of {self.chunk_count} chunks does not authenticate")


def _nonce(index: int) -> bytes:
    return index.to_bytes(NONCE_BYTES, "big")


def seal_chunked(data_key: bytes, payload: bytes, blob_aad: bytes, chunk_bytes: int = CHUNK_BYTES) -> bytearray:
    """The frame of `payload` sealed in chunks of `chunk_bytes` under `data_key`, bound to `blob_aad`.

    Each chunk is encrypted straight into its place in the frame (`encrypt_into`): encrypting
    each into a `bytes` of its own and joining them wrote the frame twice, into fresh memory both
    times (186 MB: 147 against 74 ms, issue 32).

    Raises:
        ValueError: `chunk_bytes` out of 1..MAX_CHUNK_BYTES.
    """
    header = ChunkedHeader.new(len(payload), chunk_bytes)
    cipher, plain = header.cipher(data_key), memoryview(payload)
    header = header.signed(cipher, blob_aad)
    frame = bytearray(header.frame_bytes)
    out = memoryview(frame)
    out[:HEADER_BYTES] = header.to_bytes()
    offset = HEADER_BYTES
    for index in range(header.chunk_count):
        start, sealed = index * chunk_bytes, header.sealed_bytes(index)
        cipher.encrypt_into(
            _nonce(index),
            plain[start : start + header.plain_bytes(index)],
            header.chunk_aad(blob_aad, index),
            out[offset : offset + sealed],
        )
        offset += sealed
    out.release()  # a bytearray with a view open cannot be resized: leave none
    return frame


def split_frame(frame: bytes | bytearray | memoryview) -> tuple[memoryview, list[memoryview]]:
    """The header and the sealed chunks of a whole frame, as views (no copy).

    Raises:
        AuthenticationFailed: not a frame, or not as long as its header says (truncated, extended).
    """
    header = ChunkedHeader.parse(frame)
    if len(frame) != header.frame_bytes:
        raise AuthenticationFailed(f"a chunked blob of {len(frame)} bytes, its header says {header.frame_bytes}")
    view, chunks, offset = memoryview(frame), [], HEADER_BYTES
    for index in range(header.chunk_count):
        chunks.append(view[offset : offset + header.sealed_bytes(index)])
        offset += header.sealed_bytes(index)
    return view[:HEADER_BYTES], chunks


def open_header(
    data_key: bytes, head: bytes | memoryview, blob_aads: Sequence[bytes], *, max_payload_bytes: int
) -> tuple[ChunkedHeader, AESGCM, bytes]:
    """The header of a chunked blob once it is known to be genuine: its sizes within
    `max_payload_bytes` (what a cache can hold), its tag authenticated. Returns the header, its
    blob's cipher and the blob associated data it authenticated under. Allocates nothing that
    depends on the header's sizes, so a forged one costs the same as a genuine one.

    Raises:
        AuthenticationFailed: a header that does not parse, claims more than `max_payload_bytes`,
            or does not authenticate under `data_key` and any of `blob_aads`.
    """
    header = ChunkedHeader.parse(head)
    if header.payload_bytes > max_payload_bytes:
        raise AuthenticationFailed(
            f"a chunked blob header claims {header.payload_bytes} payload bytes in {header.chunk_count} chunks, "
            f"more than a cache of this model holds ({max_payload_bytes} bytes)"
        )
    cipher = header.cipher(data_key)
    return header, cipher, header.authenticate(cipher, blob_aads)


def payload_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A zeroed, writable buffer of `nbytes` bytes that a payload is decrypted into and its tensors
    then view (`storage.codec.decode`): from `MAPPED_PAYLOAD_BYTES` on, private anonymous memory
    (`mmap`) whose pages are all in place when it is returned (`MAP_POPULATE`, on Linux), else a
    `bytearray`.

    Why: the buffer is new memory every time (the restored cache keeps it), and faulting it in
    cost as much as receiving and decrypting it (a 186 MB payload: 290 of a 660 ms Redis restore
    at load 5.5, issue 32). A `bytearray` is zeroed by the kernel on each fault and then once more
    by CPython; a fresh mapping only by the kernel. Populated at `mmap` the kernel allocates and
    zeroes the pages in one call instead of taking one fault per 4 KiB page as the decryption
    first writes it: 1.1-1.5 against 1.7-2.1 us a page; a Redis restore of 92 / 186 MB took 8 / 5%
    less time and 8 / 15% less CPU (30 restores each, interleaved, load 3.6-4.1; runs of 15 at
    load 5 went either way: the reads then wait longer for Redis on a 2-core VM; benchmarks/README.md,
    `redis_restore.py`, 2026-12-04). Not advised for
    transparent huge pages: they cut the faults 4x for back-to-back restores, but on a VM that
    hands freed 2 MiB blocks back to its host (free page reporting) a restore seconds after the
    last took 0.8-2.3 s instead of 0.3-0.6 s (benchmarks/README.md, `redis_restore.py`, 2026-12-03).
    """
    if nbytes < MAPPED_PAYLOAD_BYTES:
        return bytearray(nbytes)
    # Private: a shared anonymous mapping is shmem, whose pages the process does not own alone.
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)


def open_chunked(
    data_key: bytes,
    head: bytes | memoryview,
    chunks: Iterable[bytes | memoryview],
    blob_aads: Sequence[bytes],
    *,
    max_payload_bytes: int,
) -> bytearray | mmap.mmap:
    """The payload of a chunked blob (in a `payload_buffer`), each chunk decrypted into place as
    it comes from `chunks` (so a reader fetching the next chunks overlaps with this). A chunk is
    used before the next is taken, so a reader may hand each in the buffer of the one before.

    `head` is the frame's header, `chunks` its sealed chunks in order (not asked for before the
    header authenticated: `open_header`); `blob_aads` the associated data the blob may be bound
    to, the current format's first; `max_payload_bytes` the most a cache can hold.

    Raises:
        AuthenticationFailed: a header that does not parse, claims too much or does not
            authenticate; a chunk that does not authenticate (tampered, of another blob or
            another write, out of its place); fewer or more chunks than the header says.
    """
    header, cipher, blob_aad = open_header(data_key, head, blob_aads, max_payload_bytes=max_payload_bytes)
    pending = iter(chunks)
    first = next(pending, None)
    if first is None:
        raise AuthenticationFailed(f"a chunked blob without its chunks ({header.chunk_count} expected)")
    # Made once the first chunk is asked for, not before: populating its pages takes tens of
    # milliseconds, in which Redis already sends the next chunks instead of waiting for the ask.
    payload = payload_buffer(header.payload_bytes)
    try:
        _decrypt_chunks(header, cipher, blob_aad, chain([first], pending), payload)
    except BaseException:
        # Unmapped now, not when the error goes: its traceback holds this frame, and with it a
        # populated mapping as large as the cache (hundreds of MB) for as long as anyone keeps
        # the error (a log record, a handler still running, a test's `excinfo`).
        _discard(payload)
        raise
    return payload


def _decrypt_chunks(
    header: ChunkedHeader,
    cipher: AESGCM,
    blob_aad: bytes,
    chunks: Iterable[bytes | memoryview],
    payload: bytearray | mmap.mmap,
) -> None:
    """Decrypt `chunks` into their places in `payload`. Raises `AuthenticationFailed` (see `open_chunked`)."""
    count = 0
    with memoryview(payload) as view:
        for index, sealed in enumerate(chunks):
            if index >= header.chunk_count:
                raise AuthenticationFailed(f"more chunks than the {header.chunk_count} its header says")
            if len(sealed) != header.sealed_bytes(index):
                raise AuthenticationFailed(
                    f"chunk {index} is {len(sealed)} bytes, its header says {header.sealed_bytes(index)}"
                )
            start = index * header.chunk_bytes
            try:
                cipher.decrypt_into(
                    _nonce(index),
                    sealed,
                    header.chunk_aad(blob_aad, index),
                    view[start : start + header.plain_bytes(index)],
                )
            except InvalidTag as exc:
                raise AuthenticationFailed(f"chunk {index} of {header.chunk_count} does not authenticate") from exc
            count = index + 1
    if count != header.chunk_count:
        raise AuthenticationFailed(f"{count} chunks of the {header.chunk_count} its header says")


def _discard(payload: bytearray | mmap.mmap) -> None:
    """Unmap a payload buffer that will not be returned (a `bytearray` is left to the collector)."""
    if isinstance(payload, mmap.mmap):
        # A view of it still held elsewhere keeps it mapped until that view goes, as before.
        with suppress(BufferError):
            payload.close()
