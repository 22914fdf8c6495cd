"""chatkv's HTTP faces: the server (`app.http.server`), the OpenAI-compatible and session APIs under
`/v1/`, the admin JSON API under `/admin/`, and the pieces they share (auth, errors, SSE, body
limits, prefetch)."""
