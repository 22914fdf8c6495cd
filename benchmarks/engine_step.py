"""Where the time of one engine decode step goes, against plain transformers' padded batch step.

N requests with about `--history-tokens` cached tokens each decode together (greedy). Per N, in one
run on one loaded model, the median over `--steps` steps of:

- **chatkv step**, split into its parts: `schedule` (the scheduler's plan), `pack` (input ids,
  positions, segments), `kv write` (`StepCache.update`: each request's new keys and values into its
  buffer), `attention` (the packed attention of every model layer, masks included), `model rest`
  (the forward pass minus those two: projections, MLP, norms, RoPE, the LM head), `postprocess`
  (sampling, stop checks, channels);
- **transformers step**: one decode forward pass of the same N requests as a left-padded batch over
  a `DynamicCache` (`cache=`), plus its argmax, as `benchmarks/concurrency.py`'s baseline runs it.

The loop runs in the calling thread with torch's intra-op threads (`--threads 1`), and every figure
is that thread's CPU time (`time.thread_time`), so other processes on a shared machine slow the
figures far less than wall time. The parts are timed by wrapping them in this process only (one
clock read pair per call). On CUDA (`--device cuda`) the kernels run asynchronously, so every figure
is wall time (`time.perf_counter`) instead, with the device synchronised at the start and end of each
step: `step` and `transformers` are then the whole steps' times, and a part is the host's time in
its calls (launches; the GPU work they queue lands in whichever part next waits for it, mostly
`postprocess`, whose sampling reads the token).

    .venv/bin/python benchmarks/engine_step.py --threads 1 [--sessions 1 8 16] [--steps 20]
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from _common import base_parser, print_header, print_table, setup, sync
from transformers import DynamicCache

from cache.ids import TenantId
from sessions.engine import Engine
from sessions.engine import batch as batch_module
from sessions.engine import loop as loop_module
from sessions.engine import model_runner as runner_module
from sessions.engine.config import SchedulerConfig
from sessions.engine.loop import EngineLoop
from sessions.engine.request import Request
from sessions.sampling import SamplingParams

PARTS = ("schedule", "pack", "kv write", "attention", "model rest", "postprocess")


class Clock:
    """Seconds spent per part during the current step, read from `now` (thread CPU time on a CPU, wall
    time on a GPU)."""

    def __init__(self, now: Callable[[], float] = time.thread_time) -> None:
        self.now = now
        self.spent: dict[str, float] = collections.defaultdict(float)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        began = self.now()
        try:
            yield
        finally:
            self.spent[name] += self.now() - began

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return fn(*args, **kwargs)

        return timed


@contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Wrap the step's parts (kv write, attention, pack) with `clock` for the duration."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = [n for n in ALL_ATTENTION_FUNCTIONS if n.startswith("chatkv_packed_")]
    saved_attention = {n: ALL_ATTENTION_FUNCTIONS[n] for n in names}
    saved_update = batch_module.StepCache.update
    saved_pack = loop_module.pack
    try:
        for n in names:
            ALL_ATTENTION_FUNCTIONS[n] = clock.wrap("attention", saved_attention[n])
        batch_module.StepCache.update = clock.wrap("kv write", saved_update)  # type: ignore[method-assign]
        loop_module.pack = clock.wrap("pack", saved_pack)
        yield
    finally:
        for n in names:
            ALL_ATTENTION_FUNCTIONS[n] = saved_attention[n]
        batch_module.StepCache.update = saved_update  # type: ignore[method-assign]
        loop_module.pack = saved_pack


def histories(engine: Engine, n: int, tokens: int) -> list[list[int]]:
    """N distinct deterministic histories of about `tokens` ids (lengths differ a little, as real ones)."""
    vocab = engine.tokenizer.vocab_size
    rows = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        rows.append(torch.randint(100, vocab - 100, (tokens - 8 + (i * 5) % 17,), generator=g).tolist())
    return rows


def clock_for(engine: Engine) -> Callable[[], float]:
    """Thread CPU time on a CPU; wall time where kernels run asynchronously (CUDA)."""
    return time.perf_counter if engine.device.type == "cuda" else time.thread_time


def queued_loop(
    engine: Engine, rows: list[list[int]], steps: int, keep_logits: bool = False
) -> tuple[EngineLoop, list[Request]]:
    """An engine loop driven from the caller's thread, with one request per row: all of the row
    but its last id prefilled, the last queued, room for `steps` decode steps."""
    loop = EngineLoop(engine.runner.forward, engine.device, SchedulerConfig())
    params = SamplingParams(max_new_tokens=steps + 4, ignore_eos=True)
    requests = []
    for i, row in enumerate(rows):
        working = engine.empty_cache(None).to_working_cache(len(row) + steps + 8)
        engine.prefill(working, row[:-1])
        request = Request(
            tenant_id=TenantId(f"t{i}"),
            prefill_ids=row[-1:],
            params=params,
            working=working,
            stop_token_ids=engine.stop_token_ids,
            keep_logits=keep_logits,
        )
        loop._scheduler.add(request)
        requests.append(request)
    return loop, requests


def chatkv_steps(engine: Engine, rows: list[list[int]], steps: int) -> tuple[list[dict[str, float]], list[float]]:
    """Per step: seconds per part, and the step's time. The loop runs in this thread."""
    loop, _ = queued_loop(engine, rows, steps)
    now = clock_for(engine)
    clock = Clock(now)
    parts, walls = [], []
    with instrumented(clock):
        for _ in range(steps):
            clock.spent.clear()
            sync(engine)
            began = now()
            with clock.part("schedule"):
                plan = loop._scheduler.schedule()
                loop._release(plan)
            forward_began = now()
            postprocess = loop._postprocess
            loop._postprocess = clock.wrap("postprocess", postprocess)  # type: ignore[method-assign]
            loop._step(plan)
            loop._postprocess = postprocess  # type: ignore[method-assign]
            sync(engine)
            ended = now()
            wall = ended - began
            inner = ended - forward_began - clock.spent["pack"] - clock.spent["postprocess"]
            clock.spent["model rest"] = inner - clock.spent["kv write"] - clock.spent["attention"]
            parts.append(dict(clock.spent))
            walls.append(wall)
    return parts, walls


