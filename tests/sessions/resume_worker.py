"""Child process of the restart tests: one chatkv process that runs some turns and exits.

    python -m tests.sessions.resume_worker '{"session": null, "messages": [...], "hang": false}'

Settings come from the `CHATKV_*` environment. With `"session": null` it creates tenant `acme` and a
session; otherwise it continues that session of `acme`. It prints one JSON line (the session id and,
per turn, the reply ids, `restored_from` and `prefill_tokens`), then closes the manager, or with
`"hang": true` waits to be killed without closing anything.
"""

from __future__ import annotations

import json
import sys
import time

from sessions import SessionManager, Settings

SYSTEM = "You are a helpful assistant. Answer briefly."
MAX_NEW_TOKENS = 24


def main(args: dict) -> None:
    manager = SessionManager(Settings.from_env())
    if args["session"] is None:
        tenant = manager.create_tenant("acme")
        session = manager.open_session(tenant, system_prompt=SYSTEM)
    else:
        tenant, session = manager.get_tenant("acme"), args["session"]
    replies = []
    for message in args["messages"]:
        reply = manager.chat(tenant, session, message, max_new_tokens=MAX_NEW_TOKENS)
        replies.append(
            {
                "ids": list(reply.token_ids),
                "restored_from": reply.stats.restored_from,
                "prefill_tokens": reply.stats.prefill_tokens,
            }
        )
    print(json.dumps({"tenant": tenant.id, "session": session, "replies": replies}), flush=True)
    if args.get("hang"):
        time.sleep(3600)  # the test kills this process: nothing is closed or flushed on purpose
    manager.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
