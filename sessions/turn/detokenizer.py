"""Streaming detokenisation that never splits a character.

Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character (CJK, emoji); decoding
such a prefix yields U+FFFD. A piece is released only once the characters it ends with are
complete, so the pieces joined are exactly the text of all the ids (`tokenizer.decode`).

A fast tokenizer (one with a `tokenizers` backend) is followed with the tokenizers library's
incremental `DecodeStream`, which decodes a short window of recent ids per token (it returns
`None` while a character is incomplete): about 1 µs a token where re-decoding the whole reply
for every token grows with the reply (`benchmarks/detokenize.py`: a 2,000-token reply,
hundreds of times faster). A tokenizer without that backend falls back to re-decoding the reply
so far and releasing what was added, holding back a decoded tail that ends in U+FFFD; so does a
tokenizer whose decoder has byte fallback (Llama-2 / Mistral style: `DecodeStream` raises on an
invalid byte run, and what it released before can differ from the whole decode), and a reply
whose `DecodeStream` step fails for any other reason.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"


def _has_byte_fallback(backend: Tokenizer) -> bool:
    """Whether the decoder turns `<0xNN>` byte tokens back into bytes (Llama-2 / Mistral style
    sentencepiece tokenizers). `DecodeStream` fails on their invalid byte runs, and what it
    released before can differ from the whole reply's decode, so such tokenizers re-decode."""
    decoder = backend.decoder
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()


class IncrementalDetokenizer:
    """Turns generated ids into text pieces. `text` is the concatenation of the pieces released.

    Args:
        tokenizer: a Hugging Face tokenizer (`decode(ids, skip_special_tokens=...,
            clean_up_tokenization_spaces=...)`); a fast one is followed with `DecodeStream`.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self.text = ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: tuple[DecodeStream, Tokenizer] | None = None
        # Byte-fallback decoders decode a run of `<0xNN>` tokens as one group: a later byte token
        # can turn text already decoded ("h-") into replacement characters, so nothing is
        # released while the reply ends in a byte token.
        self._byte_tokens: frozenset[int] = frozenset()
        if isinstance(backend, Tokenizer) and _has_byte_fallback(backend):
            ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
            self._byte_tokens = frozenset(i for i in ids if i is not None)
        elif isinstance(backend, Tokenizer):
            self._stream = (DecodeStream(skip_special_tokens=False), backend)

    def _decode(self) -> str:
        return str(self._tokenizer.decode(self._ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def push(self, token_id: int) -> str:
        """Add a token; return the newly complete text (possibly empty)."""
        self._ids.append(token_id)
        piece: str | None = None
        if self._stream is not None:
            stream, backend = self._stream
            try:
                piece = stream.step(backend, token_id) or ""
            # tokenizers raises a bare `Exception` ("Invalid prefix encountered while decoding
            # stream") when a byte-fallback decoder with `Strip` meets an invalid byte run; the
            # re-decoding path below handles any tokenizer, so this reply continues on it.
            except Exception:  # noqa: BLE001
                self._stream = None
        if piece is None:
            if token_id in self._byte_tokens:
                return ""
            decoded = self._decode()
            if decoded.endswith(REPLACEMENT) or not decoded.startswith(self.text):
                return ""
            piece = decoded[len(self.text) :]
        self.text += piece
        return piece

    def finish(self) -> str:
        """Release what is left (an incomplete character at the very end stays as U+FFFD): one
        decode of the whole reply, which the pieces released so far must begin.

        Raises:
            RuntimeError: if they do not (a tokenizer whose `decode` post-processes the text).
        """
        decoded = self._decode()
        if not decoded.startswith(self.text):
            raise RuntimeError("bug: the tokenizer decoded a prefix differently from the whole")
        piece = decoded[len(self.text) :]
        self.text = decoded
        return piece
