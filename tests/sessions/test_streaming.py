"""Streaming: pieces never split a character, and joined they equal the reply text."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sessions.cancellation import CancelToken
from sessions.engine import Engine
from sessions.errors import TurnCancelled
from sessions.manager import SessionManager
from sessions.turn.detokenizer import IncrementalDetokenizer

TEXT = "猫が好きです 🐱🎉 naïve café 👩‍👩‍👧 Ωμέγα — «ok» 한국어"


class DecodeOnly:
    """The same tokenizer seen through `decode` only (no `tokenizers` backend), as a tokenizer
    without a fast backend is: the detokenizer falls back to re-decoding."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def _detokenize(tokenizer: Any, ids: list[int]) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token) for token in ids]
    pieces.append(detokenizer.finish())
    return pieces, detokenizer.text


@pytest.mark.parametrize("path", ["decode_stream", "re_decode"])
def test_detokenizer_holds_back_split_characters(tiny_engine: Engine, path: str) -> None:
    tokenizer = tiny_engine.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The test is only meaningful if some token ends inside a multi-byte character.
    partial = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    assert any(text.endswith("\ufffd") for text in partial)
    pieces, text = _detokenize(tokenizer if path == "decode_stream" else DecodeOnly(tokenizer), ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == TEXT == text
    assert sum(1 for piece in pieces if piece) > len(TEXT.split())  # released as it goes, not at the end


def test_both_detokenizers_release_the_same_pieces_of_any_ids(tiny_engine: Engine) -> None:
    """Random ids (stray bytes that never complete a character, special tokens): `DecodeStream`
    and re-decoding release the same pieces, which join to `tokenizer.decode` of all the ids."""
    tokenizer = tiny_engine.tokenizer
    generator = torch.Generator().manual_seed(5)
    for _ in range(10):
        ids = torch.randint(len(tokenizer), (300,), generator=generator).tolist()
        whole = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        streamed, text = _detokenize(tokenizer, ids)
        assert _detokenize(DecodeOnly(tokenizer), ids) == (streamed, text)
        assert "".join(streamed) == text == whole


def _byte_fallback_tokenizer() -> Any:
    """A small Llama-2-style tokenizer (BPE with `<0xNN>` byte fallback; decoder: Replace,
    ByteFallback, Fuse, Strip), as `--model` folders and hub ids of that family bring."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    corpus = ["Hello world, this is a test.", TEXT, "def f(x):\n    return x", "  runs  of   spaces "] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_a_byte_fallback_tokenizer_streams_any_ids_without_failing() -> None:
    """Its decoder decodes a run of byte tokens as one group (a later byte can turn "h-" into
    replacement characters), and `DecodeStream` raises on invalid runs: each reply's pieces still
    join to `tokenizer.decode` of all its ids, with nothing released that a later token changes."""
    tokenizer = _byte_fallback_tokenizer()
    generator = torch.Generator().manual_seed(7)
    for _ in range(200):
        ids = torch.randint(len(tokenizer), (30,), generator=generator).tolist()
        whole = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        streamed, text = _detokenize(tokenizer, ids)
        assert "".join(streamed) == text == whole
    natural = tokenizer.encode("Hello world, 你好 is a test.", add_special_tokens=False)  # 你好: byte tokens
    pieces, text = _detokenize(tokenizer, natural)
    assert text == "Hello world, 你好 is a test." and "你好" in pieces and sum(1 for piece in pieces if piece) > 3


def test_stream_chat_pieces_join_to_reply_text(tiny_manager: SessionManager) -> None:
    """A random tiny model sampled at temperature 1 emits many byte-level pieces of multi-byte
    characters; whatever it emits, the streamed pieces must join to the reply text."""
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    items = list(tiny_manager.stream_chat(tenant, sid, "hello", max_new_tokens=200, temperature=1.0, seed=7))
    reply = items[-1]
    pieces = items[:-1]
    assert all(isinstance(piece, str) and piece for piece in pieces)
    assert "".join(pieces) == reply.text  # type: ignore[arg-type]
    assert any(ord(ch) > 0x7F for ch in reply.text)  # type: ignore[union-attr]


def test_a_cancelled_turn_stops_where_it_is_and_stores_nothing(tiny_manager: SessionManager) -> None:
    """`CancelToken`: set before the turn, it is refused before any work; set mid-reply, the engine
    loop drops the request at its next step. Either way nothing is stored and the session is free."""
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    early = CancelToken()
    early.cancel("gone before it started")
    with pytest.raises(TurnCancelled, match="gone before it started"):
        tiny_manager.chat(tenant, sid, "hello", cancel=early)
    late = CancelToken()
    stream = tiny_manager.stream_chat(tenant, sid, "hello", max_new_tokens=3000, temperature=1.0, seed=3, cancel=late)
    assert isinstance(next(stream), str)
    late.cancel()
    with pytest.raises(TurnCancelled):
        for _ in stream:
            pass
    assert tiny_manager.history(tenant, sid) == []
    assert tiny_manager.chat(tenant, sid, "again", max_new_tokens=2).stats.restored_from == "new"
