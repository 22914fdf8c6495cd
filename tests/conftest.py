"""Shared fixtures: the real default model (converted once into a cache that survives test runs),
a tiny randomly initialised model of the same architecture and tokenizer, and managers on
temporary chatkv homes with real SQLite files and real encryption; real Redis servers (the machine's,
a private one to kill, and a three-master Redis Cluster)."""

from __future__ import annotations

import os

# The tests never reach for the Hugging Face hub: every model is a local file (set before transformers
# and huggingface_hub are imported, which read it once; child processes inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

# Under pytest-xdist each worker process gets an equal share of the cores for torch's intra-op
# threads: the default (every core in every worker) oversubscribes the CPU and slows every model
# step far more than the parallel workers gain.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from sessions.engine import Engine
from sessions.manager import Services, SessionManager, open_services
from sessions.model_source import converted_default_dir, load_model
from sessions.settings import Settings
from tests import redis_servers

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("CHATKV_TEST_MODEL_CACHE", REPO / ".cache" / "models"))
REDIS_ENV = "CHATKV_TEST_REDIS_URL"
REDIS_CLUSTER_ENV = "CHATKV_TEST_REDIS_CLUSTER_URL"
MASTER_KEY = "Y2hhdGt2LXRlc3QtbWFzdGVyLWtleS0zMi1ieXRlcyE="  # base64 of 32 bytes, tests only


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Put the root logger's handlers and level, and chatkv's loggers' levels, back after each test:
    a command run in-process (`chatkv serve --log-level error` refusing a model, `tests/app/test_cli.py`)
    configures logging for the whole process, and a later test in the same process then saw no
    warning records (with `--log-level error`, `sessions` and `cache` drop them)."""
    import logging

    from app.cli.logs import OWN_LOGGERS

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in OWN_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, saved in levels.items():
        logging.getLogger(name).setLevel(saved)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as a safetensors directory (converted on first use)."""
    return converted_default_dir(MODEL_CACHE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A 2-layer Llama with random weights and SmolLM2's tokenizer and chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gemma3_engine(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Engine:
    """A tiny random Gemma-3-shaped model (5 sliding-window layers of `model_families.WINDOW`
    tokens, then one full-attention layer) with SmolLM2's tokenizer and chat template."""
    from transformers import AutoTokenizer

    from tests.model_families import save_family_model

    path = save_family_model("gemma3", AutoTokenizer.from_pretrained(smollm_dir), tmp_path_factory.mktemp("gemma3"))
    return Engine(load_model(str(path), MODEL_CACHE, "cpu", "float32"))


@pytest.fixture(scope="session")
def real_engine(smollm_dir: Path) -> Engine:
    return Engine(load_model("default", MODEL_CACHE, "cpu", "float32"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model(str(tiny_model_dir), MODEL_CACHE, "cpu", "float32"))


def cli_environment(**variables: str) -> dict[str, str | None]:
    """An environment for `CliRunner.invoke(env=...)`: every `CHATKV_*` variable of the shell that
    runs the tests unset, then `variables` set."""
    env: dict[str, str | None] = {name: None for name in os.environ if name.startswith("CHATKV_")}
    env.update(variables)
    return env


def make_settings(home: Path, **overrides: object) -> Settings:
    """Settings on a temporary home with a fixed master key; budgets default to generous values."""
    values: dict[str, object] = {
        "home": home,
        "model_cache_dir": MODEL_CACHE,
        "master_key": MASTER_KEY,
        "device_budget_bytes": 2**30,
        "host_budget_bytes": 2**30,
        "disk_budget_bytes": 2**31,
        # Tests that check which tier a cache came from need it restored, whatever is cheaper;
        # tests of the choice itself turn it on.
        "restore_or_recompute": False,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def tiny_services(tmp_path: Path, tiny_engine: Engine) -> Iterator[Services]:
    """The composition root's services on a temporary home over the tiny model."""
    services = open_services(make_settings(tmp_path / "home"), engine=tiny_engine)
    with services.manager:
        yield services


@pytest.fixture
def tiny_manager(tiny_services: Services) -> SessionManager:
    return tiny_services.manager


@pytest.fixture
def real_manager(tmp_path: Path, real_engine: Engine) -> Iterator[SessionManager]:
    with SessionManager(make_settings(tmp_path / "home"), engine=real_engine) as manager:
        yield manager


# -- Redis -----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The shared Redis (`CHATKV_TEST_REDIS_URL`, default the machine's 127.0.0.1:6379); tests
    write only under their own `redis_prefix`. Skips if it does not answer."""
    url = os.environ.get(REDIS_ENV, "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        pytest.skip(f"Redis run skipped: {url} does not answer ({exc})")
    finally:
        client.close()
    return url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A three-master Redis Cluster: `CHATKV_TEST_REDIS_CLUSTER_URL` (`.ci/run` starts one), else
    one started here for the test session."""
    url = os.environ.get(REDIS_CLUSTER_ENV)
    if url:
        yield url
        return
    if redis_servers.redis_server_binary() is None:
        pytest.skip(f"Redis Cluster run skipped: no redis-server binary and {REDIS_CLUSTER_ENV} is not set")
    cluster = redis_servers.start_cluster()
    try:
        yield cluster.url
    finally:
        cluster.stop()


def _unique_prefix(url: str, cluster: bool) -> Iterator[str]:
    prefix = f"ckvtest-{secrets.token_hex(6)}"
    yield prefix
    client = redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    try:
        redis_servers.delete_prefixed(client, prefix)
    finally:
        client.close()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test alone (`ckvtest-<hex>`); its keys on `redis_url` are deleted after."""
    yield from _unique_prefix(redis_url, cluster=False)


@pytest.fixture
def redis_cluster_prefix(redis_cluster_url: str) -> Iterator[str]:
    """Like `redis_prefix`, on the Redis Cluster."""
    yield from _unique_prefix(redis_cluster_url, cluster=True)


@pytest.fixture
def private_redis() -> Iterator[redis_servers.RedisServer]:
    """A standalone redis-server of this test alone, free to kill, stop or flush."""
    if redis_servers.redis_server_binary() is None:
        pytest.skip("private Redis skipped: no redis-server binary")
    server = redis_servers.start_server()
    try:
        yield server
    finally:
        server.stop()
