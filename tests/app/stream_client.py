"""One streaming chat client in its own process, as a bot backend's worker would be: the official
`openai` package against a chatkv server. Prints one JSON line: the session id, the streamed text
(joined chunks) and the finish reason.

    python -m tests.app.stream_client BASE_URL API_KEY MODEL PROMPT MAX_TOKENS
"""

from __future__ import annotations

import json
import sys

from openai import OpenAI


def main(base_url: str, api_key: str, model: str, prompt: str, max_tokens: str) -> None:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=int(max_tokens),
        temperature=0,
        stream=True,
    ) as response:
        session_id = response.headers["x-session-id"]
        pieces, finish = [], None
        for chunk in response.parse():
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    print(json.dumps({"session_id": session_id, "text": "".join(pieces), "finish_reason": finish}))


if __name__ == "__main__":
    main(*sys.argv[1:])
