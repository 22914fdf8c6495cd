"""Issue 2's persistence: every accepted turn is committed, and after a real process restart a
session with no stored cache is rebuilt by prefilling its transcript (exact under greedy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sessions.manager import SessionManager
from tests.conftest import MASTER_KEY, MODEL_CACHE, REPO, make_settings

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from sessions import SessionManager, Settings
    args = json.loads(sys.argv[1])
    with SessionManager(Settings.from_env()) as manager:
        if args["create"]:
            tenant = manager.create_tenant("acme")
            sid = manager.open_session(tenant, system_prompt="Be brief.")
        else:
            tenant, sid = manager.get_tenant("acme"), args["session"]
        replies = []
        for message in args["messages"]:
            reply = manager.chat(tenant, sid, message, max_new_tokens=12)
            replies.append({"ids": list(reply.token_ids), "source": reply.stats.restored_from,
                            "prefill": reply.stats.prefill_tokens})
    print(json.dumps({"session": sid, "replies": replies}))
    """
)


def run_turns(home: Path, model_dir: Path, **args: object) -> dict:
    env = {
        **os.environ,
        "CHATKV_HOME": str(home),
        "CHATKV_MODEL": str(model_dir),
        "CHATKV_MODEL_CACHE_DIR": str(MODEL_CACHE),
        "CHATKV_MASTER_KEY": MASTER_KEY,
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_session_continues_after_restart_by_rebuilding_from_the_transcript(
    tmp_path: Path, tiny_model_dir: Path, tiny_engine
) -> None:
    home = tmp_path / "home"
    first = run_turns(home, tiny_model_dir, create=True, messages=["hello", "how are you?"])
    # No stored cache: the second process must rebuild the session from its transcript.
    for blob in (home / "blobs").rglob("*.ckv"):
        blob.unlink()
    second = run_turns(home, tiny_model_dir, create=False, session=first["session"], messages=["and now?"])
    [rebuilt] = second["replies"]
    assert rebuilt["source"] == "rebuilt"

    # The same three turns in one process that never restarted give the same ids (greedy).
    with SessionManager(make_settings(tmp_path / "reference"), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="Be brief.")
        reference = [manager.chat(tenant, sid, m, max_new_tokens=12) for m in ("hello", "how are you?", "and now?")]
        assert [r["ids"] for r in first["replies"]] == [list(r.token_ids) for r in reference[:2]]
        assert rebuilt["ids"] == list(reference[2].token_ids)
        # Rebuilding prefills the whole conversation: everything the reference reused plus its prefill.
        assert rebuilt["prefill"] == reference[2].stats.prefill_tokens + reference[2].stats.reused_tokens

        history = manager.history(tenant, sid)
    with SessionManager(make_settings(home), engine=tiny_engine) as restarted:
        stored = restarted.history("acme", first["session"])
    assert [(m.role, m.text, m.token_ids) for m in stored] == [(m.role, m.text, m.token_ids) for m in history]
