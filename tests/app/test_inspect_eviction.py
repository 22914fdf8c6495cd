"""`chatkv sessions inspect` shows what the `attention` window policy evicted, per layer."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from app.cli import app
from sessions.engine import Engine
from sessions.manager import SessionManager
from tests.conftest import MASTER_KEY, MODEL_CACHE, cli_environment, make_settings

WINDOW = {"context_budget_tokens": 200, "window_policy": "attention", "window_recent_tokens": 24}


def test_inspect_shows_kept_and_evicted_tokens_per_layer(
    tmp_path: Path, tiny_engine: Engine, tiny_model_dir: Path
) -> None:
    home = tmp_path / "home"
    with SessionManager(make_settings(home, **WINDOW), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="You are terse.")
        for i in range(8):
            manager.chat(tenant, sid, f"note {i}: the parcel number is {1000 + 37 * i}", max_new_tokens=8)
        cache = manager.internals.tiers.peek(manager.internals.tiers_key(tenant, sid))
        assert cache is not None and cache.evicted_tokens > 0
        expected = [(s.turn_index, s.token_count, s.evicted_tokens) for s in cache.layers]
    env = cli_environment(
        CHATKV_HOME=str(home),
        CHATKV_MODEL=str(tiny_model_dir),
        CHATKV_MODEL_CACHE_DIR=str(MODEL_CACHE),
        CHATKV_MASTER_KEY=MASTER_KEY,
        CHATKV_CONTEXT_BUDGET_TOKENS="200",
        CHATKV_WINDOW_POLICY="attention",
        CHATKV_WINDOW_RECENT_TOKENS="24",
    )
    runner = CliRunner()
    result = runner.invoke(app, ["sessions", "inspect", sid, "--tenant", "acme", "--json"], env=env)
    assert result.exit_code == 0, result.stdout
    layers = json.loads(result.stdout)["layers"]
    assert layers[0]["turn_index"] is None and layers[0]["evicted"] == 0  # the base layer
    assert [(row["turn_index"], row["tokens"], row["evicted"]) for row in layers[1:]] == expected
    for row in layers[1:]:
        assert row["positions"][1] - row["positions"][0] == row["tokens"] + row["evicted"]
    plain = runner.invoke(app, ["sessions", "inspect", sid, "--tenant", "acme"], env=env, terminal_width=200)
    assert plain.exit_code == 0 and "evicted" in plain.stdout
