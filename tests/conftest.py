"""Shared fixtures: the real default model (converted once into a cache that survives test runs),
a tiny randomly initialised model of the same architecture and tokenizer, and managers on
temporary chatkv homes with real SQLite files and real encryption."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.model_source import converted_default_dir, load_model
from sessions.settings import Settings

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("CHATKV_TEST_MODEL_CACHE", REPO / ".cache" / "models"))
MASTER_KEY = "Y2hhdGt2LXRlc3QtbWFzdGVyLWtleS0zMi1ieXRlcyE="  # base64 of 32 bytes, tests only


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
def real_engine(smollm_dir: Path) -> Engine:
    return Engine(load_model("default", MODEL_CACHE, "cpu", "float32"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model(str(tiny_model_dir), MODEL_CACHE, "cpu", "float32"))


def make_settings(home: Path, **overrides: object) -> Settings:
    """Settings on a temporary home with a fixed master key; budgets default to generous values."""
    values: dict[str, object] = {
        "home": home,
        "model_cache_dir": MODEL_CACHE,
        "master_key": MASTER_KEY,
        "device_budget_bytes": 2**30,
        "host_budget_bytes": 2**30,
        "disk_budget_bytes": 2**31,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def tiny_manager(tmp_path: Path, tiny_engine: Engine) -> Iterator[SessionManager]:
    with SessionManager(make_settings(tmp_path / "home"), engine=tiny_engine) as manager:
        yield manager


@pytest.fixture
def real_manager(tmp_path: Path, real_engine: Engine) -> Iterator[SessionManager]:
    with SessionManager(make_settings(tmp_path / "home"), engine=real_engine) as manager:
        yield manager
