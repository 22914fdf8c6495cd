"""Issue 3 through `SessionManager`: byte budgets hold after every turn with exact LRU order, leased
sessions never move, tenant quotas, exact restores from host and disk, integrity failures fall back
to a correct rebuild, model fingerprints invalidate caches, and the key ring (rotation, deletion).

The tiny random model serves where the behaviour does not depend on the model; replies compared
token for token against a session that never left the device use the real model."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cache.tier_manager import LeaseHeld
from cache.tiers import LOCAL_TIERS, BlobRejected, Tier
from sessions.engine import Engine
from sessions.errors import SessionBusy, SessionNotFound
from sessions.manager import SessionManager
from sessions.model_source import load_model
from sessions.records import Reply
from sessions.turn.chat_template import PastTurn
from storage.keyring import parse_master_key
from tests.conftest import MODEL_CACHE
from tests.sessions.offload_helpers import (
    greedy_from_scratch,
    integrity_failures,
    key_of,
    new_turn_tokens,
    one_torch_thread,
    open_manager,
    reference_reply,
    restores,
)

SYSTEM = "You are terse."
TOKENS = 4  # max_new_tokens of the tiny-model turns: the random model never stops early
OTHER_MASTER_KEY = "b3RoZXItY2hhdGt2LW1hc3Rlci1rZXktMzItYnl0ZXM="  # base64 of 32 bytes, tests only


@dataclass(frozen=True)
class Sizes:
    """Bytes of the tiny model's caches after one turn of `note N` (measured, not assumed)."""

    base: int  # the shared system-prompt base layer on the device
    session: int  # a session's own tensors on the device
    blob: int  # its sealed blob (host or disk)
    base_blob: int  # the sealed base layer on disk


@pytest.fixture(scope="module")
def sizes(tmp_path_factory: pytest.TempPathFactory, tiny_engine: Engine) -> Sizes:
    home = tmp_path_factory.mktemp("probe") / "home"
    with open_manager(home, tiny_engine, persist="on_evict") as manager:
        tenant = manager.create_tenant("probe")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
        key = key_of(tenant.id, sid)
        base, session = manager.internals.tiers.pool.nbytes(), manager.internals.tiers.entry_bytes(key)
        manager.evict_session(tenant, sid, "host")
        blob = manager.internals.tiers.entry_bytes(key)
        base_blob = manager.internals.disk_store.used_bytes()
    return Sizes(base, session, blob, base_blob)


@pytest.fixture
def single_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def placements(manager: SessionManager, tenant_id: str, sids: Sequence[str]) -> list[str | None]:
    return [manager.session_info(tenant_id, sid).tier for sid in sids]


def assert_within_budgets(manager: SessionManager) -> None:
    usage = manager.internals.tiers.usage()
    for tier in LOCAL_TIERS:
        assert usage.bytes[tier] <= usage.budgets[tier], f"{tier} holds {usage.bytes[tier]} > {usage.budgets[tier]}"


# -- 1. budgets hold after every turn, in exact LRU order ---------------------------------------------


