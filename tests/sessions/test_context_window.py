"""Issue 4's context window through the manager: demotion, pinning, bounded memory, re-prefill mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, Phi3Config, Phi3ForCausalLM

from cache.layer_table import LayerKind
from sessions.engine import Engine
from sessions.errors import InvalidInput
from sessions.manager import SessionManager
from sessions.model_source import load_model
from tests.conftest import MODEL_CACHE, make_settings

MESSAGES = ["hello there", "tell me more", "and then?", "why?", "ok"]


def last_turn_stats(home: Path, engine: Engine, budget: int, turns: int) -> tuple[object, SessionManager]:
    manager = SessionManager(make_settings(home, context_budget_tokens=budget), engine=engine)
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt="Be brief.")
    reply = None
    for message in MESSAGES[:turns]:
        reply = manager.chat(tenant, sid, message, max_new_tokens=8)
    return reply, manager


def test_window_exactly_full_demotes_nothing_and_one_token_less_demotes_exactly_one_turn(
    tmp_path: Path, tiny_engine: Engine
) -> None:
    probe, manager = last_turn_stats(tmp_path / "probe", tiny_engine, 4000, 4)
    manager.close()
    # Cache before the 4th turn + its prefill + max_new_tokens: the window the turn needs.
    needed = probe.stats.reused_tokens + probe.stats.prefill_tokens + 8  # type: ignore[attr-defined]
    full, manager = last_turn_stats(tmp_path / "full", tiny_engine, needed, 4)
    manager.close()
    assert full.stats.demoted_tokens == 0  # type: ignore[attr-defined]
    tight, manager = last_turn_stats(tmp_path / "tight", tiny_engine, needed - 1, 4)
    with manager:
        sid = manager.list_sessions("acme")[0].id
        layers = manager.inspect_session("acme", sid).layers
        assert [span.turn_index for span in layers if span.kind is LayerKind.TURN] == [1, 2, 3]
        assert tight.stats.demoted_tokens == probe.stats.reused_tokens - (  # type: ignore[attr-defined]
            tight.stats.reused_tokens  # type: ignore[attr-defined]
        )


def test_conversation_of_100k_tokens_stays_within_a_small_window(tmp_path: Path, tiny_engine: Engine) -> None:
    budget = 512
    max_position = tiny_engine.max_context_tokens
    with SessionManager(make_settings(tmp_path / "home", context_budget_tokens=budget), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="You keep answers short.")
        key = manager.internals.tiers_key(tenant, sid)
        message = "tell me a long story about " + "the sea and the sky " * 70  # ~ 400 tokens a turn
        total = 0
        turns = 0
        while total < 100_000:
            reply = manager.chat(tenant, sid, f"{turns}: {message}", max_new_tokens=16)
            cache = manager.internals.tiers.peek(key)
            assert cache is not None
            assert cache.total_tokens <= budget
            assert max(span.position_end for span in cache.full_layer_table()) <= min(budget, max_position)
            assert cache.own_keys[0].shape[-2] == cache.own_tokens
            total = manager.session_info(tenant, sid).token_count
            turns += 1
        assert reply.stats.demoted_tokens > 0
        assert len(manager.history(tenant, sid)) == 2 * turns  # the transcript keeps every message


def test_long_system_prompt_stays_in_the_context_of_every_reply(tmp_path: Path, tiny_engine: Engine) -> None:
    system_prompt = "Rules: " + "always answer politely and keep to the facts. " * 160
    settings = make_settings(tmp_path / "home", context_budget_tokens=2048)
    with SessionManager(settings, engine=tiny_engine) as manager:
        system_ids = manager.internals.template.system_prefix_ids(system_prompt)
        assert 1400 <= len(system_ids) <= 1700
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=system_prompt)
        key = manager.internals.tiers_key(tenant, sid)
        demoted = 0
        for turn in range(12):
            reply = manager.chat(tenant, sid, f"question {turn}: " + "details " * 40, max_new_tokens=16)
            demoted += reply.stats.demoted_tokens
            cache = manager.internals.tiers.peek(key)
            assert cache is not None and cache.total_tokens <= 2048
            assert cache.base_token_ids == system_ids  # the system prompt is in every reply's context
        assert demoted > 0


def test_pinned_turns_survive_the_window(tmp_path: Path, tiny_engine: Engine) -> None:
    settings = make_settings(tmp_path / "home", context_budget_tokens=300, pin_first_turn=True)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant)
        for turn in range(3):
            manager.chat(tenant, sid, f"turn {turn} " + "words " * 20, max_new_tokens=8)
        manager.pin_turn(tenant, sid, 2)
        for turn in range(3, 10):
            manager.chat(tenant, sid, f"turn {turn} " + "words " * 20, max_new_tokens=8)
        layers = manager.inspect_session(tenant, sid).layers
        kept = [span.turn_index for span in layers if span.turn_index is not None]
        assert 0 in kept and 2 in kept and 1 not in kept
        assert all(span.kind is LayerKind.BASE for span in layers if span.turn_index in (0, 2))
        with pytest.raises(InvalidInput, match="demoted"):
            manager.pin_turn(tenant, sid, 1)
        with pytest.raises(InvalidInput, match="no turn"):
            manager.pin_turn(tenant, sid, 99)
        # Pins are stored: a rebuilt cache (after a restart without blobs) keeps them too.
        assert manager.internals.metadata.get_session(tenant_id=tenant.id, session_id=sid).pinned_turns == (0, 2)


@torch.inference_mode()
def greedy(engine: Engine, token_ids: list[int], max_new_tokens: int) -> list[int]:
    cache = DynamicCache(config=engine.model.config)
    inputs, out = torch.tensor([token_ids]), []
    for _ in range(max_new_tokens):
        token = int(torch.argmax(engine.model(input_ids=inputs, cache=cache, use_cache=True).logits[0, -1]))
        out.append(token)
        if token in engine.stop_token_ids:
            break
        inputs = torch.tensor([[token]])
    return out


@pytest.mark.real_model
def test_reprefill_mode_reply_after_windowing_equals_a_fresh_prefill_of_base_and_kept_turns(
    tmp_path: Path, real_engine: Engine
) -> None:
    # The same model, told its RoPE cannot be shifted: windowing must re-prefill the kept turns.
    engine = Engine(real_engine.loaded)
    engine.runner.rope_layout = None
    settings = make_settings(tmp_path / "home", context_budget_tokens=160)
    with SessionManager(settings, engine=engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="You are a concise assistant.")
        key = manager.internals.tiers_key(tenant, sid)
        windowed = 0
        for message in ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a city.", "Name a tree."]:
            before = manager.internals.tiers.peek(key)
            reply = manager.chat(tenant, sid, message, max_new_tokens=24)
            if reply.stats.demoted_tokens:
                windowed += 1
                after = manager.internals.tiers.peek(key)
                assert before is not None and after is not None
                prompt = list(after.token_ids[: after.total_tokens - (reply.stats.decode_tokens - 1)])
                assert list(reply.token_ids) == greedy(engine, prompt, 24)
        assert windowed >= 1


def test_model_with_a_non_composable_rope_uses_the_reprefill_path(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config)
    path = tmp_path / "dynamic-rope"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    engine = Engine(load_model(str(path), MODEL_CACHE, "cpu", "float32"))
    assert engine.rope_layout is None
    with SessionManager(make_settings(tmp_path / "home", context_budget_tokens=120), engine=engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant)
        demoted = sum(
            manager.chat(tenant, sid, f"message {i} " + "x " * 10, max_new_tokens=8).stats.demoted_tokens
            for i in range(6)
        )
        assert demoted > 0
        cache = manager.internals.tiers.peek(manager.internals.tiers_key(tenant, sid))
        assert cache is not None and cache.total_tokens <= 120


def test_pins_that_would_leave_no_room_are_refused_so_a_session_stays_usable(
    tmp_path: Path, tiny_engine: Engine
) -> None:
    settings = make_settings(tmp_path / "home", context_budget_tokens=300, pin_first_turn=True)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant)
        manager.chat(tenant, sid, "word " * 230, max_new_tokens=4)  # turn 0 would eat the window
        assert manager.internals.metadata.get_session(tenant_id=tenant.id, session_id=sid).pinned_turns == ()
        assert manager.chat(tenant, sid, "hi", max_new_tokens=1).stats.restored_from == "device"
        manager.pin_turn(tenant, sid, 1)  # a short turn fits
        manager.chat(tenant, sid, "word " * 200, max_new_tokens=4)
        with pytest.raises(InvalidInput, match="leave less than"):
            manager.pin_turn(tenant, sid, 2)
        assert manager.internals.metadata.get_session(tenant_id=tenant.id, session_id=sid).pinned_turns == (1,)
        assert manager.chat(tenant, sid, "still usable?", max_new_tokens=2).stats.cache_tokens <= 300


def test_pin_checks_a_cache_that_is_not_on_the_device_too(tmp_path: Path, tiny_engine: Engine) -> None:
    with SessionManager(make_settings(tmp_path / "home", context_budget_tokens=120), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant)
        for turn in range(6):
            manager.chat(tenant, sid, f"message {turn} " + "x " * 10, max_new_tokens=8)
        manager.evict_session(tenant, sid, "host")
        with pytest.raises(InvalidInput, match="demoted"):
            manager.pin_turn(tenant, sid, 0)
        assert manager.internals.metadata.get_session(tenant_id=tenant.id, session_id=sid).pinned_turns == ()


@pytest.fixture(scope="module")
def phi3_partial_engine(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Engine:
    """A 2-layer Phi-3 with random weights whose RoPE turns only half of each 16-channel head."""
    path = tmp_path_factory.mktemp("phi3-partial-rotary")
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    config = Phi3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Engine(load_model(str(path), MODEL_CACHE, "cpu", "float32"))


@torch.inference_mode()
def fresh_kv(engine: Engine, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per model layer, the keys and values of a from-scratch prefill of `token_ids`."""
    cache = DynamicCache(config=engine.model.config)
    engine.model(input_ids=torch.tensor([token_ids]), cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_partial_rotary_model_keeps_chatting_through_the_window_with_exact_first_layer_keys(
    tmp_path: Path, phi3_partial_engine: Engine
) -> None:
    engine = phi3_partial_engine
    layout = engine.rope_layout
    assert layout is not None and (layout.rotary_dim, layout.head_dim, layout.interleaved) == (8, 16, False)
    with SessionManager(make_settings(tmp_path / "home", context_budget_tokens=120), engine=engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="Be brief.")
        key = manager.internals.tiers_key(tenant, sid)
        windowed = 0
        for turn in range(8):
            reply = manager.chat(tenant, sid, f"message {turn}", max_new_tokens=8)
            cache = manager.internals.tiers.peek(key)
            assert cache is not None and cache.base is not None and cache.total_tokens <= 120
            if not reply.stats.demoted_tokens:
                continue
            windowed += 1
            fresh = fresh_kv(engine, list(cache.token_ids))
            keys = [torch.cat([b, o], dim=-2) for b, o in zip(cache.base.keys, cache.own_keys, strict=True)]
            values = [torch.cat([b, o], dim=-2) for b, o in zip(cache.base.values, cache.own_values, strict=True)]
            # Model layer 0 sees each token alone, so its re-rotated keys are the model's own keys of
            # the window (measured: 2.4e-7) and its values never change.
            torch.testing.assert_close(keys[0], fresh[0][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values[0], fresh[0][1], atol=1e-5, rtol=1e-5)
            # Deeper layers were computed with the demoted turns in context and differ (measured:
            # 0.2 .. 0.3 here): StreamingLLM's trade-off, not a rotation error; the re-prefill path
            # is the exact one. README.md and docs/architecture.md claim no more than this.
            assert float((keys[1] - fresh[1][0]).abs().max()) > 1e-3
        assert windowed >= 3