@torch.inference_mode()
def transformers_steps(engine: Engine, rows: list[list[int]], steps: int) -> list[float]:
    """Wall time of each padded-batch decode step (forward + argmax) after a padded prefill."""
    width = max(len(r) for r in rows)
    pad = engine.stop_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=engine.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=engine.device)
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = engine.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
    )
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    now = clock_for(engine)
    walls = []
    for _ in range(steps):
        sync(engine)
        began = now()
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        positions = positions[:, -1:] + 1
        out = engine.model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(engine)
        walls.append(now() - began)
    return walls


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--history-tokens", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.steps = [1, 4], 5
    engine = setup(args)
    assert runner_module  # the runner's forward is what the loop calls
    print_header(
        "chatkv: one engine decode step, by part, against transformers' padded batch step",
        engine,
        [
            f"{args.history_tokens}-token histories, greedy, median of {args.steps} steps; "
            + ("wall time, synchronised per step" if engine.device.type == "cuda" else "thread CPU time")
        ],
    )
    table = []
    for n in args.sessions:
        rows = histories(engine, n, args.history_tokens)
        parts, walls = chatkv_steps(engine, rows, args.steps)
        plain = statistics.median(transformers_steps(engine, rows, args.steps))
        ours = statistics.median(walls)
        medians = [statistics.median(p.get(name, 0.0) for p in parts) for name in PARTS]
        overhead = ours - medians[PARTS.index("model rest")] - medians[PARTS.index("attention")]
        table.append([n, *(ms(m) for m in medians), ms(ours), ms(overhead), ms(plain), f"{ours / plain:.2f}x"])
    print_table(
        "decode step, ms (median); overhead = step - attention - model rest",
        ["N", *(f"{p} ms" for p in PARTS), "step ms", "overhead ms", "transformers ms", "step / transformers"],
        table,
    )


if __name__ == "__main__":
    main()
