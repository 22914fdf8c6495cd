"""The turn pipeline: one turn of one session, from the stored transcript to the stored reply.

In the order a turn runs through them:

- `transcript`: the stored conversation as a turn needs it, and its chained digest.
- `chat_template`: the chat template rendered into exact token ids (the next turn's delta, or the
  whole conversation for a rebuild).
- `window`: the window step that makes the turn fit the context budget.
- `runner`: `TurnRunner`, which prepares a turn (restore or rebuild), submits it to the engine loop
  and streams its reply.
- `detokenizer`, `stop_strings`: the streamed text and where a stop string cuts it.

Nothing is imported here, so a module of the pipeline can be imported alone.
"""
