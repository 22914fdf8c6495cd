"""Where one chatkv engine decode step spends its time on a GPU, and what switching off cuDNN attention
(`packed_attention.without_cudnn_attention`) and block-diagonal decode steps
(`PackedBatch.block_diagonal`) change there. For the device machine
(`benchmarks/device_profile.sh` installs what it needs and makes the random model); it also runs on
a CPU with a tiny model (the smoke run), where the CUDA-only parts say they are skipped.

1. **SDPA per call** (no model): one decode query `[1, 9, 1, 64]` over a `[1, 3, L, 64]` view of a
   preallocated buffer, as the packed attention calls it; host ms per call when every call has the
   same L, and when each call has a new L (a decode step's buffers grow by one token), per backend
   (torch's default choice, cuDNN, flash, memory-efficient, math); and which aten op the default
   picks without and with a mask, with cuDNN allowed and with it switched off.
2. **Before / after**: median decode step ms at each N with cuDNN attention allowed and attention per
   request (before), cuDNN off, and cuDNN off with block-diagonal decode steps (after, this branch's
   CUDA default); the generated tokens compared, the largest logit difference of the first steps
   (before vs after; and a request alone vs in a step of 8); beside them transformers' padded batch
   step (`engine_step.py`'s baseline) with cuDNN allowed and off.
3. **Syncs**: `torch.cuda.set_sync_debug_mode("warn")` over decode steps at N = 1 and N = 8: syncs
   per step and where (the innermost frames of chatkv and transformers).
4. **Profiler**: `torch.profiler` over 3 decode steps at N = 8 (after warm-up steps): the top ops by
   self CPU time and by self device time (after), and the top self-CPU ops before; a Chrome trace
   in `--out`.

Sections run in that order (the most telling first); a failing section prints why and the next runs.

    python benchmarks/device_profile.py --model DIR --device cuda --dtype bfloat16 [--out DIR]
"""

from __future__ import annotations

import collections
import contextlib
import functools
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import base_parser, print_header, sync
from engine_step import histories, queued_loop, transformers_steps
from torch.nn.attention import SDPBackend, sdpa_kernel

from sessions.engine import Engine
from sessions.engine import loop as loop_module
from sessions.engine import model_runner as runner_module
from sessions.engine.batch import pack
from sessions.engine.loop import EngineLoop
from sessions.engine.packed_attention import without_cudnn_attention

REPO = Path(__file__).resolve().parent.parent
BACKENDS: dict[str, list[SDPBackend] | None] = {
    "default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


VARIANTS = {
    "before": "cuDNN attention allowed, attention per request (the engine before this branch)",
    "no cuDNN": "cuDNN attention off, attention per request",
    "after": "cuDNN attention off, decode steps block-diagonal (this branch's CUDA default)",
}


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The engine as `VARIANTS[name]` describes, by swapping what `ModelRunner.forward` and the loop's
    `pack` look up at each step."""
    saved_switch, saved_pack = runner_module.without_cudnn_attention, loop_module.pack

    @contextlib.contextmanager
    def leave_alone(device: torch.device) -> Iterator[None]:
        yield

    try:
        if name == "before":
            runner_module.without_cudnn_attention = leave_alone
        if name in ("before", "no cuDNN"):
            loop_module.pack = functools.partial(pack, block_diagonal=False)
        yield
    finally:
        runner_module.without_cudnn_attention = saved_switch
        loop_module.pack = saved_pack


# -- 1. SDPA per call ----------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sdpa_ms_per_call(
    device: torch.device, dtype: torch.dtype, backends: list[SDPBackend] | None, base: int, new_lengths: bool
) -> str:
    """Host ms per SDPA call over 30 calls (synchronised at both ends), or the error's first line."""
    calls = 30
    q = torch.randn(1, 9, 1, 64, device=device, dtype=dtype)
    k = torch.randn(1, 3, base + calls + 8, 64, device=device, dtype=dtype)
    v = torch.randn_like(k)
    context = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    try:
        with context:
            F.scaled_dot_product_attention(q, k[:, :, :base], v[:, :, :base], enable_gqa=True)  # warm-up
            _synchronize(device)
            began = time.perf_counter()
            for i in range(calls):
                n = base + (i + 1 if new_lengths else 0)
                F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)
            _synchronize(device)
    except RuntimeError as exc:
        return "fails: " + str(exc).splitlines()[0][:60]
    return f"{(time.perf_counter() - began) / calls * 1000:.3f}"


