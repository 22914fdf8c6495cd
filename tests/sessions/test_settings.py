"""`Settings` read `CHATKV_<FIELD>` for every field, whichever way they are built (`Settings()`,
`Settings.from_env()`, `SessionManager()`), and keyword arguments win."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import platformdirs
import pytest

from sessions.settings import (
    ModelConfig,
    RedisConfig,
    ReplicaConfig,
    Settings,
    TierConfig,
    WindowConfig,
    default_model_cache_dir,
    env_variable,
)

# One value per field, as text in the environment and as the field holds it.
ENVIRONMENT: dict[str, tuple[str, Any]] = {
    "home": ("/srv/chatkv", Path("/srv/chatkv")),
    "model": ("/models/smol", "/models/smol"),
    "model_cache_dir": ("/srv/models", Path("/srv/models")),
    "database_url": ("postgresql+psycopg://chatkv@db/chatkv", "postgresql+psycopg://chatkv@db/chatkv"),
    "device": ("cpu", "cpu"),
    "dtype": ("bfloat16", "bfloat16"),
    "threads": ("3", 3),
    "device_budget_bytes": ("1GiB", 2**30),
    "host_budget_bytes": ("512MiB", 512 * 2**20),
    "disk_budget_bytes": ("2GB", 2 * 10**9),
    "tenant_device_quota_bytes": ("256MiB", 256 * 2**20),
    "persist": ("on_evict", "on_evict"),
    "master_key": ("Y2hhdGt2LXRlc3QtbWFzdGVyLWtleS0zMi1ieXRlcyE=", "Y2hhdGt2LXRlc3QtbWFzdGVyLWtleS0zMi1ieXRlcyE="),
    "context_budget_tokens": ("1024", 1024),
    "window_policy": ("attention", "attention"),
    "window_budget_allocation": ("uniform", "uniform"),
    "window_recent_tokens": ("48", 48),
    "window_observation_tokens": ("16", 16),
    "window_rebuild_chunk_tokens": ("64", 64),
    "pin_first_turn": ("yes", True),
    "share_base": ("0", False),
    "offload_precision": ("int8", "int8"),
    "quant_residual_tokens": ("16", 16),
    "max_step_tokens": ("128", 128),
    "max_prefill_tokens": ("48", 48),
    "max_running_requests": ("8", 8),
    "max_running_per_tenant": ("2", 2),
    "max_batch_requests": ("4", 4),
    "fork_sessions": ("0", False),
    "reuse_kv": ("off", False),
    "restore_or_recompute": ("0", False),
    "max_concurrent_requests_per_tenant": ("5", 5),
    "admin_token": ("s3cret", "s3cret"),
    "session_retention_s": ("30d", 30 * 86400.0),
    "implicit_retention_s": ("7d", 7 * 86400.0),
    "metrics_tenant_labels": ("on", True),
    "redis_url": ("redis://cache.internal:6379/0", "redis://cache.internal:6379/0"),
    "redis_cluster": ("yes", True),
    "redis_ttl_s": ("2d", 2 * 86400.0),
    "redis_budget_bytes": ("1GiB", 1 << 30),
    "redis_prefix": ("chatkv-prod", "chatkv-prod"),
    "replica_id": ("replica-a", "replica-a"),
    "replica_url": ("http://10.0.0.5:8000", "http://10.0.0.5:8000"),
    "ownership_lease_s": ("20", 20.0),
    "ownership_wait_s": ("5", 5.0),
    "ownership_idle_s": ("2m", 120.0),
    "routing": ("handover", "handover"),
    "forward_queue_limit": ("8", 8),
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `CHATKV_<FIELD>` inherited from the shell that runs the tests."""
    for f in fields(Settings):
        monkeypatch.delenv(env_variable(f.name), raising=False)


def test_every_field_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(ENVIRONMENT) == {f.name for f in fields(Settings)}  # a new field needs a row here
    for name, (text, _) in ENVIRONMENT.items():
        monkeypatch.setenv(env_variable(name), text)
    built = Settings()
    assert {name: getattr(built, name) for name in ENVIRONMENT} == {name: v for name, (_, v) in ENVIRONMENT.items()}
    assert Settings.from_env() == built
    assert Settings.from_env({f"CHATKV_{name.upper()}": text for name, (text, _) in ENVIRONMENT.items()}) == built


