"""Chunked sealing: a frame round-trips through whole bytes and through its pieces, and every chunk out
of its place (swapped, reordered, dropped, added, replayed from an older write, mixed in from
another blob) or a header that lies is `AuthenticationFailed`, never a wrong payload; a header is
authenticated, and its sizes bounded, before the first chunk is asked for."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

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
MAX_PAYLOAD = 10 * CHUNK


def open_frame(frame: bytes, aads: tuple[bytes, ...] = (AAD,), key: bytes = KEY) -> bytes:
    head, chunks = split_frame(frame)
    return bytes(open_chunked(key, head, chunks, aads, max_payload_bytes=MAX_PAYLOAD))


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
    one_at_a_time = open_chunked(KEY, head, iter(chunks), (AAD,), max_payload_bytes=MAX_PAYLOAD)
    assert bytes(one_at_a_time) == payload


@pytest.mark.parametrize("size", [0, CHUNK, 5 * CHUNK + 37])
def test_a_frame_is_its_header_then_each_chunk_sealed_on_its_own(size: int) -> None:
    """The frame is written in place (each chunk encrypted into its slot): it holds exactly the
    header and the chunks sealed one by one as the format says, nothing between or after."""
    payload = os.urandom(size)
    frame = seal_chunked(KEY, payload, AAD, chunk_bytes=CHUNK)
    header = ChunkedHeader.parse(frame)
    cipher = header.cipher(KEY)
    chunks = [
        cipher.encrypt(
            index.to_bytes(12, "big"), payload[index * CHUNK : (index + 1) * CHUNK], header.chunk_aad(AAD, index)
        )
        for index in range(header.chunk_count)
    ]
    assert bytes(frame) == header.signed(cipher, AAD).to_bytes() + b"".join(chunks)


def test_each_write_is_a_new_blob() -> None:
    first, second = (seal_chunked(KEY, b"same payload", AAD, chunk_bytes=CHUNK) for _ in range(2))
    assert ChunkedHeader.parse(first).blob_id != ChunkedHeader.parse(second).blob_id
    assert first[HEADER_BYTES:] != second[HEADER_BYTES:]  # another blob key


def rejected(head: bytes, chunks: list[bytes], aads: tuple[bytes, ...] = (AAD,), key: bytes = KEY) -> str:
    with pytest.raises(AuthenticationFailed) as failure:
        open_chunked(key, head, chunks, aads, max_payload_bytes=MAX_PAYLOAD)
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
    assert len(bytes(open_chunked(KEY, old_head, old, (AAD,), max_payload_bytes=MAX_PAYLOAD))) == 3 * CHUNK


def test_a_blob_under_another_name_key_or_format_is_rejected() -> None:
    head, chunks = pieces(seal_chunked(KEY, os.urandom(2 * CHUNK), AAD, chunk_bytes=CHUNK))
    header_fails = "the header of a chunked blob of 2 chunks does not authenticate"
    assert rejected(head, chunks, aads=(blob_aad("tn_a", "s_2", "fp", 2),)) == header_fails
    assert rejected(head, chunks, aads=(blob_aad("tn_b", "s_1", "fp", 2),)) == header_fails
    assert rejected(head, chunks, aads=(blob_aad("tn_a", "s_1", "other", 2),)) == header_fails
    assert rejected(head, chunks, key=bytes(32)) == header_fails
    # An older format's associated data is accepted when the caller lists it; the header decides.
    old_aad = blob_aad("tn_a", "s_1", "fp", 1)
    old_head, old_chunks = pieces(seal_chunked(KEY, b"x" * 150, old_aad, chunk_bytes=CHUNK))
    assert bytes(open_chunked(KEY, old_head, old_chunks, (AAD, old_aad), max_payload_bytes=MAX_PAYLOAD)) == b"x" * 150


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
    head, _ = pieces(seal_chunked(KEY, os.urandom(3 * CHUNK), AAD, chunk_bytes=CHUNK))
    values = vars(ChunkedHeader.parse(head)) | {field: value}
    lying = struct.pack(
        "<5s16sIIQ16s",
        b"CKVC2",
        *(values[f] for f in ("blob_id", "chunk_count", "chunk_bytes", "payload_bytes", "tag")),
    )
    # Sizes no frame has, or sizes its tag was not made for: rejected before a chunk is asked for.
    with pytest.raises(AuthenticationFailed):
        open_chunked(KEY, lying, untouchable(), (AAD,), max_payload_bytes=MAX_PAYLOAD)


def untouchable() -> Iterator[bytes]:
    """Chunks that must never be asked for."""
    raise AssertionError("a chunk was asked for before the header authenticated")
    yield b""


def test_a_forged_header_claiming_four_billion_chunks_is_rejected_before_any_chunk_is_asked_for() -> None:
    forged = ChunkedHeader(os.urandom(16), 2**32 - 1, 1, 2**32 - 1).to_bytes()  # a valid header, no valid tag
    with pytest.raises(AuthenticationFailed, match="header of a chunked blob of 4294967295 chunks"):
        open_chunked(KEY, forged, untouchable(), (AAD,), max_payload_bytes=2**33)
    message = "claims 4294967295 payload bytes in 4294967295 chunks, more than a cache of this model holds"
    with pytest.raises(AuthenticationFailed, match=message):
        open_chunked(KEY, forged, untouchable(), (AAD,), max_payload_bytes=MAX_PAYLOAD)


def test_a_genuine_header_over_the_payload_bound_is_rejected_before_any_chunk_is_asked_for() -> None:
    head, chunks = pieces(seal_chunked(KEY, os.urandom(3 * CHUNK), AAD, chunk_bytes=CHUNK))
    with pytest.raises(AuthenticationFailed, match=r"claims 300 payload bytes in 3 chunks, .* \(299 bytes\)"):
        open_chunked(KEY, head, untouchable(), (AAD,), max_payload_bytes=3 * CHUNK - 1)
    assert len(open_chunked(KEY, head, chunks, (AAD,), max_payload_bytes=3 * CHUNK)) == 3 * CHUNK


def test_a_frame_of_the_version_before_header_tags_is_rejected() -> None:
    old_header = struct.pack("<5s16sIIQ", b"CKVC1", os.urandom(16), 1, CHUNK, 5)  # 37 bytes, no tag
    assert is_chunked(old_header)
    with pytest.raises(AuthenticationFailed, match="frame version b'CKVC1', before header tags"):
        open_chunked(KEY, old_header, untouchable(), (AAD,), max_payload_bytes=MAX_PAYLOAD)


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


def resident_mib() -> float:
    """This process's resident memory (`/proc/self/statm`), in MiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fails_after(chunks: list[bytes], taken: int) -> Iterator[bytes]:
    """`chunks`, failing as a reader does when Redis loses the rest (a `BlobNotFound` there)."""
    yield from chunks[:taken]
    raise ConnectionError("the reader lost the rest")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
@pytest.mark.parametrize("failure", ["the last chunk tampered with", "the reader failing half way"])
def test_a_restore_that_fails_half_way_unmaps_its_payload_buffer_while_its_error_is_still_held(failure: str) -> None:
    """A large payload's buffer is mapped with its pages populated (`payload_buffer`); the failed
    open's traceback holds its frame, so without unmapping on the way out the mapping lived as
    long as the error did (a log record, a handler still running, `excinfo` here)."""
    payload_mib = 48
    head, chunks = pieces(seal_chunked(KEY, os.urandom(payload_mib * 2**20), AAD))
    chunks[-1] = bytes([chunks[-1][0] ^ 1]) + chunks[-1][1:]
    source = chunks if failure.startswith("the last") else fails_after(chunks, len(chunks) // 2)
    before = resident_mib()
    with pytest.raises((AuthenticationFailed, ConnectionError)) as excinfo:
        open_chunked(KEY, head, source, (AAD,), max_payload_bytes=2**30)
    held = resident_mib() - before
    assert held < payload_mib / 4, f"{held:.0f} MiB still resident while {excinfo.type.__name__} is held"