def test_budgets_hold_after_every_turn_and_evict_in_lru_order(
    tmp_path: Path, tiny_engine: Engine, sizes: Sizes
) -> None:
    manager = open_manager(
        tmp_path / "home",
        tiny_engine,
        persist="on_evict",
        device_budget_bytes=sizes.base + 2 * sizes.session + sizes.session // 2,  # base + 2 sessions
        host_budget_bytes=sizes.blob + sizes.blob // 2,  # 1 blob
        disk_budget_bytes=sizes.base_blob + 2 * sizes.blob + sizes.blob // 2,  # base + 2 blobs
    )
    with manager:
        tenant = manager.create_tenant("acme")
        sids = [manager.open_session(tenant, system_prompt=SYSTEM) for _ in range(4)]
        # A running turn reserves its working buffer (a copy of the base and the session's own
        # tokens, plus room for the new ones) against the device budget, so beside it the device
        # keeps no other idle session here: each turn moves the previous session down.
        expected = [
            ["device", None, None, None],
            ["host", "device", None, None],  # s0 made room for s1's turn
            ["disk", "host", "device", None],  # s1 down; the host holds one, so s0 on to disk
            ["disk", "disk", "host", "device"],
        ]
        for n, sid in enumerate(sids):
            reply = manager.chat(tenant, sid, f"note {n}", max_new_tokens=TOKENS)
            assert manager.internals.tiers.entry_bytes(key_of(tenant.id, sid)) in (sizes.session, sizes.blob)
            assert placements(manager, tenant.id, sids) == expected[n], f"after the turn of s{n}"
            assert_within_budgets(manager)
        assert reply.stats.restored_from == "new"

        # s0 comes back from disk (a bigger cache now): s3 leaves the device for the host, s2 goes
        # on to disk (the disk holds s1 and s2 once s0's blob is gone).
        expected_prefill = new_turn_tokens(manager, tenant.id, sids[0], "more 0")
        reply = manager.chat(tenant, sids[0], "more 0", max_new_tokens=TOKENS)
        assert (reply.stats.restored_from, reply.stats.prefill_tokens) == ("disk", expected_prefill)
        assert placements(manager, tenant.id, sids) == ["device", "disk", "disk", "host"]
        assert_within_budgets(manager)

        # s3 comes back from host: s0 goes down to host and on to disk, where the two oldest
        # blobs (s1, then s2) are dropped to make room.
        expected_prefill = new_turn_tokens(manager, tenant.id, sids[3], "more 3")
        reply = manager.chat(tenant, sids[3], "more 3", max_new_tokens=TOKENS)
        assert (reply.stats.restored_from, reply.stats.prefill_tokens) == ("host", expected_prefill)
        assert placements(manager, tenant.id, sids) == ["disk", None, None, "device"]
        assert_within_budgets(manager)

        # A dropped cache is rebuilt from the transcript, and the reply is the from-scratch one.
        expected_ids = reference_reply(manager, tenant.id, sids[1], "more 1", TOKENS)
        reply = manager.chat(tenant, sids[1], "more 1", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt"
        assert reply.token_ids == expected_ids
        assert_within_budgets(manager)
        assert len(manager.history(tenant, sids[1])) == 4


def test_disk_budget_holds_with_write_back(tmp_path: Path, tiny_engine: Engine, sizes: Sizes) -> None:
    """Write-back adds a disk copy after every turn; the disk tier stays within budget anyway."""
    budget = sizes.base_blob + 2 * sizes.blob + sizes.blob // 2
    with open_manager(tmp_path / "home", tiny_engine, persist="write_back", disk_budget_bytes=budget) as manager:
        tenant = manager.create_tenant("acme")
        sids = [manager.open_session(tenant, system_prompt=SYSTEM) for _ in range(4)]
        for n, sid in enumerate(sids):
            manager.chat(tenant, sid, f"note {n}", max_new_tokens=TOKENS)
            manager.internals.tiers.flush()
            assert manager.internals.disk_store.used_bytes() <= budget
        # The two most recent sessions keep their disk copies.
        rows = {r.name for r in manager.internals.metadata.list_blobs() if r.session_id}
        assert rows == set(sids[2:])


# -- 2. leased sessions are never moved --------------------------------------------------------------


def test_a_session_with_a_turn_in_flight_is_never_moved(tmp_path: Path, tiny_engine: Engine, sizes: Sizes) -> None:
    budget = sizes.base + sizes.session // 2  # not even one idle session fits on the device
    with open_manager(tmp_path / "home", tiny_engine, persist="on_evict", device_budget_bytes=budget) as manager:
        tenant = manager.create_tenant("acme")
        busy, other = (manager.open_session(tenant, system_prompt=SYSTEM) for _ in range(2))
        manager.chat(tenant, busy, "note 0", max_new_tokens=TOKENS)
        assert placements(manager, tenant.id, [busy]) == ["host"]

        started, resume = threading.Event(), threading.Event()
        outcome: list[Reply] = []

        def stream() -> None:
            for item in manager.stream_chat(tenant, busy, "more 0", max_new_tokens=8):
                if isinstance(item, Reply):
                    outcome.append(item)
                elif not started.is_set():
                    started.set()
                    resume.wait(timeout=60)

        thread = threading.Thread(target=stream)
        thread.start()
        try:
            assert started.wait(timeout=60)
            assert placements(manager, tenant.id, [busy]) == ["device"]  # restored for the turn
            manager.chat(tenant, other, "note 1", max_new_tokens=TOKENS)  # forces evictions
            assert placements(manager, tenant.id, [busy, other]) == ["device", "host"]
            with pytest.raises(SessionBusy):
                manager.evict_session(tenant, busy, "disk")
            with pytest.raises(SessionBusy):
                manager.chat(tenant, busy, "again", max_new_tokens=TOKENS)
            with pytest.raises(LeaseHeld), manager.internals.tiers.lease(key_of(tenant.id, busy)):
                pass
            with pytest.raises(LeaseHeld):
                manager.internals.tiers.evict(key_of(tenant.id, busy), None)
            manager.internals.tiers.enforce_budgets()
            manager.internals.tiers.persist_all()
            assert placements(manager, tenant.id, [busy]) == ["device"]
        finally:
            resume.set()
            thread.join(timeout=60)
        assert outcome and outcome[0].stats.restored_from == "host"
        assert placements(manager, tenant.id, [busy, other]) == ["host", "disk"]
        assert_within_budgets(manager)


# -- 3. per-tenant device quota ----------------------------------------------------------------------


def test_a_tenant_over_its_quota_evicts_its_own_sessions_never_another_tenants(
    tmp_path: Path, tiny_engine: Engine, sizes: Sizes
) -> None:
    quota = sizes.base + sizes.session + sizes.session // 2  # a base and one session
    with open_manager(
        tmp_path / "home", tiny_engine, persist="on_evict", device_budget_bytes=2**30, tenant_device_quota_bytes=quota
    ) as manager:
        other = manager.create_tenant("beta")
        theirs = manager.open_session(other, system_prompt=SYSTEM)
        manager.chat(other, theirs, "note 9", max_new_tokens=TOKENS)  # the least recently used of all
        tenant = manager.create_tenant("acme")
        ours = [manager.open_session(tenant, system_prompt=SYSTEM) for _ in range(3)]
        for n, sid in enumerate(ours):
            manager.chat(tenant, sid, f"note {n}", max_new_tokens=TOKENS)
        assert placements(manager, other.id, [theirs]) == ["device"]
        assert placements(manager, tenant.id, ours) == ["host", "host", "device"]
        assert manager.internals.tiers.usage().device_bytes_by_tenant == {
            tenant.id: sizes.base + sizes.session,
            other.id: sizes.base + sizes.session,
        }


# -- 4. restores are exact ---------------------------------------------------------------------------


def own_tensors(cache: object) -> list[torch.Tensor]:
    return [*cache.own_keys, *cache.own_values]  # type: ignore[attr-defined]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_restored_cache_tensors_are_bit_identical(tiny_manager: SessionManager, tier: str) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
    manager.chat(tenant, sid, "note 1", max_new_tokens=TOKENS)
    key = key_of(tenant.id, sid)
    offloaded = manager.internals.tiers.peek(key)
    assert offloaded is not None
    assert manager.evict_session(tenant, sid, tier) == tier
    stored = manager.internals.tiers.stored_cache(key)
    assert stored is not None
    with manager.internals.tiers.lease(key) as lease:
        restored = lease.restore()
    assert restored.source is Tier(tier) and restored.cache is not None
    for cache in (stored, restored.cache):
        assert cache.own_token_ids == offloaded.own_token_ids and cache.layers == offloaded.layers
        for a, b in zip(own_tensors(cache), own_tensors(offloaded), strict=True):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert restored.cache.base is not None and offloaded.base is not None
    for a, b in zip(restored.cache.base.keys, offloaded.base.keys, strict=True):
        assert torch.equal(a, b)
    assert manager.session_info(tenant, sid).tier == "device"


@pytest.mark.real_model
def test_replies_after_restore_from_host_and_disk_equal_a_session_that_never_left(
    real_manager: SessionManager, single_thread: None
) -> None:
    manager = real_manager
    tenant = manager.create_tenant("acme")
    system = "You are a helpful assistant. Answer briefly."
    moved, stayed = (manager.open_session(tenant, system_prompt=system) for _ in range(2))
    script = [
        ("What is the capital of France?", None),
        ("And of Germany?", "host"),
        ("Which of the two is bigger?", "disk"),
    ]
    for message, tier in script:
        if tier is not None:
            assert manager.evict_session(tenant, moved, tier) == tier
            expected_prefill = new_turn_tokens(manager, tenant.id, moved, message)
        before = restores(manager, tier) if tier else 0.0
        reply = manager.chat(tenant, moved, message, max_new_tokens=16)
        control = manager.chat(tenant, stayed, message, max_new_tokens=16)
        assert reply.token_ids == control.token_ids, f"{message!r} after restore from {tier}"
        if tier is not None:
            assert reply.stats.restored_from == tier
            assert control.stats.restored_from == "device"
            assert reply.stats.prefill_tokens == control.stats.prefill_tokens == expected_prefill
            assert reply.stats.reused_tokens == control.stats.reused_tokens
            assert reply.stats.restore_s > 0
            assert restores(manager, tier) == before + 1


# -- 5. integrity failures fall back to a correct rebuild --------------------------------------------


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.real_model
def test_tampered_truncated_and_swapped_blobs_are_rebuilt_with_correct_replies(
    real_manager: SessionManager, caplog: pytest.LogCaptureFixture, single_thread: None
) -> None:
    manager = real_manager
    system = "You are a helpful assistant. Answer briefly."
    acme, beta = manager.create_tenant("acme"), manager.create_tenant("beta")
    first, second = "Name a primary colour.", "Name another one."
    names = ("control", "flip", "cut", "swap", "cross")
    sids = {name: manager.open_session(acme, system_prompt=system) for name in names}
    foreign = manager.open_session(beta, system_prompt=system)
    for sid in sids.values():
        manager.chat(acme, sid, first, max_new_tokens=8)
    manager.chat(beta, foreign, "Name a planet.", max_new_tokens=8)
    for name in names[1:]:
        manager.evict_session(acme, sids[name], "disk")
    manager.evict_session(beta, foreign, "disk")
    manager.internals.tiers.flush()  # the control stays on the device; its write-back copy is on disk
    path = {name: manager.internals.disk_store.path_for(key_of(acme.id, sid)) for name, sid in sids.items()}
    flip_a_byte(path["flip"])
    truncate(path["cut"])
    shutil.copyfile(path["control"], path["swap"])  # another session's blob, same tenant
    shutil.copyfile(manager.internals.disk_store.path_for(key_of(beta.id, foreign)), path["cross"])  # another tenant's

    control = manager.chat(acme, sids["control"], second, max_new_tokens=16)
    assert control.stats.restored_from == "device"
    for name in ("flip", "cut", "swap", "cross"):
        caplog.clear()
        failures = integrity_failures(manager)
        with caplog.at_level(logging.WARNING):
            reply = manager.chat(acme, sids[name], second, max_new_tokens=16)
        assert reply.stats.restored_from == "rebuilt", name
        assert reply.token_ids == control.token_ids, name
        assert integrity_failures(manager) == failures + 1, name
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any(sids[name] in r.getMessage() for r in warnings), name
        # The bad blob is gone; the write-back stored the rebuilt cache in its place.
        manager.internals.tiers.flush()
        key = key_of(acme.id, sids[name])
        rebuilt = manager.internals.sealer.open_session(key, path[name].read_bytes())
        assert rebuilt.next_original_index == manager.session_info(acme, sids[name]).token_count


def test_a_wrong_master_key_after_restart_rebuilds(
    tmp_path: Path, tiny_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    with open_manager(home, tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
    with open_manager(home, tiny_engine, master_key=OTHER_MASTER_KEY) as manager:
        assert manager.session_info(tenant.id, sid).tier == "disk"
        expected = reference_reply(manager, tenant.id, sid, "note 1", TOKENS)
        with caplog.at_level(logging.WARNING):
            reply = manager.chat(tenant.id, sid, "note 1", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt"
        assert reply.token_ids == expected
        assert integrity_failures(manager) == 2  # the session's blob and its base layer's blob
        assert any(r.levelno == logging.WARNING and sid in r.getMessage() for r in caplog.records)
        # Its data key is unusable, so its caches are dropped instead of stored (with a warning).
        manager.evict_session(tenant.id, sid, "host")
        assert manager.session_info(tenant.id, sid).tier is None
        assert manager.chat(tenant.id, sid, "note 2", max_new_tokens=TOKENS).stats.restored_from == "rebuilt"
        # Later turns work too, and a new tenant under the new key offloads and restores normally.
        assert manager.chat(tenant.id, sid, "note 3", max_new_tokens=TOKENS).stats.restored_from == "device"
        fresh = manager.create_tenant("fresh")
        other = manager.open_session(fresh, system_prompt=SYSTEM)
        manager.chat(fresh, other, "note 0", max_new_tokens=TOKENS)
        manager.evict_session(fresh, other, "disk")
        assert manager.chat(fresh, other, "note 1", max_new_tokens=TOKENS).stats.restored_from == "disk"
    with open_manager(home, tiny_engine, master_key=OTHER_MASTER_KEY) as manager:
        assert manager.chat(fresh.id, other, "note 2", max_new_tokens=TOKENS).stats.restored_from == "disk"


def test_a_truncated_blob_found_at_start_up_is_rebuilt_with_a_warning(
    tmp_path: Path, tiny_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    with open_manager(home, tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
        path = manager.internals.disk_store.path_for(key_of(tenant.id, sid))
    truncate(path)
    with caplog.at_level(logging.WARNING), open_manager(home, tiny_engine) as manager:
        expected = reference_reply(manager, tenant.id, sid, "note 1", TOKENS)
        reply = manager.chat(tenant.id, sid, "note 1", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt"
        assert reply.token_ids == expected
        assert any(r.levelno == logging.WARNING and sid in r.getMessage() for r in caplog.records)
        assert integrity_failures(manager) == 1


# -- 8. another model invalidates stored caches ------------------------------------------------------


@pytest.fixture(scope="module")
def second_tiny_engine(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Engine:
    """The tiny model's architecture and tokenizer with other random weights."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-model-2")
    torch.manual_seed(1)
    LlamaForCausalLM(AutoConfig.from_pretrained(tiny_model_dir)).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return Engine(load_model(str(path), MODEL_CACHE, "cpu", "float32"))


def test_caches_of_another_model_are_invalidated_and_rebuilt(
    tmp_path: Path, tiny_engine: Engine, second_tiny_engine: Engine
) -> None:
    assert tiny_engine.fingerprint != second_tiny_engine.fingerprint
    home = tmp_path / "home"
    with open_manager(home, tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
        manager.chat(tenant, sid, "note 1", max_new_tokens=TOKENS)
    blob_files = sorted(p.name for p in (home / "blobs").rglob("*.ckv"))
    assert len(blob_files) == 2  # the session and its base layer
    with open_manager(home, second_tiny_engine) as manager:
        assert manager.session_info(tenant.id, sid).tier is None
        assert list((home / "blobs").rglob("*.ckv")) == []
        assert manager.internals.metadata.list_blobs() == []
        expected = reference_reply(manager, tenant.id, sid, "note 2", TOKENS)
        reply = manager.chat(tenant.id, sid, "note 2", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt"
        assert reply.token_ids == expected
        assert manager.session_info(tenant.id, sid).model_fingerprint == second_tiny_engine.fingerprint
    with open_manager(home, tiny_engine) as manager:  # and back: the other model's caches go too
        reply = manager.chat(tenant.id, sid, "note 3", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt"


# -- 9. the key ring ---------------------------------------------------------------------------------


def blob_bytes(home: Path) -> dict[str, bytes]:
    return {str(p.relative_to(home)): p.read_bytes() for p in sorted((home / "blobs").rglob("*.ckv"))}


@pytest.fixture
def file_keyed_home(tmp_path: Path, tiny_engine: Engine) -> Iterator[tuple[Path, str, str]]:
    """A home whose master key is a file, with one session (two turns) persisted on disk."""
    home = tmp_path / "home"
    with open_manager(home, tiny_engine, master_key=None) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
        manager.chat(tenant, sid, "note 1", max_new_tokens=TOKENS)
    yield home, tenant.id, sid


def test_the_master_key_file_is_created_with_mode_0600(file_keyed_home: tuple[Path, str, str]) -> None:
    home, _, _ = file_keyed_home
    assert stat.S_IMODE((home / "master.key").stat().st_mode) == 0o600
    assert len(parse_master_key((home / "master.key").read_text())) == 32


def test_rotation_rewraps_tenant_keys_without_touching_blobs(
    file_keyed_home: tuple[Path, str, str], tiny_engine: Engine
) -> None:
    home, tenant_id, sid = file_keyed_home
    blobs, old_key = blob_bytes(home), (home / "master.key").read_text()
    with open_manager(home, tiny_engine, master_key=None) as manager:
        old_wrapped = manager.internals.metadata.get_tenant(tenant_id=tenant_id).wrapped_data_key  # type: ignore[union-attr]
        new_id = manager.rotate_master_key()
        record = manager.internals.metadata.get_tenant(tenant_id=tenant_id)
        assert record is not None and record.master_key_id == new_id == manager.internals.keys.master.id
        assert record.wrapped_data_key != old_wrapped
        assert blob_bytes(home) == blobs
        # The running manager keeps working under the new key.
        assert manager.chat(tenant_id, sid, "note 2", max_new_tokens=TOKENS).stats.restored_from == "disk"
        manager.evict_session(tenant_id, sid, "disk")
        blobs = blob_bytes(home)
    assert (home / "master.key").read_text() != old_key
    assert stat.S_IMODE((home / "master.key").stat().st_mode) == 0o600
    assert not (home / "master.key.next").exists()
    with open_manager(home, tiny_engine, master_key=None) as manager:
        assert manager.internals.keys.master.id == new_id
        assert manager.chat(tenant_id, sid, "note 3", max_new_tokens=TOKENS).stats.restored_from == "disk"


class Crash(Exception):
    """Stands for the process dying at this point."""


@pytest.mark.parametrize("moment", ["before-commit", "after-commit"])
def test_a_crash_during_rotation_leaves_a_readable_state(
    file_keyed_home: tuple[Path, str, str], tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    home, tenant_id, sid = file_keyed_home
    blobs = blob_bytes(home)
    manager = open_manager(home, tiny_engine, master_key=None)
    old_id = manager.internals.keys.master.id
    if moment == "before-commit":

        def crash_commit(**_: object) -> None:
            assert (home / "master.key.next").exists()
            raise Crash

        monkeypatch.setattr(manager.internals.metadata, "set_tenant_keys", crash_commit)
    else:
        real_replace = Path.replace

        def crash_rename(self: Path, target: object) -> Path:
            if self.name == "master.key.next":
                raise Crash
            return real_replace(self, target)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "replace", crash_rename)
    with pytest.raises(Crash):
        manager.rotate_master_key()
    monkeypatch.undo()
    manager.internals.tiers.close()  # the process dies: nothing is persisted, the database is left as is
    manager.internals.database.dispose()
    assert (home / "master.key.next").exists()
    with open_manager(home, tiny_engine, master_key=None) as restarted:
        assert not (home / "master.key.next").exists()
        assert (restarted.internals.keys.master.id == old_id) == (moment == "before-commit")
        assert blob_bytes(home) == blobs
        reply = restarted.chat(tenant_id, sid, "note 2", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "disk"


def test_deleting_a_tenant_destroys_its_key_first_then_rows_and_files(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    doomed, kept = manager.create_tenant("doomed"), manager.create_tenant("kept")
    sid = manager.open_session(doomed, system_prompt=SYSTEM)
    survivor = manager.open_session(kept, system_prompt=SYSTEM)
    for tenant, session in ((doomed, sid), (kept, survivor)):
        manager.chat(tenant, session, "note 0", max_new_tokens=TOKENS)
        manager.evict_session(tenant, session, "disk")
    key = key_of(doomed.id, sid)
    copy = manager.internals.disk_store.path_for(key).read_bytes()  # a copy that survives somewhere
    assert manager.internals.sealer.open_session(key, copy).own_tokens > 0

    order: list[str] = []
    forget_tenant = manager.internals.tiers.forget_tenant

    def spy(tenant_id: str) -> None:
        record = manager.internals.metadata.get_tenant(tenant_id=tenant_id)
        order.append("key gone" if record is None or record.wrapped_data_key is None else "key present")
        forget_tenant(tenant_id)  # type: ignore[arg-type]

    manager.internals.tiers.forget_tenant = spy  # type: ignore[method-assign]
    manager.delete_tenant(doomed)
    assert order == ["key gone", "key gone"]  # before the rows go, and once more after (a racing turn)
    with pytest.raises(BlobRejected):
        manager.internals.sealer.open_session(key, copy)
    assert manager.internals.metadata.get_tenant(tenant_id=doomed.id) is None
    assert {r.tenant_id for r in manager.internals.metadata.list_blobs()} == {kept.id}
    assert not (manager.settings.blob_dir / doomed.id).exists()
    assert manager.chat(kept, survivor, "note 1", max_new_tokens=TOKENS).stats.restored_from == "disk"


# -- 10. nothing is written outside the home ---------------------------------------------------------


def test_a_whole_offload_cycle_writes_only_inside_the_home(tmp_path: Path, tiny_engine: Engine) -> None:
    home = tmp_path / "home"
    with open_manager(home, tiny_engine, master_key=None) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
        manager.evict_session(tenant, sid, "disk")
        manager.chat(tenant, sid, "note 1", max_new_tokens=TOKENS)
        manager.rotate_master_key()
    outside = [p for p in tmp_path.rglob("*") if not p.is_relative_to(home)]
    assert outside == []
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700


# -- stale copies, deletion and concurrency ----------------------------------------------------------


def test_a_disk_copy_older_than_the_transcript_is_not_used(tmp_path: Path, tiny_engine: Engine) -> None:
    """A crash after a turn returned but before its write-back landed leaves the previous turn's
    cache on disk; the next process sees it does not end where the transcript does and rebuilds."""
    home = tmp_path / "home"
    manager = open_manager(home, tiny_engine, persist="write_back")
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
    manager.internals.tiers.flush()
    manager.internals.tiers._writer.queue = lambda key: None  # type: ignore[method-assign]
    manager.chat(tenant, sid, "note 1", max_new_tokens=TOKENS)
    manager.internals.tiers.close()  # the process dies: no persist at shutdown
    manager.internals.database.dispose()
    with open_manager(home, tiny_engine, persist="write_back") as restarted:
        assert restarted.session_info(tenant.id, sid).tier == "disk"
        expected = reference_reply(restarted, tenant.id, sid, "note 2", TOKENS)
        reply = restarted.chat(tenant.id, sid, "note 2", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt"
        assert reply.token_ids == expected


def test_deleting_a_session_removes_its_blobs_even_during_a_turn(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    manager.chat(tenant, sid, "note 0", max_new_tokens=TOKENS)
    manager.evict_session(tenant, sid, "disk")
    stream = manager.stream_chat(tenant, sid, "note 1", max_new_tokens=8)
    assert isinstance(next(stream), str)  # the turn is in flight, its cache restored to the device
    manager.delete_session(tenant, sid)
    with pytest.raises(SessionNotFound):
        list(stream)
    assert manager.internals.tiers.placement(key_of(tenant.id, sid)) is None
    assert [r.name for r in manager.internals.metadata.list_blobs() if r.session_id] == []
    assert not manager.internals.disk_store.path_for(key_of(tenant.id, sid)).exists()
    assert all(manager.internals.tiers.pool.refs(key) == 0 for key, _, _ in manager.internals.tiers.pool.unreferenced())
    assert manager.internals.tiers.usage().sessions == {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}


def test_concurrent_turns_keep_budgets_and_exact_replies(tmp_path: Path, tiny_engine: Engine, sizes: Sizes) -> None:
    budgets = {
        "device_budget_bytes": sizes.base + 2 * sizes.session,
        "host_budget_bytes": 2 * sizes.blob,
        "disk_budget_bytes": sizes.base_blob + 4 * sizes.blob,
    }
    with open_manager(tmp_path / "home", tiny_engine, persist="write_back", **budgets) as manager:
        tenant = manager.create_tenant("acme")
        sids = [manager.open_session(tenant, system_prompt=SYSTEM) for _ in range(6)]
        errors: list[BaseException] = []

        def talk(mine: list[str]) -> None:
            try:
                for turn in range(3):
                    for sid in mine:
                        manager.chat(tenant, sid, f"note {turn}", max_new_tokens=TOKENS)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=talk, args=(sids[i::3],)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert errors == []
        manager.internals.tiers.flush()
        assert_within_budgets(manager)
        for sid in sids:
            history = manager.history(tenant, sid)
            assert len(history) == 6
            # Every reply is the one a full re-prefill of its conversation gives.
            for turn in range(3):
                past = [
                    PastTurn(history[2 * i].text, history[2 * i + 1].text, history[2 * i + 1].token_ids)
                    for i in range(turn)
                ]
                ids = manager.internals.template.conversation(SYSTEM, past, f"note {turn}").token_ids
                assert history[2 * turn + 1].token_ids == greedy_from_scratch(manager.internals.engine, ids, TOKENS)
