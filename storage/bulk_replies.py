"""RESP bulk-string replies received straight into reused buffers: the Redis tier's chunk reader.

redis-py's reply parsers (hiredis or its pure-Python one) receive into their own buffer and hand
each reply back as a new `bytes`: for a 2 MiB chunk, fresh memory whose pages the kernel faults in
and zeroes, and which is freed again once the chunk is decrypted. Profiled on a 4,000-token restore
(186 MB, issue 32) that cost as much as the transfer itself; a hand-written parser that still made
a `bytes` per reply was no faster than hiredis. A GET's reply is a bulk string, length-prefixed:

    $<n>\\r\\n<n bytes>\\r\\n       a value           $-1\\r\\n  or  _\\r\\n   no value (RESP2 / RESP3)
    -<message>\\r\\n                an error (WRONGTYPE, MOVED in a cluster, ...)

so `BulkReader` reads the short first line and then `socket.recv_into`s the value's bytes
straight into a buffer kept between replies and between reads (`ReplyBuffers`); the GIL is
released while it waits. No parsing of the value, no copy beyond the kernel's, no new pages.

A reply is a view of the reader's buffer, valid until the next reply is read: the reader releases
it then (a piece kept by mistake raises `ValueError` when used, instead of showing the next
chunk's bytes). Errors are redis-py's own, so the store turns them into `RedisUnavailable` as it
does any other: `ConnectionError` (closed mid-reply, socket error), `TimeoutError` (the socket's
timeout, set by redis-py), `ResponseError` (an error reply), `InvalidResponse` (not a bulk string,
or longer than `MAX_BULK_BYTES`).
"""

from __future__ import annotations

import socket
import threading

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

MAX_BULK_BYTES = 512 * 1024 * 1024
"""Longest value a reply may announce: Redis's own limit on a string (`proto-max-bulk-len`)."""
_FIRST_READ_BYTES = 64
"""Bytes asked for while a reply's first line is awaited: the line (`$2097168\\r\\n` is 10 bytes)
and a few of the value's, so all but those few are received in place."""
_MAX_LINE_BYTES = 64 * 1024
"""Longest first line read (an error message); longer is `InvalidResponse`."""


class ReplyBuffers:
    """Receive buffers kept between reads, so a chunk lands in memory already faulted in. Thread-safe.

    Args:
        max_pooled_bytes: the largest buffer kept (the largest sealed chunk); a longer value is
            received into a buffer of its own, dropped after.
        spare: most buffers kept (one per concurrent read).
    """

    def __init__(self, max_pooled_bytes: int, spare: int = 4) -> None:
        self.max_pooled_bytes = max_pooled_bytes
        self._spare = spare
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of at least `nbytes` (a kept one if one is long enough)."""
        with self._lock:
            for index, buffer in enumerate(self._free):
                if len(buffer) >= nbytes:
                    return self._free.pop(index)
        return bytearray(nbytes)

    def give(self, buffer: bytearray) -> None:
        """Keep `buffer` for a later read (unless too long, or enough are kept)."""
        if len(buffer) > self.max_pooled_bytes:
            return
        with self._lock:
            if len(self._free) < self._spare:
                self._free.append(buffer)


class BulkReader:
    """Reads RESP bulk-string replies from `sock` into one buffer taken from `buffers`.

    Use it on a connection whose earlier replies were all read, and `close` it when done (its
    buffer goes back to `buffers`). Not thread-safe.

    Args:
        sock: a connected socket (plain or TLS) with the client's timeout set.
        buffers: where the receive buffer comes from and goes back to.
    """

    def __init__(self, sock: socket.socket, buffers: ReplyBuffers) -> None:
        self._sock = sock
        self._buffers = buffers
        self._buffer: bytearray | None = None
        self._reply: memoryview | None = None
        self._line = bytearray(_MAX_LINE_BYTES)
        self._start = self._end = 0  # received bytes of `_line` not yet consumed

    def read(self) -> memoryview | None:
        """The next reply's value as a view of the reader's buffer (valid until the next `read`),
        or `None` for a key without a value.

        Raises:
            ConnectionError, TimeoutError, ResponseError, InvalidResponse: see the module.
        """
        self._release()
        line = self._first_line()
        kind, rest = line[:1], line[1:]
        if kind == b"_" or line == b"$-1":
            return None
        if kind == b"-":
            raise ResponseError(rest.decode("utf-8", "replace"))
        if kind != b"$" or not rest.isdigit():
            raise InvalidResponse(f"not a bulk string reply: {line[:40]!r}")
        nbytes = int(rest)
        if nbytes > MAX_BULK_BYTES:
            raise InvalidResponse(f"a bulk string of {nbytes} bytes, more than Redis holds ({MAX_BULK_BYTES})")
        reply = memoryview(self._buffer_for(nbytes))[:nbytes]
        have = min(nbytes, self._end - self._start)
        reply[:have] = self._line[self._start : self._start + have]
        self._start += have
        while have < nbytes:
            have += self._recv_into(reply[have:])
        if self._take(2) != b"\r\n":
            raise InvalidResponse("a bulk string not ended by CRLF")
        self._reply = reply
        return reply

    def close(self) -> None:
        """Release the last reply and give the buffer back."""
        self._release()
        if self._buffer is not None:
            self._buffers.give(self._buffer)
            self._buffer = None

    def _release(self) -> None:
        if self._reply is not None:
            self._reply.release()
            self._reply = None

    def _buffer_for(self, nbytes: int) -> bytearray:
        if self._buffer is None or len(self._buffer) < nbytes:
            if self._buffer is not None:
                self._buffers.give(self._buffer)
            self._buffer = self._buffers.take(nbytes)
        return self._buffer

    def _first_line(self) -> bytes:
        """The reply's first line without its CRLF, consumed."""
        while (end := self._line.find(b"\r\n", self._start, self._end)) < 0:
            if self._end - self._start >= _MAX_LINE_BYTES - 2:
                raise InvalidResponse(f"a reply line longer than {_MAX_LINE_BYTES} bytes")
            self._fill(_FIRST_READ_BYTES)
        line = bytes(self._line[self._start : end])
        self._start = end + 2
        return line

    def _take(self, nbytes: int) -> bytes:
        """The next `nbytes` received bytes, consumed."""
        while self._end - self._start < nbytes:
            self._fill(nbytes)
        taken = bytes(self._line[self._start : self._start + nbytes])
        self._start += nbytes
        return taken

    def _fill(self, nbytes: int) -> None:
        """Receive up to `nbytes` more into `_line` (moving what is left of it to its start)."""
        if self._start:
            left = self._end - self._start
            self._line[:left] = self._line[self._start : self._end]
            self._start, self._end = 0, left
        nbytes = min(nbytes, len(self._line) - self._end)
        self._end += self._recv_into(memoryview(self._line)[self._end : self._end + nbytes])

    def _recv_into(self, view: memoryview) -> int:
        try:
            received = self._sock.recv_into(view)
        except TimeoutError as exc:  # the socket's timeout (builtin; an OSError, so caught first)
            raise RedisTimeoutError("Timeout reading from socket") from exc
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from socket: {exc}") from exc
        if not received:
            raise RedisConnectionError("Connection closed by server.")
        return received
