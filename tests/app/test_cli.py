"""The `chatkv` CLI through Typer's runner, working directly on a home: a tiny model loaded from its
directory by `CHATKV_MODEL`, real SQLite files, real encryption, and a real process holding the lock."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from typer.testing import CliRunner, Result

from app.cli import app
from app.cli.output import shown as shown_text
from cache.serialization import FORMAT_VERSION
from sessions import MAX_MESSAGE_CHARS
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.replicas.ownership import SessionOwnership
from storage.chunked_blobs import open_chunked, split_frame
from storage.database import head_revision, open_database, upgrade
from storage.home_lock import program_name
from storage.keyring import AuthenticationFailed, NoDataKey, blob_aad, parse_master_key
from storage.metadata_store import MetadataStore
from storage.replica_store import ReplicaStore
from storage.schema import SessionRow
from tests.app.server_process import free_port
from tests.conftest import MASTER_KEY, MODEL_CACHE, cli_environment, make_settings


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def cli_env(home: Path, tiny_model_dir: Path) -> dict[str, str | None]:
    """The CLI's environment: the tiny model, the test master key, nothing inherited from `CHATKV_*`."""
    return cli_environment(
        CHATKV_HOME=str(home),
        CHATKV_MODEL=str(tiny_model_dir),
        CHATKV_MODEL_CACHE_DIR=str(MODEL_CACHE),
        CHATKV_MASTER_KEY=MASTER_KEY,
    )


class Cli:
    def __init__(self, env: dict[str, str | None]) -> None:
        self.env = env

    def __call__(self, *args: str, input: str | None = None, **env: str | None) -> Result:
        return CliRunner().invoke(app, list(args), input=input, env={**self.env, **env})

    def ok(self, *args: str, input: str | None = None) -> Result:
        result = self(*args, input=input)
        assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "--json").stdout)


@pytest.fixture
def cli(cli_env: dict[str, str | None]) -> Cli:
    return Cli(cli_env)


def _populate(home: Path, engine: Engine, *tenants: str, turns: int = 2) -> dict[str, str]:
    """One session with `turns` turns per tenant, made by a manager that then closes (the caches are
    persisted to disk, as after a server's shutdown). Returns tenant name -> session id."""
    sessions: dict[str, str] = {}
    with SessionManager(make_settings(home), engine=engine) as manager:
        for name in tenants:
            tenant = manager.create_tenant(name)
            sid = manager.open_session(tenant, system_prompt="You are terse.")
            for turn in range(turns):
                manager.chat(tenant, sid, f"Message {turn} from {name}", max_new_tokens=6)
            sessions[name] = sid
    return sessions


