"""Chunked sealing: a frame round-trips through whole bytes and through its pieces, and every chunk out
of its place (swapped, reordered, dropped, added, replayed from an older write, mixed in from
another blob) or a header that lies is `AuthenticationFailed`, never a wrong payload."""

from __future__ import annotations

import os
import struct

import pytest

from storage.chunked_blobs import (
    HEADER_BYTES,
    TAG_BYTES,
    ChunkedHeader,
    is_chunked,
    open_chunked,
    seal_chunked,
    split_frame,
)
from storage.keyring import AuthenticationFailed, blob_aad, seal

KEY = bytes(range(32))
AAD = blob_aad("tn_a", "s_1", "fp", 2)
CHUNK = 100


def open_frame(frame: bytes, aads: tuple[bytes, ...] = (AAD,), key: bytes = KEY) -> bytes:
    head, chunks = split_frame(frame)
    return bytes(open_chunked(key, head, chunks, aads))


def pieces(frame: bytes) -> tuple[bytes, list[bytes]]:
    head, chunks = split_frame(frame)
    return bytes(head), [bytes(chunk) for chunk in chunks]


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK, 5 * CHUNK + 37])
def test_round_trip_in_chunks_of_the_given_size(size: int) -> None:
    payload = os.urandom(size)
    frame = seal_chunked(KEY, payload, AAD, chunk_bytes=CHUNK)
    header = ChunkedHeader.parse(frame)
    assert is_chunked(frame) and not is_chunked(seal(KEY, payload, AAD))
    assert header.chunk_count == max(1, -(-size // CHUNK)) and header.payload_bytes == size
    assert len(frame) == header.frame_bytes == HEADER_BYTES + size + header.chunk_count * TAG_BYTES
    assert open_frame(frame) == payload
    head, chunks = pieces(frame)
    assert bytes(open_chunked(KEY, head, iter(chunks), (AAD,))) == payload  # one piece at a time


def test_each_write_is_a_new_blob() -> None:
    first, second = (seal_chunked(KEY, b"same payload", AAD, chunk_bytes=CHUNK) for _ in range(2))
    assert ChunkedHeader.parse(first).blob_id != ChunkedHeader.parse(second).blob_id
    assert first[HEADER_BYTES:] != second[HEADER_BYTES:]  # another blob key


def rejected(head: bytes, chunks: list[bytes], aads: tuple[bytes, ...] = (AAD,), key: bytes = KEY) -> str:
    with pytest.raises(AuthenticationFailed) as failure:
        open_chunked(key, head, chunks, aads)
    return str(failure.value)


def test_swapped_reordered_dropped_and_extra_chunks_are_rejected() -> None:
    head, chunks = pieces(seal_chunked(KEY, os.urandom(4 * CHUNK), AAD, chunk_bytes=CHUNK))
    swapped = [chunks[0], chunks[2], chunks[1], chunks[3]]
    assert "chunk 1 of 4 does not authenticate" in rejected(head, swapped)
    assert "chunk 0 of 4 does not authenticate" in rejected(head, chunks[1:] + chunks[:1])  # rotated
    assert "3 chunks of the 4" in rejected(head, chunks[:-1])  # the last one dropped
    assert "more chunks than the 4" in rejected(head, [*chunks, chunks[-1]])
    assert "without its chunks" in rejected(head, [])


def test_a_chunk_replayed_from_an_older_write_or_mixed_in_from_another_blob_is_rejected() -> None:
    old_head, old = pieces(seal_chunked(KEY, os.urandom(3 * CHUNK), AAD, chunk_bytes=CHUNK))
    head, new = pieces(seal_chunked(KEY, os.urandom(3 * CHUNK), AAD, chunk_bytes=CHUNK))
    other_aad = blob_aad("tn_a", "s_2", "fp", 2)
    _, other = pieces(seal_chunked(KEY, os.urandom(3 * CHUNK), other_aad, chunk_bytes=CHUNK))
    assert "chunk 2 of 3" in rejected(head, [new[0], new[1], old[2]])  # the same session's older write
    assert "chunk 1 of 3" in rejected(head, [new[0], other[1], new[2]])  # another session's blob
    # A whole older write is consistent: it opens (the transcript check catches a stale cache).
    assert len(bytes(open_chunked(KEY, old_head, old, (AAD,)))) == 3 * CHUNK


def test_a_blob_under_another_name_key_or_format_is_rejected() -> None:
    head, chunks = pieces(seal_chunked(KEY, os.urandom(2 * CHUNK), AAD, chunk_bytes=CHUNK))
    assert "chunk 0 of 2" in rejected(head, chunks, aads=(blob_aad("tn_a", "s_2", "fp", 2),))
    assert "chunk 0 of 2" in rejected(head, chunks, aads=(blob_aad("tn_b", "s_1", "fp", 2),))
    assert "chunk 0 of 2" in rejected(head, chunks, aads=(blob_aad("tn_a", "s_1", "other", 2),))
    assert "chunk 0 of 2" in rejected(head, chunks, key=bytes(32))
    # An older format's associated data is accepted when the caller lists it; the first chunk decides.
    old_aad = blob_aad("tn_a", "s_1", "fp", 1)
    old_head, old_chunks = pieces(seal_chunked(KEY, b"x" * 150, old_aad, chunk_bytes=CHUNK))
    assert bytes(open_chunked(KEY, old_head, old_chunks, (AAD, old_aad))) == b"x" * 150


def test_a_flipped_bit_anywhere_is_rejected() -> None:
    frame = seal_chunked(KEY, os.urandom(3 * CHUNK), AAD, chunk_bytes=CHUNK)
    for position in (0, 7, HEADER_BYTES - 1, HEADER_BYTES + 5, len(frame) // 2, len(frame) - 1):
        tampered = bytearray(frame)
        tampered[position] ^= 0x01
        with pytest.raises(AuthenticationFailed):
            open_frame(bytes(tampered))


@pytest.mark.parametrize(
    ("field", "value"),
    [("chunk_count", 2), ("chunk_bytes", 2 * CHUNK), ("payload_bytes", 3 * CHUNK - 1), ("blob_id", b"\0" * 16)],
)
def test_a_header_that_lies_is_rejected(field: str, value: object) -> None:
    head, chunks = pieces(seal_chunked(KEY, os.urandom(3 * CHUNK), AAD, chunk_bytes=CHUNK))
    values = vars(ChunkedHeader.parse(head)) | {field: value}
    lying = struct.pack(
        "<5s16sIIQ", b"CKVC1", *(values[f] for f in ("blob_id", "chunk_count", "chunk_bytes", "payload_bytes"))
    )
    with pytest.raises(AuthenticationFailed):  # sizes no frame has, or sizes its chunks were not sealed with
        open_chunked(KEY, lying, chunks, (AAD,))


def test_frames_of_the_wrong_length_and_headers_no_frame_has_are_rejected() -> None:
    frame = seal_chunked(KEY, os.urandom(2 * CHUNK), AAD, chunk_bytes=CHUNK)
    for broken in (frame[:-1], frame + b"x", frame[:HEADER_BYTES], frame[: HEADER_BYTES - 1], b""):
        with pytest.raises(AuthenticationFailed):
            split_frame(broken)
    huge = ChunkedHeader(b"\1" * 16, 1, CHUNK, CHUNK).to_bytes().replace((CHUNK).to_bytes(4, "little"), b"\xff" * 4, 1)
    with pytest.raises(AuthenticationFailed, match="no blob has"):
        ChunkedHeader.parse(huge)
    with pytest.raises(ValueError, match="chunk_bytes"):
        seal_chunked(KEY, b"x", AAD, chunk_bytes=0)