def test_a_worker_started_with_a_database_url_uses_that_database(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql+psycopg://chatkv@db.internal/chatkv"
    monkeypatch.setenv("CHATKV_DATABASE_URL", url)
    assert Settings().database_url == url
    assert Settings().resolved_database_url == url
    assert Settings.from_env().database_url == url
    assert Settings(home=Path("/elsewhere")).database_url == url  # other keywords do not drop it


def test_keyword_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_DATABASE_URL", "sqlite:////env.db")
    monkeypatch.setenv("CHATKV_THREADS", "not a number")  # never read: the keyword is given
    assert Settings(database_url="sqlite:////kw.db", threads=2).database_url == "sqlite:////kw.db"
    assert Settings.from_env(threads=2).threads == 2
    assert Settings.from_env(database_url="sqlite:////kw.db", threads=2).database_url == "sqlite:////kw.db"
    assert Settings(threads=2).with_overrides(max_step_tokens=64).database_url == "sqlite:////env.db"


def test_unset_or_empty_variables_leave_the_declared_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    monkeypatch.setenv("CHATKV_DATABASE_URL", "")
    built = Settings()
    assert (built.home, built.database_url, built.device, built.max_step_tokens) == (tmp_path, None, "auto", 256)
    assert built.resolved_database_url == f"sqlite:///{tmp_path / 'chatkv.db'}"
    # An explicit mapping is the only environment read.
    assert Settings.from_env({}).home == Path(platformdirs.user_data_dir("chatkv", appauthor=False))


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "CHATKV_DEVICE_BUDGET_BYTES",
            "lots",
            "CHATKV_DEVICE_BUDGET_BYTES: not a byte size: 'lots' (examples: 1048576, 512MiB, 2GB)",
        ),
        ("CHATKV_HOST_BUDGET_BYTES", "0", "CHATKV_HOST_BUDGET_BYTES: host_budget_bytes must be > 0 bytes, got 0"),
        ("CHATKV_THREADS", "two", "CHATKV_THREADS: not an integer: 'two'"),
        ("CHATKV_THREADS", "0", "CHATKV_THREADS: threads must be >= 1, got 0"),
        ("CHATKV_DEVICE", "tpu", "CHATKV_DEVICE: device must be auto, cpu, cuda, cuda:N or mps, got 'tpu'"),
        ("CHATKV_PERSIST", "never", "CHATKV_PERSIST: persist must be 'on_evict' or 'write_back', got 'never'"),
        ("CHATKV_SHARE_BASE", "maybe", "CHATKV_SHARE_BASE: not a boolean: 'maybe'"),
        (
            "CHATKV_WINDOW_POLICY",
            "h2o",
            "CHATKV_WINDOW_POLICY: window_policy must be 'turns', 'attention' or 'agnostic', got 'h2o'",
        ),
        (
            "CHATKV_WINDOW_RECENT_TOKENS",
            "-1",
            "CHATKV_WINDOW_RECENT_TOKENS: window_recent_tokens must be an integer >= 0, got -1",
        ),
        (
            "CHATKV_WINDOW_BUDGET_ALLOCATION",
            "per_layer",
            "CHATKV_WINDOW_BUDGET_ALLOCATION: window_budget_allocation must be 'uniform' or 'per_head', "
            "got 'per_layer'",
        ),
        (
            "CHATKV_WINDOW_OBSERVATION_TOKENS",
            "0",
            "CHATKV_WINDOW_OBSERVATION_TOKENS: window_observation_tokens must be an integer >= 1, got 0",
        ),
        (
            "CHATKV_WINDOW_REBUILD_CHUNK_TOKENS",
            "-1",
            "CHATKV_WINDOW_REBUILD_CHUNK_TOKENS: window_rebuild_chunk_tokens must be an integer >= 0, got -1",
        ),
        (
            "CHATKV_CONTEXT_BUDGET_TOKENS",
            "-64",
            "CHATKV_CONTEXT_BUDGET_TOKENS: context_budget_tokens must be >= 16, got -64",
        ),
        (
            "CHATKV_REDIS_URL",
            "localhost:6379",
            "CHATKV_REDIS_URL: redis_url must be redis://... or rediss://..., got 'localhost:6379'",
        ),
        ("CHATKV_REDIS_CLUSTER", "sometimes", "CHATKV_REDIS_CLUSTER: not a boolean: 'sometimes'"),
        (
            "CHATKV_REDIS_BUDGET_BYTES",
            "-5",
            "CHATKV_REDIS_BUDGET_BYTES: not a byte size: '-5' (examples: 1048576, 512MiB, 2GB)",
        ),
        ("CHATKV_REPLICA_ID", "a/b", "CHATKV_REPLICA_ID: replica_id must be 1-32 of A-Z a-z 0-9 _ . -, got 'a/b'"),
        (
            "CHATKV_REPLICA_URL",
            "10.0.0.5:8000",
            "CHATKV_REPLICA_URL: replica_url must be http(s)://..., got '10.0.0.5:8000'",
        ),
        (
            "CHATKV_OWNERSHIP_LEASE_S",
            "0.1",
            "CHATKV_OWNERSHIP_LEASE_S: ownership_lease_s must be in [0.5, 3600] seconds, got 0.1",
        ),
        (
            "CHATKV_OWNERSHIP_WAIT_S",
            "forever",
            "CHATKV_OWNERSHIP_WAIT_S: not a duration: 'forever' (examples: 90, 30m, 12h, 7d)",
        ),
        (
            "CHATKV_SESSION_RETENTION_S",
            "soon",
            "CHATKV_SESSION_RETENTION_S: not a duration: 'soon' (examples: 90, 30m, 12h, 7d)",
        ),
        (
            "CHATKV_IMPLICIT_RETENTION_S",
            "0",
            "CHATKV_IMPLICIT_RETENTION_S: implicit_retention_s must be in (0, 100 years], got 0.0",
        ),
        ("CHATKV_FORK_SESSIONS", "maybe", "CHATKV_FORK_SESSIONS: not a boolean: 'maybe'"),
    ],
)
def test_a_bad_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    for build in (Settings, Settings.from_env):
        with pytest.raises(ValueError) as raised:
            build()
        assert str(raised.value) == message


