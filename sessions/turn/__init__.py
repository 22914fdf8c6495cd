"""The turn pipeline: one turn of one session, from the stored transcript to the stored reply.

In the order a turn runs through them:

- `transcript`: the stored conversation as a turn needs it, and its chained digest.
- `chat_template`: the chat template rendered into exact token ids (the next turn's delta, or the
  whole conversation for a rebuild).
- `window`: the window step that makes the turn fit the context budget, and the walk that lays
  kept layers out again after the base (`restack_kept`).
- `preparer`: `TurnPreparer`, which restores or rebuilds the cache and fits the window: a
  `PreparedTurn` (`prepared`: the template's ids of the turn and where its cache starts).
- `runner`: `TurnRunner`, which prepares a turn, submits it to the engine loop, streams its reply
  (`detokenizer`, `stop_strings`) and completes it.
- `completion`: `complete_turn`, the turn's outcome from what was generated (the cache after the
  turn, its layer rows, stats, the ids the transcript stores), with no model.

Nothing is imported here, so a module of the pipeline can be imported alone.
"""
