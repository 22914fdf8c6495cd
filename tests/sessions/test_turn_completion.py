"""`complete_turn` without a model: tiny caches whose keys and values hold each token's stream
index, a fake template, and exact layer rows, counts, stats and crop decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from cache.ids import PrefixKey
from cache.layer_table import LayerKind, LayerSpan
from cache.session_cache import BaseLayer, SessionCache
from cache.working_cache import WorkingCache
from sessions.records import TurnStats
from sessions.turn.chat_template import PastTurn, rendering_digest
from sessions.turn.completion import Generation, TurnOutcome, TurnRules, complete_turn
from sessions.turn.prepared import PendingBase, PreparedTurn, TurnIds, TurnPlan, TurnStart
from sessions.turn.transcript import Transcript, transcript_digest

LAYERS, HEADS, HEAD_DIM = 2, 1, 2
EOS = 2
LIKE = torch.zeros(1, HEADS, 0, HEAD_DIM)


class _Template:
    """Each character is one id (its code point); a reply's ids end with `EOS`."""

    def text_reply_ids(self, text: str) -> tuple[int, ...]:
        return (*(ord(c) for c in text), EOS)

    def content_ids(self, assistant_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(assistant_ids[:-1]) if assistant_ids and assistant_ids[-1] == EOS else tuple(assistant_ids)


def rules(budget_tokens: int = 1_000) -> TurnRules:
    return TurnRules(_Template(), (EOS,), budget_tokens)


def kv(start: int, count: int) -> torch.Tensor:
    """`[1, HEADS, count, HEAD_DIM]` whose token `i` holds its stream index `start + i`."""
    return (
        torch.arange(start, start + count, dtype=torch.float32).view(1, 1, count, 1).expand(1, HEADS, count, HEAD_DIM)
    )


def base_layer(tokens: int) -> BaseLayer:
    return BaseLayer(
        PrefixKey("base"),
        tuple(range(1000, 1000 + tokens)),
        tuple(kv(0, tokens) for _ in range(LAYERS)),
        tuple(kv(0, tokens) for _ in range(LAYERS)),
    )


def run_engine(start: SessionCache, prefill: Sequence[int], generated: Sequence[int]) -> WorkingCache:
    """What the engine leaves: `start`, then the prefill and every generated id but the last fed."""
    working = start.to_working_cache(len(prefill) + len(generated))
    first = start.next_position
    fed = len(prefill) + len(generated) - 1
    for layer in working.prealloc_layers:
        layer.update(kv(first, fed), kv(first, fed))
    return working


def generation(
    working: WorkingCache, ids: Sequence[int], text: str | None = None, cut: int | None = None
) -> Generation:
    text = "".join(chr(i) for i in ids if i != EOS) if text is None else text
    return Generation(tuple(ids), text, cut, working, ttft_s=0.25, decode_s=1.5, queue_s=0.125)


def first_turn(
    user_ids: tuple[int, ...] = (10, 11, 12), *, pinned: bool = False, base: BaseLayer | None = None
) -> PreparedTurn:
    """A first turn of `user_ids` (base ids first when `base`) on an empty cache."""
    start = SessionCache.empty(base, LAYERS, LIKE)
    stream = (*(base.token_ids if base else ()), *user_ids)
    ids = TurnIds(user_ids, stream, len(stream), "<user>hi", turn_index=0, pinned=pinned)
    return PreparedTurn(ids, TurnStart(start, reused_tokens=start.total_tokens), "new", 0.0)


def complete(prepared: PreparedTurn, gen: Generation, budget_tokens: int = 1_000) -> TurnOutcome:
    return complete_turn(
        prepared, gen, start=prepared.cache, transcript=Transcript(None), user_text="hi", rules=rules(budget_tokens)
    )


def test_a_reply_ended_by_a_stop_token_keeps_every_fed_id_and_records_exact_stats() -> None:
    prepared = first_turn()
    generated = (ord("a"), ord("b"), ord("c"), EOS)
    outcome = complete(prepared, generation(run_engine(prepared.cache, prepared.prefill, generated), generated))

    assert outcome.cache is not None
    assert outcome.cache.layers == (LayerSpan(LayerKind.TURN, 0, 6, 0, 0),)  # 3 user ids + 3 fed reply ids
    assert outcome.cache.own_token_ids == (10, 11, 12, 97, 98, 99)
    assert outcome.cache.own_values[0][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert outcome.token_count == 6
    assert outcome.reply_token_ids == generated
    assert outcome.user_token_ids == (10, 11, 12)
    assert outcome.unpinned_turn is None
    assert outcome.reply.text == "abc"
    assert outcome.reply.token_ids == generated
    assert outcome.reply.finish_reason == "stop"
    assert outcome.reply.generated_text is None
    assert outcome.reply.stats == TurnStats(
        prefill_tokens=3,
        reused_tokens=0,
        ttft_s=0.25,
        decode_tokens=4,
        decode_s=1.5,
        restored_from="new",
        restore_s=0.0,
        base_reused_tokens=0,
        demoted_tokens=0,
        cache_tokens=6,
        peak_tokens=6,  # the 3 prefilled ids and 3 fed reply ids: the last sampled one is never fed
        queue_s=0.125,
    )
    turn = PastTurn("hi", "abc", generated)
    assert outcome.cache.transcript_digest == transcript_digest(Transcript(None).digest, turn, None)
    assert outcome.cache.rendering_digest == rendering_digest("<user>hiabc")


def test_a_reply_at_its_length_limit_finishes_by_length_and_leaves_its_last_id_unfed() -> None:
    prepared = first_turn()
    generated = (ord("a"), ord("b"))
    outcome = complete(prepared, generation(run_engine(prepared.cache, prepared.prefill, generated), generated))

    assert outcome.reply.finish_reason == "length"
    assert outcome.cache is not None
    assert outcome.cache.own_token_ids == (10, 11, 12, 97)
    assert outcome.cache.layers == (LayerSpan(LayerKind.TURN, 0, 4, 0, 0),)
    assert outcome.token_count == 4


def test_a_stop_string_after_whole_tokens_crops_the_cache_to_the_returned_text() -> None:
    prepared = first_turn()
    generated = (ord("a"), ord("b"), ord("S"), ord("x"), ord("y"))  # "S" stops; x, y were sampled after it
    working = run_engine(prepared.cache, prepared.prefill, generated)
    outcome = complete(prepared, generation(working, generated, cut=2))

    assert outcome.reply.text == "ab"
    assert outcome.reply.generated_text == "abSxy"
    assert outcome.reply.token_ids == generated  # what was generated, as usage counts it
    assert outcome.reply.finish_reason == "stop"
    assert outcome.reply_token_ids == (97, 98, EOS)  # what a posted history of "ab" stores
    assert working.get_seq_length() == 5  # cropped from 3 + 4 fed to the end of "ab"
    assert outcome.cache is not None
    assert outcome.cache.own_token_ids == (10, 11, 12, 97, 98)
    assert outcome.cache.own_keys[1][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    assert outcome.cache.layers == (LayerSpan(LayerKind.TURN, 0, 5, 0, 0),)
    assert outcome.token_count == 5
    assert outcome.reply.stats.cache_tokens == 5
    turn = PastTurn("hi", "ab", (97, 98, EOS))
    assert outcome.cache.transcript_digest == transcript_digest(Transcript(None).digest, turn, None)


def test_a_stop_string_inside_a_token_keeps_no_cache_and_counts_the_returned_text() -> None:
    prepared = first_turn()
    generated = (300, 301, 302)  # "abSc": the cut text's ids (97, 98) are not what was generated
    working = run_engine(prepared.cache, prepared.prefill, generated)
    outcome = complete(prepared, generation(working, generated, text="abSc", cut=2))

    assert outcome.cache is None
    assert working.get_seq_length() == 5  # not cropped
    assert outcome.reply_token_ids == (97, 98, EOS)
    assert outcome.token_count == 3 + 2  # the stream goes on after the stored ids, as a rebuild counts it
    assert outcome.reply.text == "ab"
    assert outcome.reply.stats.cache_tokens == 0
    assert outcome.reply.finish_reason == "stop"


def test_a_stop_string_whose_text_was_not_all_fed_keeps_no_cache() -> None:
    prepared = first_turn()
    generated = (ord("a"), ord("b"))  # "ab" then the cut: "b" was sampled last, never fed
    working = run_engine(prepared.cache, prepared.prefill, generated)
    outcome = complete(prepared, generation(working, generated, text="abS", cut=2))

    assert outcome.cache is None
    assert outcome.reply_token_ids == (97, 98, EOS)
    assert outcome.token_count == 5


def test_a_pending_base_is_part_of_the_start_cache_not_of_what_the_turn_appended() -> None:
    base = base_layer(4)
    stream = (*base.token_ids, 10, 11)
    ids = TurnIds((10, 11), stream, len(stream), "<sys><user>hi", turn_index=0, pinned=False)
    pending = TurnStart(
        SessionCache.empty(None, LAYERS, LIKE), feed=base.token_ids, pending_base=PendingBase(base.key, base.token_ids)
    )
    prepared = PreparedTurn(ids, pending, "new", 0.0)
    generated = (ord("a"), EOS)
    working = run_engine(prepared.cache, prepared.prefill, generated)
    adopted = SessionCache.empty(base, LAYERS, LIKE)
    outcome = complete_turn(
        prepared,
        generation(working, generated),
        start=adopted,
        transcript=Transcript(None),
        user_text="hi",
        rules=rules(),
    )

    assert prepared.spans == (LayerSpan(LayerKind.TURN, 0, 0, 4, 4),)
    assert outcome.cache is not None
    assert outcome.cache.base_token_ids == base.token_ids
    assert outcome.cache.own_token_ids == (10, 11, 97)
    assert outcome.cache.own_values[0][0, 0, :, 0].tolist() == [4, 5, 6]
    assert outcome.cache.layers == (LayerSpan(LayerKind.TURN, 0, 3, 4, 4),)
    assert outcome.token_count == 7
    assert outcome.reply.stats.prefill_tokens == 6  # the base was prefilled with the turn
    assert outcome.reply.stats.cache_tokens == 7


def test_a_turn_due_to_be_pinned_stays_a_turn_layer_when_its_pin_leaves_no_room() -> None:
    prepared = first_turn(pinned=True)
    generated = (ord("a"), ord("b"), EOS)
    roomy = complete(prepared, generation(run_engine(prepared.cache, prepared.prefill, generated), generated))
    assert roomy.unpinned_turn is None
    assert roomy.cache is not None and roomy.cache.layers[-1].kind is LayerKind.BASE

    # 5 pinned tokens + MIN_TURN_TOKENS (64) do not fit a budget of 68.
    working = run_engine(prepared.cache, prepared.prefill, generated)
    tight = complete(prepared, generation(working, generated), budget_tokens=68)
    assert tight.unpinned_turn == 0
    assert tight.cache is not None and tight.cache.layers == (LayerSpan(LayerKind.TURN, 0, 5, 0, 0),)


def test_a_reuse_turn_extends_the_previous_layer_by_its_closing_and_starts_its_own_after_it() -> None:
    first = first_turn(base=base_layer(2))
    done = complete(first, generation(run_engine(first.cache, first.prefill, (97, EOS)), (97, EOS)))
    assert done.cache is not None
    previous = done.cache.layers[-1]
    assert previous == LayerSpan(LayerKind.TURN, 0, 4, 2, 2)  # 3 user ids + "a"
    transcript = Transcript(None, [PastTurn("hi", "a", (97, EOS))], token_count=done.token_count)
    closing, turn = (50, 51), (20, 21, 22)
    ids = TurnIds.after(transcript, TurnPlan(closing, turn, "<user>again"))
    start = TurnStart(
        done.cache,
        feed=closing,
        spans=(replace(previous, token_count=previous.token_count + len(closing)),),
        reused_tokens=done.cache.total_tokens,
        base_reused=2,
    )
    prepared = PreparedTurn(ids, start, "device", 0.5)
    assert prepared.prefill == (50, 51, 20, 21, 22)
    assert ids.user_token_ids == (50, 51, 20, 21, 22)
    generated = (98, 99, EOS)
    outcome = complete_turn(
        prepared,
        generation(run_engine(done.cache, prepared.prefill, generated), generated),
        start=done.cache,
        transcript=transcript,
        user_text="again",
        rules=rules(),
    )

    assert outcome.cache is not None
    assert outcome.cache.layers == (
        LayerSpan(LayerKind.TURN, 0, 6, 2, 2),  # closing fed into the previous turn's layer
        LayerSpan(LayerKind.TURN, 1, 5, 8, 8),  # 3 turn ids + 2 fed reply ids
    )
    assert outcome.cache.own_token_ids == (10, 11, 12, 97, 50, 51, 20, 21, 22, 98, 99)
    assert outcome.cache.own_values[1][0, 0, :, 0].tolist() == list(range(2, 13))
    assert outcome.token_count == 6 + 2 + 3 + 2
    stats = outcome.reply.stats
    assert (stats.prefill_tokens, stats.reused_tokens, stats.base_reused_tokens) == (5, 6, 2)
    assert (stats.restored_from, stats.restore_s, stats.cache_tokens) == ("device", 0.5, 13)