def chosen_ops(device: torch.device, dtype: torch.dtype, masked: bool) -> str:
    """The aten attention ops one default SDPA call runs (decode shapes, 300 keys)."""
    q = torch.randn(1, 9, 1, 64, device=device, dtype=dtype)
    k = torch.randn(1, 3, 300, 64, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(1, 300, dtype=torch.bool, device=device) if masked else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    names = {e.key for e in prof.key_averages() if "attention" in e.key and e.key.startswith("aten::_")}
    return ", ".join(sorted(names)) or "(no fused op: math)"


def section_sdpa(device: torch.device, dtype: torch.dtype) -> None:
    print("\n## 1. SDPA per call, one decode query [1, 9, 1, 64] over [1, 3, L, 64] views (host ms per call)")
    print(f"cuDNN {torch.backends.cudnn.version()}; flags: cudnn_sdp {torch.backends.cuda.cudnn_sdp_enabled()}")
    print(f"{'backend':<10} {'same L':>10} {'new L each call':>16}")
    for i, (name, backends) in enumerate(BACKENDS.items()):
        if device.type != "cuda" and name in ("cudnn", "flash", "efficient"):
            continue
        base = 300 + 100 * i  # lengths no earlier row used (cuDNN caches a graph per length)
        same = sdpa_ms_per_call(device, dtype, backends, base, new_lengths=False)
        new = sdpa_ms_per_call(device, dtype, backends, base, new_lengths=True)
        print(f"{name:<10} {same:>10} {new:>16}")
    for masked in (False, True):
        allowed = chosen_ops(device, dtype, masked)
        with without_cudnn_attention(device):
            off = chosen_ops(device, dtype, masked)
        print(f"default op, {'bool mask' if masked else 'no mask'}: cuDNN allowed -> {allowed}; cuDNN off -> {off}")


# -- the engine's decode steps -------------------------------------------------------------------


def step(loop: EngineLoop) -> None:
    plan = loop._scheduler.schedule()
    loop._release(plan)
    loop._step(plan)


def timed_steps(engine: Engine, loop: EngineLoop, steps: int) -> list[float]:
    walls = []
    for _ in range(steps):
        sync(engine)
        began = time.perf_counter()
        step(loop)
        sync(engine)
        walls.append(time.perf_counter() - began)
    return walls


# -- 3. syncs ------------------------------------------------------------------------------------


def _where(frames: list[traceback.FrameSummary]) -> str:
    """The innermost three frames of chatkv or transformers, innermost first."""
    mine = [f for f in frames if str(REPO) in f.filename or "transformers" in f.filename]
    shown = []
    for f in reversed(mine[-3:]):
        path = f.filename.split("/transformers/")[-1] if "/transformers/" in f.filename else f.filename
        shown.append(f"{Path(path).name}:{f.lineno} {f.name}")
    return " < ".join(shown) or "(outside chatkv and transformers)"


def _count_sync(where: collections.Counter[str], *args: Any, **kwargs: Any) -> None:
    """`warnings.showwarning` while the sync debug mode warns: count the sync where it happened."""
    where[_where(traceback.extract_stack()[:-2])] += 1


def section_syncs(engine: Engine, history_tokens: int) -> None:
    print("\n## 3. Host-device syncs per decode step (torch.cuda.set_sync_debug_mode('warn'))")
    if engine.device.type != "cuda":
        print("skipped: needs CUDA")
        return
    steps = 3
    for n in (1, 8):
        loop, _ = queued_loop(engine, histories(engine, n, history_tokens), steps + 2)
        step(loop)  # warm-up
        sync(engine)
        where: collections.Counter[str] = collections.Counter()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = functools.partial(_count_sync, where)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    step(loop)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        total = sum(where.values())
        print(f"N={n}: {total / steps:.1f} syncs per step; where (per step):")
        for key, count in where.most_common(8):
            print(f"  {count / steps:6.1f}  {key}")


# -- 4. profiler ---------------------------------------------------------------------------------


def section_profile(engine: Engine, history_tokens: int, out: Path | None) -> None:
    n = 8
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    runs = (("after", ("self_cpu_time_total", "device"), 25), ("before", ("self_cpu_time_total",), 10))
    for name, sort_keys, rows in runs:
        with variant(name):
            loop, _ = queued_loop(engine, histories(engine, n, history_tokens), 8)
            step(loop)
            step(loop)
            sync(engine)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    step(loop)
                sync(engine)
        table = prof.key_averages()
        for key in sort_keys:
            if key == "device":
                if engine.device.type != "cuda":
                    continue
                # torch 2.4 renamed the CUDA columns "device"; the older key for an older torch.
                renamed = hasattr(table[0], "self_device_time_total")
                key = "self_device_time_total" if renamed else "self_cuda_time_total"
            print(f"\n## 4. Profiler, 3 decode steps at N={n}, {name} ({VARIANTS[name]}): top {rows} by {key}")
            print(table.table(sort_by=key, row_limit=rows, max_name_column_width=48))
        if out is not None and name == "after":
            try:
                prof.export_chrome_trace(str(out / "device_profile_trace_n8.json.gz"))
            except (OSError, RuntimeError) as exc:
                print(f"no Chrome trace: {exc}")


# -- 2. before / after ---------------------------------------------------------------------------


def decode(engine: Engine, name: str, rows: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Median step ms after one warm-up step, and each request's generated tokens."""
    with variant(name):
        loop, requests = queued_loop(engine, rows, steps + 1)
        step(loop)
        walls = timed_steps(engine, loop, steps)
    return statistics.median(walls) * 1000, [r.generated for r in requests]


def first_logits(engine: Engine, name: str, rows: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Per request, the `[steps, vocab]` logits it sampled from in the first steps."""
    with variant(name):
        loop, requests = queued_loop(engine, rows, steps, keep_logits=True)
        for _ in range(steps):
            step(loop)
    return [torch.stack(r.sampled_logits or []) for r in requests]


def transformers_ms(engine: Engine, rows: list[list[int]], steps: int, cudnn_off: bool) -> float:
    context = without_cudnn_attention(engine.device) if cudnn_off else contextlib.nullcontext()
    with context:
        return statistics.median(transformers_steps(engine, rows, steps)) * 1000


def section_before_after(engine: Engine, sessions: list[int], steps: int, history_tokens: int) -> None:
    print(f"\n## 2. Decode step ms (median of {steps} after a warm-up step), by variant:")
    for name, what in VARIANTS.items():
        print(f"   {name}: {what}")
    print("   transformers: its padded batch step (engine_step.py's baseline), cuDNN attention allowed / off")
    print(
        f"{'N':>3} {'before':>8} {'no cuDNN':>9} {'after':>8} {'before/after':>12} {'tokens same':>11}"
        f" {'transformers':>12} {'trf no cuDNN':>12}"
    )
    for n in sessions:
        rows = histories(engine, n, history_tokens)
        ms = {}
        tokens = {}
        for name in VARIANTS:
            ms[name], tokens[name] = decode(engine, name, rows, steps)
        same = sum(a == b for a, b in zip(tokens["before"], tokens["after"], strict=True))
        plain = transformers_ms(engine, rows, steps, cudnn_off=False)
        plain_off = transformers_ms(engine, rows, steps, cudnn_off=True)
        print(
            f"{n:>3} {ms['before']:>8.1f} {ms['no cuDNN']:>9.1f} {ms['after']:>8.1f}"
            f" {ms['before'] / ms['after']:>11.2f}x {f'{same}/{n}':>11} {plain:>12.1f} {plain_off:>12.1f}"
        )
    rows = histories(engine, 8, history_tokens)
    before, after = first_logits(engine, "before", rows, 3), first_logits(engine, "after", rows, 3)
    alone = first_logits(engine, "after", rows[:1], 3)
    diff = max(float((a - b).abs().max()) for a, b in zip(before, after, strict=True))
    print(f"largest |logit before - logit after|, N=8, first 3 steps: {diff:.3g}")
    diff = float((alone[0] - after[0]).abs().max())
    print(f"request 0 alone vs in the step of 8 (after), first 3 steps: largest |logit difference| {diff:.3g}")


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--history-tokens", type=int, default=300)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="folder for the profiler's Chrome trace")
    parser.add_argument("--skip", nargs="*", default=[], choices=["sdpa", "compare", "syncs", "profile"])
    args = parser.parse_args()
    from _common import setup

    engine = setup(args)
    print_header(
        "chatkv: where a decode step's time goes on the device",
        engine,
        [
            f"{args.history_tokens}-token histories, greedy; "
            f"cuDNN attention enabled at start: {torch.backends.cuda.cudnn_sdp_enabled()}"
        ],
    )
    # The most telling first: a run cut short by its time limit still has them.
    sections: dict[str, Callable[[], None]] = {
        "sdpa": lambda: section_sdpa(engine.device, engine.dtype),
        "compare": lambda: section_before_after(engine, args.sessions, args.steps, args.history_tokens),
        "syncs": lambda: section_syncs(engine, args.history_tokens),
        "profile": lambda: section_profile(engine, args.history_tokens, args.out),
    }
    for name, run in sections.items():
        if name in args.skip:
            continue
        began = time.perf_counter()
        # A diagnosis run has one try on the device: a failing section says why and the next runs.
        try:
            run()
        except Exception:  # noqa: BLE001
            print(f"FAILED section {name}:\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-12:]))
        print(f"-- {name}: {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
