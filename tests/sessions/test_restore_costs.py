"""Restore or recompute: the cheaper path for a cache in a lower tier, from measured rates."""

from __future__ import annotations

from pathlib import Path

from sessions.engine import Engine
from sessions.turn.costs import MIN_SAMPLES, SAMPLES, RestoreCosts
from tests.sessions.offload_helpers import open_manager, reference_reply


def test_nothing_measured_restores_and_the_fits_decide_by_size() -> None:
    costs = RestoreCosts()
    assert costs.choose("disk", 1000).recompute is False
    assert costs.choose("disk", 1000).restore_s is None
    # A tier with a large fixed cost (a far Redis: 50 ms a restore) and a cheap per-token cost,
    # against a prefill of 0.2 ms a token: short sessions are prefilled again, long ones restored.
    for tokens in (100, 1000, 4000):
        costs.restored("redis", tokens, 0.050 + tokens * 0.00001)
        costs.prefilled(tokens, 0.001 + tokens * 0.0002)
    short, long = costs.choose("redis", 100), costs.choose("redis", 4000)
    assert short.recompute and not long.recompute
    assert round(short.restore_s or 0, 4) == 0.051 and round(short.recompute_s or 0, 4) == 0.021
    assert round(long.restore_s or 0, 3) == 0.09 and round(long.recompute_s or 0, 3) == 0.801
    assert costs.choose("disk", 100).restore_s is None  # tiers are measured apart


def test_a_turn_recomputes_when_that_is_cheaper_and_restores_when_not(tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "home", tiny_engine, restore_or_recompute=True) as manager:
        tenant = manager.create_tenant("acme").id
        sid = manager.open_session(tenant, "You are terse.")
        manager.chat(tenant, sid, "Hello there.", max_new_tokens=8)
        costs = manager.internals.runner.preparer.costs
        for _ in range(MIN_SAMPLES):  # a slow disk, a fast prefill
            costs.restored("disk", 100, 1.0)
            costs.prefilled(100, 0.01)
        manager.internals.tiers.flush()
        manager.evict_session(tenant, sid, "disk")
        expected = reference_reply(manager, tenant, sid, "And now?", 8)
        reply = manager.chat(tenant, sid, "And now?", max_new_tokens=8)
        stats = reply.stats
        assert (stats.restored_from, stats.restore_choice) == ("rebuilt", "recompute")
        assert stats.restore_estimate_s is not None and stats.recompute_estimate_s is not None
        assert stats.recompute_estimate_s < stats.restore_estimate_s
        assert reply.token_ids == expected
        for _ in range(3 * MIN_SAMPLES):  # now the disk is fast, the prefill slow
            costs.restored("disk", 100, 0.001)
        for _ in range(SAMPLES):  # a whole window of slow prefills replaces the fast ones
            costs.prefilled(100, 5.0)
        manager.internals.tiers.flush()
        manager.evict_session(tenant, sid, "disk")
        again = manager.chat(tenant, sid, "Once more.", max_new_tokens=8)
        assert (again.stats.restored_from, again.stats.restore_choice) == ("disk", "restore")
        counted = manager.internals.metrics.render().decode()
        assert 'chatkv_restore_choices_total{choice="recompute"} 1.0' in counted
        assert 'chatkv_restore_choices_total{choice="restore"} 1.0' in counted