def test_a_recent_window_must_be_below_the_context_budget() -> None:
    with pytest.raises(
        ValueError, match=r"^window_recent_tokens must be below context_budget_tokens \(256\), got 256$"
    ):
        Settings(context_budget_tokens=256, window_recent_tokens=256, window_policy="attention")
    assert Settings(context_budget_tokens=256, window_recent_tokens=255, window_policy="attention")
    assert Settings(context_budget_tokens=32, window_policy="turns")  # the recent window is unused there


def test_keyword_values_are_checked_as_before() -> None:
    with pytest.raises(ValueError, match=r"^threads must be >= 1, got 0$"):
        Settings(threads=0)
    with pytest.raises(ValueError, match=r"^device_budget_bytes must be > 0 bytes, got -1$"):
        Settings(device_budget_bytes=-1)


@pytest.mark.parametrize("text", ["٣", "1_000", "3.0", ""])
def test_an_integer_setting_takes_ascii_digits_only(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_MAX_STEP_TOKENS", text or " ")
    with pytest.raises(ValueError, match="CHATKV_MAX_STEP_TOKENS"):
        Settings()


# -- sub-configs -------------------------------------------------------------------------------


def environment_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name, (text, _) in ENVIRONMENT.items():
        monkeypatch.setenv(env_variable(name), text)
    return Settings()


def test_the_model_config_carries_the_model_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    config = environment_settings(monkeypatch).model_config()
    assert config == ModelConfig(
        model="/models/smol", model_cache_dir=Path("/srv/models"), device="cpu", dtype="bfloat16", threads=3
    )
    monkeypatch.delenv("CHATKV_MODEL_CACHE_DIR")
    assert Settings(home=Path("/srv/h")).model_config().model_cache_dir == default_model_cache_dir()
    with pytest.raises(ValueError, match=r"^device must be auto, cpu, cuda, cuda:N or mps, got 'tpu'$"):
        replace(config, device="tpu")
    with pytest.raises(ValueError, match=r"^threads must be >= 1, got 0$"):
        replace(config, threads=0)


def test_the_window_config_carries_the_window_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    config = environment_settings(monkeypatch).window_config()
    assert config == WindowConfig(
        context_budget_tokens=1024,
        window_policy="attention",
        window_budget_allocation="uniform",
        window_recent_tokens=48,
        window_observation_tokens=16,
        window_rebuild_chunk_tokens=64,
        pin_first_turn=True,
    )
    assert config.budget_tokens(2048) == 1024
    assert replace(config, context_budget_tokens=None).budget_tokens(2048) == 1638  # 80% of the context
    with pytest.raises(ValueError, match=r"^context_budget_tokens=1024 exceeds the model's context \(512 tokens\)$"):
        config.budget_tokens(512)
    with pytest.raises(ValueError, match=r"^window_policy must be 'turns', 'attention' or 'agnostic', got 'h2o'$"):
        replace(config, window_policy="h2o")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^window_recent_tokens must be below context_budget_tokens \(1024\)"):
        replace(config, window_recent_tokens=1024)
    assert replace(config, window_policy="turns", window_recent_tokens=1024).window_recent_tokens == 1024


def test_the_tier_config_carries_the_tier_fields_with_derived_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    config = environment_settings(monkeypatch).tier_config()
    assert config == TierConfig(
        device_budget_bytes=2**30,
        host_budget_bytes=512 * 2**20,
        disk_budget_bytes=2 * 10**9,
        tenant_device_quota_bytes=256 * 2**20,
        persist="on_evict",
        offload_precision="int8",
        quant_residual_tokens=16,
        share_base=False,
    )
    assert not config.write_back
    monkeypatch.delenv("CHATKV_TENANT_DEVICE_QUOTA_BYTES")
    monkeypatch.delenv("CHATKV_PERSIST")
    derived = Settings(device_budget_bytes=2**20).tier_config()  # the quota defaults to the device budget
    assert (derived.tenant_device_quota_bytes, derived.write_back) == (2**20, True)
    with pytest.raises(
        ValueError,
        match=r"^tenant_device_quota_bytes must be in 1..device_budget_bytes \(1073741824\), got 2147483648$",
    ):
        replace(config, tenant_device_quota_bytes=2**31)
    with pytest.raises(ValueError, match=r"^host_budget_bytes must be set, got None$"):
        replace(config, host_budget_bytes=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^offload_precision must be 'exact', 'int8' or 'int4', got 'fp8'$"):
        replace(config, offload_precision="fp8")  # type: ignore[arg-type]


def test_the_redis_config_carries_the_redis_fields_and_is_none_without_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    config = environment_settings(monkeypatch).redis_config()
    assert config == RedisConfig(
        redis_url="redis://cache.internal:6379/0",
        redis_cluster=True,
        redis_ttl_s=2 * 86400.0,
        redis_budget_bytes=1 << 30,
        redis_prefix="chatkv-prod",
    )
    monkeypatch.delenv("CHATKV_REDIS_URL")
    assert Settings().redis_config() is None
    with pytest.raises(ValueError, match=r"^redis_url must be set, got None$"):
        replace(config, redis_url=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^redis_ttl_s must be in \[1 s, 100 years\], got 0.5$"):
        replace(config, redis_ttl_s=0.5)


def test_the_replica_config_carries_the_replica_and_ownership_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    config = environment_settings(monkeypatch).replica_config()
    assert config == ReplicaConfig(
        replica_id="replica-a",
        replica_id_file=Path("/srv/chatkv/replica.id"),
        replica_url="http://10.0.0.5:8000",
        ownership_lease_s=20.0,
        ownership_wait_s=5.0,
        ownership_idle_s=120.0,
        routing="handover",
        forward_queue_limit=8,
    )
    with pytest.raises(ValueError, match=r"^replica_id must be 1-32 of A-Z a-z 0-9 _ . -, got 'a/b'$"):
        replace(config, replica_id="a/b")
    with pytest.raises(ValueError, match=r"^ownership_lease_s must be in \[0.5, 3600\] seconds, got 0.1$"):
        replace(config, ownership_lease_s=0.1)
    with pytest.raises(ValueError, match=r"^routing must be 'forward' or 'handover', got 'proxy'$"):
        replace(config, routing="proxy")  # type: ignore[arg-type]


def test_the_default_settings_build_every_sub_config(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    assert settings.redis_config() is None
    assert settings.replica_config().replica_id_file == tmp_path / "replica.id"
    assert settings.window_config().context_budget_tokens is None
    assert settings.tier_config().device_budget_bytes == settings.device_budget_bytes
    assert settings.model_config().model == "default"
