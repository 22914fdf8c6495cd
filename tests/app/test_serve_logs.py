"""`chatkv serve`'s logs: the start-up's steps as they happen, the access log, one line per turn and
its preparation at debug, from a real server process (its stderr, in JSON); the text format of a
turn's line, refused log levels and formats, and the faces `--help` names."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from app.cli import app
from app.cli.logs import TIME_FORMAT, configure_logging
from cache.ids import SessionId, TenantId
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.records import TurnStats
from sessions.turn_service import log_turn
from tests.app.server_process import chatkv_serve, free_port
from tests.conftest import MASTER_KEY, cli_environment, make_settings

ServerLog = tuple[list[dict], tuple[str, str], dict]


@pytest.fixture(scope="module")
def json_server_log(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_engine: Engine
) -> Iterator[ServerLog]:
    """(the server's stderr as JSON objects, (tenant id, session id), the turn's answer) after one
    `/v1/chat/completions` turn in a new session on a server started with `CHATKV_LOG_FORMAT=json`
    and `CHATKV_LOG_LEVEL=debug`, then stopped."""
    root = tmp_path_factory.mktemp("serve-logs")
    home = root / "home"
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        key = manager.issue_api_key(tenant)
        session_id = manager.open_session(tenant)
        model = manager.model_name
    log = root / "server.log"
    with chatkv_serve(home, str(tiny_model_dir), log, log_format="json", log_level="debug") as server:
        answer = httpx.post(
            f"{server.v1}/chat/completions",
            headers={"Authorization": f"Bearer {key}", "X-Session-ID": session_id},
            json={"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    yield [json.loads(line) for line in lines], (tenant.id, session_id), answer.json()


def test_each_line_of_the_json_log_is_an_object_with_level_logger_and_message(
    json_server_log: ServerLog,
) -> None:
    records, _, _ = json_server_log
    assert records
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
    assert any(r["logger"] == "app.http.server" and r["message"] == "chatkv stopped" for r in records)
    assert not any("color_message" in r for r in records)  # uvicorn's copy with terminal colour codes


STARTUP_STEPS = [
    ("app.cli.serve", r"chatkv starting on 127\.0\.0\.1:\d+ \(home .*/home\): importing torch and transformers"),
    ("sessions.startup", r"database sqlite:///.*/home/chatkv\.db: bringing its schema up to date"),
    ("sessions.startup", r"loading model .*tiny-model\d* on cpu as float32"),
    (
        "sessions.startup",
        r"model tiny-model\d* loaded in \d+\.\d s: 2 model layers, context 4096 tokens, 512 KV bytes per token, "
        r"fingerprint [0-9a-f]{16}",
    ),
    ("sessions.startup", r"tier budgets: device .* \(tenant quota .*\), host .*, disk .*; caches persisted .*"),
    (
        "sessions.startup",
        r"context window \d+ of the model's 4096 tokens \(policy turns\); engine loop: \d+ tokens per step "
        r"\(\d+ of them prefill\), \d+ running requests",
    ),
    ("sessions.startup", r"disk tier: 0 cached blobs found in .*/home/blobs"),
    ("sessions.startup", r"sessions ready: start-up took \d+\.\d s"),
    ("app.http.server", r"building the chat UI, the /v1/ API and the admin API"),
    ("app.http.server", r"chatkv serving tiny-model\d* on http://127\.0\.0\.1:\d+ \(admin token in .*\)"),
]


def test_start_up_logs_each_step_at_info_in_order_before_serving(json_server_log: ServerLog) -> None:
    records, _, _ = json_server_log
    steps = [r for r in records if r["level"] == "INFO" and r["logger"] in {"app.cli.serve", "sessions.startup"}]
    serving = [r for r in records if r["logger"] == "app.http.server" and r["level"] == "INFO"][:2]
    got = [(r["logger"], r["message"]) for r in steps + serving]
    assert len(got) == len(STARTUP_STEPS), got
    for (logger, message), (want_logger, pattern) in zip(got, STARTUP_STEPS, strict=True):
        assert logger == want_logger and re.fullmatch(pattern, message), (logger, message)


def test_debug_adds_the_start_up_details_and_each_turn_s_preparation(json_server_log: ServerLog) -> None:
    records, (_, session), _ = json_server_log
    debug = [(r["logger"], r["message"]) for r in records if r["level"] == "DEBUG"]
    own = [(logger, message) for logger, message in debug if logger.split(".")[0] in {"sessions", "cache", "storage"}]
    assert ("sessions.startup", "no Redis tier (CHATKV_REDIS_URL unset): a single process") in own
    assert any(re.fullmatch(r"engine loop limits: SchedulerConfig\(max_step_tokens=\d+, .*\)", m) for _, m in own)
    assert any(
        re.fullmatch(r"master key id [0-9a-f]{16} from CHATKV_MASTER_KEY; 1 tenants' data keys wrapped", m)
        for _, m in own
    )
    [prepared] = [m for logger, m in own if logger == "sessions.turn.preparer"]
    assert re.fullmatch(
        rf"session {session}: rebuild from new: 0 cached tokens reused \(0 of them the base\), \d+ fed before the "
        r"turn's \d+, 0 demoted, 0 prefilled while preparing",
        prepared,
    )


def test_the_access_log_has_a_line_per_request(json_server_log: ServerLog) -> None:
    records, _, _ = json_server_log
    access = [r["message"] for r in records if r["logger"] == "uvicorn.access"]
    assert any(message.endswith('"POST /v1/chat/completions HTTP/1.1" 200') for message in access), access
    assert any(message.endswith('"GET /healthz HTTP/1.1" 200') for message in access), access


def test_a_turn_is_one_line_with_its_figures_as_fields(
    json_server_log: ServerLog,
) -> None:
    records, (tenant, session), answer = json_server_log
    [turn] = [r for r in records if r["logger"] == "sessions.turns"]
    usage = answer["usage"]
    assert turn["level"] == "INFO"
    assert turn["tenant"] == tenant
    assert turn["session"] == session
    assert turn["prefilled_tokens"] == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert turn["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert turn["restored_from"] == "new"
    assert turn["decode_tokens"] == usage["completion_tokens"]
    assert turn["ttft_ms"] > 0
    assert turn["message"].startswith(f"tenant={tenant} session={session} prefilled_tokens=")


def test_a_turn_line_in_text_format_names_each_figure() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("info", "text", stream)
        stats = TurnStats(prefill_tokens=12, reused_tokens=30, ttft_s=0.0421, decode_tokens=5, decode_s=0.2)
        log_turn(TenantId("tn_a"), SessionId("s_b"), stats)
        logging.getLogger("transformers.noise").info("not shown: other libraries log from warning up")
    finally:
        root.handlers[:], root.level = handlers, level
    [line] = stream.getvalue().splitlines()
    stamp, rest = line.split(" ", 1)
    assert datetime.strptime(stamp, TIME_FORMAT).tzinfo is not None
    assert rest == (
        "INFO sessions.turns: tenant=tn_a session=s_b prefilled_tokens=12 cached_tokens=30 restored_from=new "
        "ttft_ms=42.1 decode_tokens=5 decode_tokens_per_s=20.0"
    )


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["serve", "--log-level", "loud"], {}),
        (["serve"], {"CHATKV_LOG_LEVEL": "loud"}),
        (["serve", "--log-format", "xml"], {}),
    ],
)
def test_an_unknown_log_level_or_format_is_exit_code_2_with_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    result = CliRunner().invoke(app, args, env=cli_environment(CHATKV_HOME=str(tmp_path / "home"), **env))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("error: Invalid value for '--log-")
    assert not (tmp_path / "home").exists()


def test_serve_with_a_hub_id_offline_exits_2_with_one_line(tmp_path: Path) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        result = CliRunner().invoke(
            app,
            ["serve", "--port", str(free_port()), "--model", "HuggingFaceTB/SmolLM2-360M-Instruct"],
            env=cli_environment(CHATKV_HOME=str(tmp_path / "home"), CHATKV_MASTER_KEY=MASTER_KEY),
        )
    finally:
        root.handlers[:], root.level = handlers, level
    assert result.exit_code == 2, result.output
    *logged, line = result.stderr.splitlines()  # the start-up's log lines, then the one error line
    assert line.startswith("error: cannot download HuggingFaceTB/SmolLM2-360M-Instruct: the Hugging Face hub")
    assert logged[-1].endswith(
        " INFO sessions.startup: loading model HuggingFaceTB/SmolLM2-360M-Instruct on cpu as float32"
    )
    assert all(" INFO " in entry for entry in logged), logged


def test_serve_help_names_every_face_it_serves_the_v1_api_included() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert (
        "Serve the chat UI at /, the OpenAI-compatible API under /v1/ (chat completions, Responses, sessions), "
        "the admin API under /admin/ and Prometheus metrics at /metrics."
    ) in result.stdout


def test_logging_to_stderr_follows_a_swapped_stderr_and_never_writes_to_a_closed_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command run under a test runner's captured stderr, then closed, must not leave the root
    logger writing into the closed stream ("--- Logging error --- I/O operation on closed file")."""
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    captured = io.StringIO()
    monkeypatch.setattr("sys.stderr", captured)
    try:
        configure_logging("info", "text")
        logging.getLogger("sessions").info("while captured")
        captured.close()
        later = io.StringIO()
        monkeypatch.setattr("sys.stderr", later)
        logging.getLogger("sessions").info("after the capture closed")
        assert later.getvalue().endswith("INFO sessions: after the capture closed\n")
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