def assert_one_line_error(result: Result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


# -- tenants -----------------------------------------------------------------------------------


def test_tenants_create_list_show_and_rotate_api_key(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    created = cli.json("tenants", "create", "acme")
    assert created["name"] == "acme" and created["id"].startswith("tn_")
    key = created["api_key"]
    plain = cli.ok("tenants", "create", "globex").stdout
    assert "api key" in plain and "ckv_tn_" in plain

    listed = cli.json("tenants", "list")
    assert [(t["name"], t["sessions"], t["has_api_key"]) for t in listed] == [("acme", 0, True), ("globex", 0, True)]
    shown = cli.json("tenants", "show", created["id"])  # by id as well as by name
    assert shown["name"] == "acme" and shown["sessions_by_tier"] == {"device": 0, "host": 0, "disk": 0}

    rotated = cli.json("tenants", "rotate-api-key", "acme")
    assert rotated["api_key"] != key
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        assert manager.tenant_for_api_key(rotated["api_key"]).name == "acme"
        with pytest.raises(Exception, match="tenant not found"):
            manager.tenant_for_api_key(key)


def test_tenants_delete_asks_unless_yes(cli: Cli) -> None:
    cli.ok("tenants", "create", "acme")
    declined = cli("tenants", "delete", "acme", input="n\n")
    assert declined.exit_code == 1 and "Delete tenant acme" in declined.stdout and "0 sessions" in declined.stdout
    assert declined.stderr == "cancelled\n"
    no_answer = cli("tenants", "delete", "acme")  # end of input at the prompt
    assert (no_answer.exit_code, no_answer.stderr.splitlines()[-1]) == (1, "cancelled")
    assert [t["name"] for t in cli.json("tenants", "list")] == ["acme"]
    cli.ok("tenants", "delete", "acme", input="y\n")
    cli.ok("tenants", "create", "globex")
    assert "deleted tenant globex" in cli.ok("tenants", "delete", "globex", "--yes").stdout
    assert cli.json("tenants", "list") == []


def test_tenants_delete_leaves_no_readable_blob(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sessions = _populate(home, tiny_engine, "acme", "globex")
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        acme, globex = manager.get_tenant("acme").id, manager.get_tenant("globex").id
        acme_key, globex_key = manager.internals.keys.data_key(acme), manager.internals.keys.data_key(globex)
        wrapped = manager.internals.metadata.get_tenant(tenant_id=acme)
        assert wrapped is not None and wrapped.wrapped_data_key is not None
        fingerprint = manager.internals.engine.fingerprint
    blob_path = home / "blobs" / acme / f"{sessions['acme']}.ckv"
    surviving = home.parent / "surviving.ckv"  # what a backup or an undeleted disk sector would keep
    shutil.copy(blob_path, surviving)
    blob = surviving.read_bytes()
    aad = blob_aad(acme, sessions["acme"], fingerprint, FORMAT_VERSION)
    # Readable while the tenant's data key exists.
    assert open_chunked(acme_key, *split_frame(blob), [aad], max_payload_bytes=len(blob))

    cli.ok("tenants", "delete", "acme", "--yes")

    assert not (home / "blobs" / acme).exists()
    database_bytes = b"".join(path.read_bytes() for path in home.glob("chatkv.db*"))  # WAL included
    assert wrapped.wrapped_data_key not in database_bytes
    metadata = MetadataStore(open_database(f"sqlite:///{home / 'chatkv.db'}"))
    assert metadata.get_tenant(tenant_id=acme) is None
    assert {b.tenant_id for b in metadata.list_blobs()} == {globex}
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        with pytest.raises(NoDataKey):
            manager.internals.keys.data_key(acme)  # the wrapped key is gone from the database
        assert manager.internals.keys.data_key(globex) == globex_key  # the other tenant is untouched
    for key in (parse_master_key(MASTER_KEY), globex_key):  # every key the system still has
        with pytest.raises(AuthenticationFailed):
            open_chunked(key, *split_frame(blob), [aad], max_payload_bytes=len(blob))
    metadata.database.dispose()


# -- sessions ----------------------------------------------------------------------------------


def test_sessions_list_filters_and_json(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sessions = _populate(home, tiny_engine, "acme", "globex")
    listed = cli.json("sessions", "list")
    assert {s["id"]: (s["tenant"], s["tier"], s["message_count"]) for s in listed} == {
        sessions["acme"]: ("acme", "disk", 4),
        sessions["globex"]: ("globex", "disk", 4),
    }
    assert [s["id"] for s in cli.json("sessions", "list", "--tenant", "acme")] == [sessions["acme"]]
    assert cli.json("sessions", "list", "--tier", "device") == []
    assert len(cli.json("sessions", "list", "--tier", "disk")) == 2
    assert cli.json("sessions", "list", "--idle-for", "1h") == []
    assert len(cli.json("sessions", "list", "--idle-for", "0")) == 2
    table = cli.ok("sessions", "list").stdout
    assert sessions["acme"] in table and sessions["globex"] in table  # ids are never truncated


def test_sessions_inspect_show_and_export(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sid = _populate(home, tiny_engine, "acme")["acme"]
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        history = manager.history("acme", sid)
        token_count = manager.session_info("acme", sid).token_count

    detail = cli.json("sessions", "inspect", sid, "--tenant", "acme")
    assert detail["session"]["tier"] == "disk"
    # One mapper of a session to JSON: inspect adds when it expires to what list says of it.
    [listed] = cli.json("sessions", "list", "--tenant", "acme")
    assert detail["session"] == listed | {"expires_at": None}
    assert detail["transcript"]["turns"] == 2 and detail["transcript"]["messages"] == 4
    assert detail["model_fingerprint"] == tiny_engine.fingerprint and detail["model_fingerprint_matches"]
    assert detail["last_ttft_s"] > 0
    layers = detail["layers"]
    assert [(row["kind"], row["turn_index"]) for row in layers] == [("base", None), ("turn", 0), ("turn", 1)]
    assert layers[0]["tokens"] == detail["base_tokens"] > 0
    assert sum(row["tokens"] for row in layers) <= token_count
    assert layers[0]["shared"] and layers[0]["tier"] is None
    assert all(row["tier"] == "disk" and row["precision"] == "exact" for row in layers[1:])
    assert sum(row["bytes"] for row in layers[1:]) <= detail["cache_bytes"]
    for before, after in itertools.pairwise(layers):  # contiguous positions
        assert before["positions"][1] == after["positions"][0]
    plain = cli.ok("sessions", "inspect", sid, "--tenant", "acme").stdout
    assert "shared pool" in plain and "fingerprint" in plain
    # Half-open ranges: [0, b) then [b, ...) do not read as overlapping.
    base_end = layers[0]["positions"][1]
    assert f"[0, {base_end})" in plain and f"[{base_end}, {layers[1]['positions'][1]})" in plain
    assert "2 (4 messages)" in plain
    assert re.search(rf"^context tokens +{detail['session']['token_count']} *$", plain, re.MULTILINE), plain

    exported = json.loads(cli.ok("sessions", "export", sid, "--tenant", "acme").stdout)
    assert exported["system_prompt"] == "You are terse."
    assert [(m["role"], m["text"], tuple(m["token_ids"])) for m in exported["messages"]] == [
        (m.role, m.text, m.token_ids) for m in history
    ]


def test_inspect_shows_the_spread_of_per_head_budgets(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    """Under per-head budgets the table's counts are means over the KV heads; inspect gives their spread."""
    settings = make_settings(home, context_budget_tokens=200, window_policy="attention", window_recent_tokens=24)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="You are terse.")
        for turn in range(8):
            manager.chat(tenant, sid, f"note {turn}: the parcel number is {1000 + 37 * turn}", max_new_tokens=8)
    detail = cli.json("sessions", "inspect", sid, "--tenant", "acme")
    held = detail["held_per_kv_head"]
    assert held is not None and held["min"] < held["max"]
    assert sum(row.get("evicted", 0) for row in detail["layers"]) > 0
    plain = cli.ok("sessions", "inspect", sid, "--tenant", "acme").stdout
    assert re.search(rf"^held per KV head +{held['min']} to {held['max']} own tokens", plain, re.MULTILINE), plain
    rectangular = _populate(home, tiny_engine, "globex")["globex"]
    assert cli.json("sessions", "inspect", rectangular, "--tenant", "globex")["held_per_kv_head"] is None


def test_evict_drop_and_delete(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sid = _populate(home, tiny_engine, "acme")["acme"]
    refused = cli("sessions", "evict", sid, "--tenant", "acme", "--to", "host")
    assert "cannot evict from disk up to host" in assert_one_line_error(refused)
    assert cli.ok("sessions", "evict", sid, "--tenant", "acme", "--to", "drop").stdout == f"{sid}: dropped\n"
    assert [s["tier"] for s in cli.json("sessions", "list")] == [None]
    assert not list((home / "blobs").rglob(f"{sid}.ckv"))
    nothing = cli.ok("sessions", "evict", sid, "--tenant", "acme", "--to", "disk").stdout
    assert nothing == f"{sid}: no cache stored here; the next turn rebuilds it from the transcript\n"
    declined = cli("sessions", "delete", sid, "--tenant", "acme", input="n\n")
    assert declined.exit_code == 1 and declined.stderr == "cancelled\n"
    assert f"Delete session {sid} of tenant acme, 2 turns, for good?" in declined.stdout
    assert len(cli.json("sessions", "list")) == 1
    assert cli.ok("sessions", "delete", sid, "--tenant", "acme", input="y\n").stdout.endswith(
        f"deleted session {sid}\n"
    )
    assert cli.json("sessions", "list") == []
    assert_one_line_error(cli("sessions", "export", sid, "--tenant", "acme"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("sessions", "inspect", "s_missing", "--tenant", "acme"), "error: session not found: s_missing"),
        (("sessions", "export", "s_missing", "--tenant", "acme"), "error: session not found: s_missing"),
        (("sessions", "evict", "s_missing", "--tenant", "acme", "--to", "disk"), "error: session not found"),
        (("sessions", "delete", "s_missing", "--tenant", "acme"), "error: session not found: s_missing"),
        (("sessions", "delete", "s_missing", "--tenant", "acme", "--yes"), "error: session not found: s_missing"),
        (("sessions", "inspect", "s_x", "--tenant", "nobody"), "error: tenant not found: nobody"),
        (("tenants", "show", "nobody"), "error: tenant not found: nobody"),
        (("tenants", "delete", "nobody", "--yes"), "error: tenant not found: nobody"),
        (("tenants", "create", "bad name!"), "error: invalid tenant name"),
        (("tenants", "create", "acme"), "error: tenant exists: acme"),
        (("sessions", "evict", "s_x", "--tenant", "acme", "--to", "nowhere"), "error: --to must be host, disk or drop"),
        (("sessions", "list", "--tier", "cloud"), "error: --tier must be device, host or disk"),
        (("sessions", "list", "--idle-for", "3 weeks"), "error: Invalid value for '--idle-for': not a duration"),
        (("sessions", "inspect", "s_x"), "error: Missing option '--tenant'"),
        (("sessions", "list", "--bogus"), "error: No such option: --bogus"),
        (("frobnicate",), "error: No such command 'frobnicate'"),
        (("serve", "--port", "0"), "error: Invalid value for '--port'"),
        (("keys", "rotate-master"), "error: the master key comes from CHATKV_MASTER_KEY"),
        (("keys", "rotate-master", "--new-key", "c2hvcnQ="), "error: the master key must be 32 bytes"),
        (
            ("sessions", "list", "--idle-for", "99999999999d"),
            "error: Invalid value for '--idle-for': duration too long",
        ),
        (("tenants", "show", "a\udcff"), "error: "),
        (("sessions", "export", "a\udcff", "--tenant", "acme"), "error: "),
        (("sessions", "list", "--tenant", "a\udcff"), "error: "),
    ],
)
def test_bad_input_exits_2_with_one_line(cli: Cli, args: tuple[str, ...], message: str) -> None:
    cli.ok("tenants", "create", "acme")
    assert assert_one_line_error(cli(*args)).startswith(message)


def test_another_tenants_session_is_not_found(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sessions = _populate(home, tiny_engine, "acme", "globex", turns=1)
    theirs, missing = sessions["globex"], "s_" + "0" * 24
    for command in (("inspect",), ("export",), ("evict", "--to", "drop"), ("delete", "--yes")):
        for sid in (theirs, missing):
            result = cli("sessions", command[0], sid, "--tenant", "acme", *command[1:])
            assert assert_one_line_error(result) == f"error: session not found: {sid}"
    assert [s["message_count"] for s in cli.json("sessions", "list", "--tenant", "globex")] == [2]


def test_bad_settings_exit_2(cli: Cli) -> None:
    result = cli("tenants", "list", CHATKV_HOST_BUDGET_BYTES="lots")
    assert "CHATKV_HOST_BUDGET_BYTES" in assert_one_line_error(result)
    assert "device must be" in assert_one_line_error(cli("tenants", "create", "x", CHATKV_DEVICE="foo"))
    assert "not a database URL" in assert_one_line_error(cli("tenants", "list", CHATKV_DATABASE_URL="notaurl"))
    assert "SQLite or PostgreSQL" in assert_one_line_error(cli("tenants", "list", CHATKV_DATABASE_URL="mysql://u@h/db"))
    # A PostgreSQL driver that is not installed: the line says which one chatkv uses and how to get it.
    missing = assert_one_line_error(cli("tenants", "list", CHATKV_DATABASE_URL="postgresql+pg8000://u@h/db"))
    assert "'postgresql+pg8000'" in missing and "pip install -e '.[postgres]'" in missing
    assert "too long" in assert_one_line_error(cli("gc", "--dry-run", CHATKV_SESSION_RETENTION_S="99999999999d"))


def test_replica_start_up_failures_exit_with_one_line(
    cli: Cli, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """An unreachable Redis Cluster (its slot map is read at start-up) exits 1; a replica id that a
    live process heartbeats under exits 2 after one lease of waiting."""
    closed = f"redis://127.0.0.1:{free_port()}/0"
    message = assert_one_line_error(
        cli("tenants", "create", "acme", CHATKV_REDIS_URL=closed, CHATKV_REDIS_CLUSTER="1"), code=1
    )
    assert message.startswith("error: redis: Redis Cluster at") and "does not answer" in message
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    engine = open_database(url)
    upgrade(url, engine)
    live = SessionOwnership(
        ReplicaStore(engine),
        replica_id="r_dup",
        url="http://elsewhere:7860",
        lease_s=1.0,
        wait_s=0.0,
        idle_s=60.0,
        publish=lambda key: True,
        invalidate=lambda key: None,
        cache_bytes=lambda: 0,
    )
    live.start()
    try:
        duplicate = cli(
            "tenants",
            "create",
            "acme",
            CHATKV_DATABASE_URL=url,
            CHATKV_REDIS_URL=redis_url,
            CHATKV_REDIS_PREFIX=redis_prefix,
            CHATKV_REPLICA_ID="r_dup",
            CHATKV_OWNERSHIP_LEASE_S="1",
        )
        assert "replica id r_dup is in use by a live process" in assert_one_line_error(duplicate, code=2)
        copied = tmp_path / "copied-home"  # a copy of the live replica's home: its replica.id too
        copied.mkdir()
        (copied / "replica.id").write_text("r_dup\n")
        from_file = cli(
            "tenants",
            "create",
            "acme",
            CHATKV_HOME=str(copied),
            CHATKV_DATABASE_URL=url,
            CHATKV_REDIS_URL=redis_url,
            CHATKV_REDIS_PREFIX=redis_prefix,
            CHATKV_OWNERSHIP_LEASE_S="1",
        )
        message = assert_one_line_error(from_file, code=2)
        assert "looks copied" in message and "delete that file" in message and str(copied / "replica.id") in message
    finally:
        live.close()
        engine.dispose()


def test_a_home_without_the_deployments_master_key_is_refused_not_given_a_new_one(cli: Cli, tmp_path: Path) -> None:
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    assert cli("tenants", "create", "acme", CHATKV_DATABASE_URL=shared).exit_code == 0
    other_home = tmp_path / "other-home"
    refused = cli(
        "tenants", "create", "beta", CHATKV_DATABASE_URL=shared, CHATKV_HOME=str(other_home), CHATKV_MASTER_KEY=None
    )
    message = assert_one_line_error(refused)
    assert "no master key" in message and "set CHATKV_MASTER_KEY" in message
    assert not (other_home / "master.key").exists()  # no key made that would wrap beta's data key alone
    listed = cli("tenants", "list", "--json", CHATKV_DATABASE_URL=shared, CHATKV_HOME=str(other_home))
    assert listed.exit_code == 0 and "beta" not in listed.stdout and "acme" in listed.stdout


def test_missing_model_is_bad_input_exit_2(cli: Cli, tmp_path: Path) -> None:
    cli.ok("tenants", "list")  # needs no model
    assert_one_line_error(cli("tenants", "create", "acme", CHATKV_MODEL=str(tmp_path / "no-model")), code=2)


def test_serve_refuses_a_model_whose_cache_it_cannot_reuse_in_one_line_exit_2(
    cli: Cli, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    path = tmp_path / "mla-model"
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    refused = cli("serve", "--model", str(path), "--port", str(free_port()), "--log-level", "error")
    message = assert_one_line_error(refused, code=2)
    assert message == (
        "error: unsupported model: latent-compressed KV caches (MLA, kv_lora_rank) are not supported "
        '(see "Supported models" in the README)'
    )


# -- operations --------------------------------------------------------------------------------


def test_sessions_show_prints_the_conversation(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sid = _populate(home, tiny_engine, "acme")["acme"]
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        history = manager.history("acme", sid)
    assert [m.role for m in history] == ["user", "assistant", "user", "assistant"]

    plain = cli.ok("sessions", "show", sid, "--tenant", "acme").stdout
    expected = f"session {sid} (tenant acme), 2 turns, cache disk\n\n[system]\nYou are terse.\n" + "".join(
        f"\n[{m.role} · {m.created_at:%Y-%m-%d %H:%M:%S}]\n{shown_text(m.text, lines=True)}\n" for m in history
    )
    assert plain == expected

    shown = cli.json("sessions", "show", sid, "--tenant", "acme")
    assert shown["session"]["id"] == sid and shown["system_prompt"] == "You are terse."
    assert [(m["index"], m["role"], m["text"]) for m in shown["messages"]] == [
        (i, m.role, m.text) for i, m in enumerate(history)
    ]
    assert all("token_ids" not in m for m in shown["messages"])  # `sessions export` has them

    cli.ok("tenants", "create", "globex")
    assert (
        assert_one_line_error(cli("sessions", "show", sid, "--tenant", "globex")) == f"error: session not found: {sid}"
    )
    assert_one_line_error(cli("sessions", "show", "s_missing", "--tenant", "acme"))


def test_sessions_show_and_list_print_terminal_escapes_as_text(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, title="evil\x1b]0;pwned\x07\n[assistant]", system_prompt="Be\x1b[2J brief.")
        manager.chat(tenant, sid, "hi\x1b[31m\nthere", max_new_tokens=2)
    plain = cli.ok("sessions", "show", sid, "--tenant", "acme").stdout
    listed = cli.ok("sessions", "list").stdout
    assert "\x1b" not in plain + listed and "\x07" not in plain + listed
    assert "title: evil\\x1b]0;pwned\\x07\\x0a[assistant]\n" in plain  # one line: no forged block
    assert "\n[system]\nBe\\x1b[2J brief.\n" in plain
    assert "]\nhi\\x1b[31m\nthere\n" in plain  # a message keeps its line breaks
    assert "evil\\x1b]0;pwned" in listed


def test_stats_and_master_key_rotation(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sid = _populate(home, tiny_engine, "acme", turns=1)["acme"]
    # Offline: the tiers as stored, no turn counters (they live in a server process), no model loaded.
    no_model = {"CHATKV_MODEL": str(home / "no-model")}
    stats = json.loads(cli("stats", "--json", **no_model).stdout)
    assert stats["tenants"] == 1 and stats["sessions"] == 1
    assert stats["tiers"]["disk"]["sessions"] == 1 and stats["tiers"]["device"]["sessions"] == 0
    assert stats["tiers"]["disk"]["bytes"] == sum(p.stat().st_size for p in (home / "blobs").rglob("*.ckv"))
    assert stats["live"] is False and "prefill_tokens" not in stats and "cache_hit_rate_tokens" not in stats
    plain = cli("stats", **no_model)
    assert plain.exit_code == 0, plain.stderr
    assert "cache hit rate" not in plain.stdout and "evictions" not in plain.stdout
    assert plain.stdout.endswith("note: turn counters are kept by the running server (use --server)\n")
    # The model it would use, named without loading it: the configured directory, or the bundled one.
    assert re.search(rf"^model +{re.escape(str(home / 'no-model'))}$", plain.stdout, re.MULTILINE), plain.stdout
    bundled = json.loads(cli("stats", "--json", CHATKV_MODEL="default").stdout)
    assert bundled["model"] == "SmolLM2-135M-Instruct (bundled)"

    new_key = "bmV3LW1hc3Rlci1rZXktZm9yLXRoZS10ZXN0cy0zMiE="
    rotated = cli.ok("keys", "rotate-master", "--new-key", new_key).stdout
    assert "set CHATKV_MASTER_KEY to the new key" in rotated
    detail = json.loads(cli("sessions", "inspect", sid, "--tenant", "acme", "--json", CHATKV_MASTER_KEY=new_key).stdout)
    assert detail["session"]["tier"] == "disk" and len(detail["layers"]) == 2  # the blob still opens


def test_gc_deletes_sessions_past_retention(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    sessions = _populate(home, tiny_engine, "acme", "globex", turns=1)
    old = sessions["acme"]
    engine = open_database(f"sqlite:///{home / 'chatkv.db'}")
    with engine.begin() as db:
        db.execute(
            update(SessionRow).where(SessionRow.id == old).values(last_active_at=datetime.now(UTC) - timedelta(days=40))
        )
    engine.dispose()
    assert "no retention set" in cli.ok("gc").stdout

    retention = {"CHATKV_SESSION_RETENTION_S": "30d"}
    dry = json.loads(cli("gc", "--dry-run", "--json", **retention).stdout)
    assert dry["dry_run"] and [s["id"] for s in dry["expired_sessions"]] == [old]
    assert len(cli.json("sessions", "list")) == 2
    report = cli("gc", **retention)
    assert report.exit_code == 0 and "removed 1 session idle longer than 30d" in report.stdout
    assert [s["id"] for s in cli.json("sessions", "list")] == [sessions["globex"]]
    assert not list((home / "blobs").rglob(f"{old}.ckv"))


def test_db_upgrade_and_current(cli: Cli) -> None:
    head = head_revision()
    assert cli.ok("db", "current").stdout == f"empty (head is {head}: run `chatkv db upgrade`)\n"
    assert cli.ok("db", "upgrade").stdout == f"database at revision {head} (head)\n"
    assert cli.ok("db", "current").stdout == f"{head} (head)\n"
    bad = cli("db", "current", CHATKV_DATABASE_URL="not a url")
    assert "CHATKV_DATABASE_URL" in assert_one_line_error(bad)


def test_home_option_overrides_the_environment(cli: Cli, tmp_path: Path) -> None:
    other = tmp_path / "other-home"
    cli.ok("--home", str(other), "tenants", "create", "acme")
    assert [t["name"] for t in cli.json("--home", str(other), "tenants", "list")] == ["acme"]
    assert cli.json("tenants", "list") == []


# -- chat --------------------------------------------------------------------------------------


def test_chat_repl_streams_and_reports_reuse(cli: Cli) -> None:
    cli.ok("tenants", "create", "acme")
    result = cli.ok(
        "chat", "--tenant", "acme", "--system", "Be brief.", "--max-new-tokens", "5", input="Hello\n\nAgain\n/quit\n"
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "new session: your first message starts it"
    [made] = [line for line in lines if line.endswith("(new)")]  # once its first reply is stored
    assert made.startswith("session s_")
    stats = [line for line in lines if line.startswith("ttft ")]
    assert len(stats) == 2
    assert "reused 0 | new session |" in stats[0]
    assert "| cache from device |" in stats[1] and "reused 0 |" not in stats[1]
    sid = made.split()[1]
    [session] = cli.json("sessions", "list")
    assert session["id"] == sid and session["message_count"] == 4
    assert (session["origin"], session["title"]) == ("explicit", None)  # kept until deleted, as before
    assert cli.json("sessions", "show", sid, "--tenant", "acme")["system_prompt"] == "Be brief."

    resumed = cli.ok("chat", "--tenant", "acme", "--session", sid, "--max-new-tokens", "3", input="More\n")
    assert resumed.stdout.startswith(f"session {sid}: 2 turns, cache disk\n")
    assert re.search(r"\| cache from disk, restored in \d+ ms \|", resumed.stdout), resumed.stdout


def test_chat_left_without_a_message_leaves_no_session(cli: Cli) -> None:
    cli.ok("tenants", "create", "acme")
    result = cli.ok("chat", "--tenant", "acme", input="\n/quit\n")
    assert "session s_" not in result.stdout
    assert cli.json("sessions", "list") == []


def test_chat_a_refused_first_message_leaves_no_session(cli: Cli) -> None:
    """The first message's turn makes the session (`TurnTarget(new_session=True)`): a message the
    turn refuses leaves nothing stored, and the REPL goes on."""
    cli.ok("tenants", "create", "acme")
    result = cli.ok("chat", "--tenant", "acme", "--max-new-tokens", "100000", input="Hello\n")
    assert "error: reply too long for the context" in result.stderr
    assert cli.json("sessions", "list") == []


def test_chat_with_a_system_prompt_over_the_context_exits_at_the_first_message(cli: Cli) -> None:
    """Every message would be refused for the same --system, so the first refusal ends the command
    (exit 2, one line) instead of the REPL asking again; nothing is stored."""
    cli.ok("tenants", "create", "acme")
    result = cli("chat", "--tenant", "acme", "--system", "word " * 6000, input="Hello\nAgain\n")
    assert assert_one_line_error(result).startswith("error: system prompt too long")
    assert "you> " in result.stdout and result.stdout.count("you> ") == 1
    assert cli.json("sessions", "list") == []


@pytest.mark.parametrize(
    ("system", "says"),
    [
        ("caf\udce9", "--system is not valid Unicode text"),  # a Latin-1 byte in argv, as Python decodes it
        ("x" * (MAX_MESSAGE_CHARS + 1), f"--system longer than {MAX_MESSAGE_CHARS:,} characters"),
    ],
    ids=["not utf-8", "over the message limit"],
)
def test_chat_with_a_system_prompt_that_cannot_be_stored_exits_before_the_first_message(
    cli: Cli, system: str, says: str
) -> None:
    """The new session would refuse it at every message, each refusal blaming nothing the user
    typed: refused at once (exit 2, one line), before the model loads or the REPL asks."""
    cli.ok("tenants", "create", "acme")
    result = cli("chat", "--tenant", "acme", "--system", system, input="Hello\nAgain\n")
    assert assert_one_line_error(result).startswith(f"error: {says}")
    assert "you> " not in result.stdout
    assert cli.json("sessions", "list") == []


def test_chat_refuses_a_typed_message_that_is_not_utf8_and_goes_on_under_a_strict_utf8_locale(
    cli: Cli, cli_env: dict[str, str | None]
) -> None:
    """A real process with stdin decoded strictly (as under en_US.UTF-8, outside Python's UTF-8
    mode): a pasted Latin-1 line is that message's error, not the end of the command."""
    cli.ok("tenants", "create", "acme")
    env = {name: value for name, value in {**os.environ, **cli_env}.items() if value is not None}
    env.update(PYTHONIOENCODING="utf-8:strict", PYTHONUTF8="0", PYTHONPATH=os.getcwd())
    command = [sys.executable, "-c", "from app.cli import main; main()", "chat", "--tenant", "acme"]
    done = subprocess.run(
        [*command, "--max-new-tokens", "3"], input=b"caf\xe9\nHello\n", capture_output=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.decode().splitlines() == [
        "error: message is not valid Unicode text (it contains a lone surrogate)"
    ]
    assert done.stdout.count(b"you> ") == 3 and b"(new)" in done.stdout
    assert [s["message_count"] for s in cli.json("sessions", "list")] == [2]


def test_chat_bad_input(cli: Cli) -> None:
    assert_one_line_error(cli("chat", "--tenant", "nobody", input="hi\n"))
    cli.ok("tenants", "create", "acme")
    assert_one_line_error(cli("chat", "--tenant", "acme", "--session", "s_missing", input="hi\n"))
    assert_one_line_error(cli("chat", "--tenant", "acme", "--max-new-tokens", "0"))


# -- a live server holds the home ----------------------------------------------------------------


@contextmanager
def _held(home: Path, url: str | None) -> Iterator[int]:
    """Another process holding the home's lock: as `chatkv serve` does (with its `url`), or as a
    process with an embedded `SessionManager` does (`None`). Yields its pid."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from storage.home_lock import HomeLock\n"
        "with HomeLock(Path(sys.argv[1]), sys.argv[2] or None):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(120)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(home), url or ""],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "locked\n"
        yield process.pid
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def locked_home(home: Path) -> Iterator[int]:
    """A server holding the home at http://127.0.0.1:7999. Yields its pid."""
    with _held(home, "http://127.0.0.1:7999") as pid:
        yield pid


@pytest.fixture
def embedded_home(home: Path) -> Iterator[int]:
    """A process with its own `SessionManager` (no server) holding the home. Yields its pid."""
    with _held(home, None) as pid:
        yield pid


HOLDER_PROGRAM = program_name([sys.executable, "-c"])
"""How the lock names the holder processes above (`python -c`)."""


@pytest.mark.parametrize(
    "args",
    [
        ("tenants", "list"),
        ("tenants", "create", "acme"),
        ("sessions", "list"),
        ("sessions", "evict", "s_x", "--tenant", "acme", "--to", "drop"),
        ("gc",),
        ("db", "upgrade"),
        ("chat", "--tenant", "acme"),
        ("serve",),
    ],
)
def test_refuses_while_a_server_holds_the_home(cli: Cli, home: Path, locked_home: int, args: tuple[str, ...]) -> None:
    line = assert_one_line_error(cli(*args))
    holder = f"the chatkv server at http://127.0.0.1:7999 (pid {locked_home}, {HOLDER_PROGRAM}) holds this home"
    recovery = f"(if pid {locked_home} is not a chatkv process, delete {home / 'server.lock'})"
    if args == ("serve",):  # going through the server's admin API is no answer to serve
        assert line == f"error: {holder}; stop it or use another CHATKV_HOME {recovery}"
    elif args[0] == "chat":
        assert line == f"error: {holder}: chat in its UI at http://127.0.0.1:7999 {recovery}"
    else:
        assert line == (
            f"error: {holder}; use --server http://127.0.0.1:7999 (or CHATKV_SERVER) to go through its "
            f"admin API {recovery}"
        )


@pytest.mark.parametrize("args", [("tenants", "list"), ("sessions", "list"), ("chat", "--tenant", "acme"), ("serve",)])
def test_refuses_while_an_embedding_process_holds_the_home(
    cli: Cli, home: Path, embedded_home: int, args: tuple[str, ...]
) -> None:
    """A process with its own `SessionManager` has no admin API to point to: the error names it."""
    line = assert_one_line_error(cli(*args))
    holder = f"process {embedded_home} ({HOLDER_PROGRAM}) with an open SessionManager holds this home"
    recovery = f"(if pid {embedded_home} is not a chatkv process, delete {home / 'server.lock'})"
    expected = {
        "serve": f"error: {holder}; stop it or use another CHATKV_HOME {recovery}",
        "chat": f"error: {holder}: stop it first {recovery}",
    }.get(
        args[0],
        f"error: {holder}; stop it first, or serve the home with `chatkv serve` and use --server URL {recovery}",
    )
    assert line == expected


# -- help and start-up -----------------------------------------------------------------------------


def test_help_shows_no_value_for_flags_and_one_line_per_paragraph(cli: Cli) -> None:
    narrow = cli("sessions", "inspect", "--help", COLUMNS="80")
    assert narrow.exit_code == 0 and "--json" in narrow.stdout
    assert "<bool>" not in narrow.stdout
    for args in (("serve", "--help"), ("gc", "--help"), ("tenants", "delete", "--help"), ("--help",)):
        assert "<bool>" not in cli(*args, COLUMNS="80").stdout, args
    # The terminal wraps each paragraph; no source line break cuts a sentence.
    wide = cli("sessions", "inspect", "--help", COLUMNS="400").stdout
    assert (
        "The layer table has one row per layer: kind (base or turn), turn, tokens held per KV head, tokens evicted"
        in wide
    )
    assert "Print a session's conversation" in cli("sessions", "show", "--help", COLUMNS="200").stdout


def test_offline_read_only_commands_do_not_import_torch(cli_env: dict[str, str | None], home: Path) -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from app.cli import app\n"
        "for args in (['sessions', 'list'], ['tenants', 'list'], ['stats'], ['gc', '--dry-run']):\n"
        "    result = CliRunner().invoke(app, ['--home', sys.argv[1], *args])\n"
        "    assert result.exit_code == 0, (args, result.output)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'gradio') if m in sys.modules))\n"
    )
    env = {k: v for k, v in {**os.environ, **cli_env}.items() if v is not None}
    result = subprocess.run(
        [sys.executable, "-c", code, str(home)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
