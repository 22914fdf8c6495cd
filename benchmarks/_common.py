"""Shared helpers of the chatkv benchmarks.

- `base_parser` / `setup`: common flags (`--quick`, `--threads`, `--device`, ...), thread count, seeds,
  and the real default model loaded once (`Engine`), warmed up so the first measurement does not pay
  for kernel initialisation.
- `environment_lines`: what was measured on (CPU, threads, versions, model, dtype, load average).
- `open_manager` / `temp_dir`: a `SessionManager` on a temporary chatkv home with a fixed master key,
  sharing the already loaded engine.
- `user_message` / `PARAGRAPHS`: fixed, deterministic user messages of a chosen token length.
- `naive_first_token`: the naive backend: re-template the whole conversation with
  `tokenizer.apply_chat_template` and re-prefill it with plain `transformers` (a fresh `DynamicCache`
  passed as `cache=`), returning the time to the first greedy token.
- `chatkv_server` / `stream_turn`: a real `chatkv serve` process on a benchmark home (this checkout's
  code, `CHATKV_*` settings of the benchmark's choosing) and one streamed chat-completions turn
  through the official `openai` client, timed to its first content chunk.
- `print_table`, `median`, `p95`, `fmt_*`: plain-text output.

Benchmarks run as scripts (`.venv/bin/python benchmarks/X.py`), so this module is imported as `_common`
with the repository root put on `sys.path` (the checkout is measured, not an installed copy).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from sessions.engine import Engine  # noqa: E402
from sessions.manager import SessionManager  # noqa: E402
from sessions.model_source import load_model  # noqa: E402
from sessions.settings import Settings  # noqa: E402

if TYPE_CHECKING:
    from openai import OpenAI

DEFAULT_MODEL_CACHE = Path(os.environ.get("CHATKV_BENCH_MODEL_CACHE", REPO / ".cache" / "models"))
BENCH_MASTER_KEY = "Y2hhdGt2LWJlbmNobWFyay1rZXktMzItYnl0ZXMhISE="  # base64 of 32 bytes; benchmarks only
SERVER_START_TIMEOUT_S = 300.0
SYSTEM_PROMPT = "You are a knowledgeable assistant. Answer questions about the texts the user shares."

# Fixed texts the user messages are cut from (written for these benchmarks; no external data).
PARAGRAPHS: tuple[str, ...] = (
    "The lighthouse on the northern cape was built in 1857 from granite quarried two miles inland. Its "
    "keepers lived in a stone cottage at the foot of the tower and kept a log of every ship that passed, "
    "the weather at each watch, and the oil burned by the lamp. In winter storms the spray reached the "
    "gallery ninety feet above the sea, and the keepers took turns polishing the lens through the night so "
    "that salt would not dim the beam. The light was automated in 1961, and the cottage became a museum.",
    "Sourdough bread relies on a culture of wild yeast and lactic acid bacteria. The baker feeds the starter "
    "with flour and water, waits until it rises and smells pleasantly sour, then mixes it into a dough with "
    "more flour, water and salt. Long, cool fermentation develops flavour and makes the crumb open and "
    "chewy. Shaping builds surface tension, scoring lets the loaf expand in a controlled way, and baking "
    "in a covered pot traps steam so the crust stays soft long enough for the bread to spring upward.",
    "A river delta forms where a river slows as it meets a larger body of water and drops the sediment it "
    "carried. Over centuries the channels split, shift and rejoin, building a fan of fertile land. Deltas "
    "host wetlands that filter water, shelter young fish and feed migrating birds. Dams upstream trap "
    "sediment, so many deltas now sink and shrink, while rising seas push salt water into farmland. "
    "Engineers try to divert controlled floods onto the marshes to rebuild them with fresh mud.",
    "The city library reopened after a two-year renovation. The reading room keeps its original oak tables "
    "and green lamps, but the stacks now use movable shelving that doubles the capacity of the basement. A "
    "new children's wing faces the park, with low windows and a reading nook shaped like a boat. The "
    "library lends tools, seeds and musical instruments as well as books, and volunteers run a repair "
    "café on Saturdays where people fix lamps, toasters and bicycles together.",
    "Honeybees communicate the location of food with the waggle dance. A forager returning to the hive runs "
    "a figure-eight pattern on the vertical comb; the angle of the straight run relative to vertical "
    "matches the angle between the food source and the sun, and the duration of the waggle encodes the "
    "distance. Other bees follow the dancer, smell the nectar she carries, and fly out to search. Colonies "
    "use the same dance to choose a new nest site when they swarm in spring.",
    "The mountain railway climbs nineteen hundred metres in eleven kilometres using a rack between the rails. "
    "A cog wheel under the locomotive meshes with the rack, so the train can climb gradients of nearly "
    "twenty-five percent without slipping. The line opened in 1893 and was electrified in 1930. In winter "
    "a rotary snow plough clears the track each morning before the first train, and passengers can watch "
    "ibex grazing on the slopes beside the upper stations.",
    "Composting turns kitchen scraps and garden waste into humus. Microbes need a balance of carbon-rich "
    "browns, such as dry leaves and cardboard, and nitrogen-rich greens, such as vegetable peelings and "
    "grass clippings. A pile that is moist like a wrung-out sponge and turned every week heats up to "
    "sixty degrees, which kills weed seeds. Worms finish the work in a cooler heap. After three to six "
    "months the compost is dark, crumbly and smells of forest soil.",
    "Early maritime navigators found latitude by measuring the height of the sun at noon or of the pole "
    "star at night, but longitude required knowing the time at a reference meridian. Marine chronometers, "
    "perfected in the eighteenth century, kept that time at sea despite temperature changes and the "
    "motion of the ship. Comparing local noon with the chronometer gave the longitude: each hour of "
    "difference meant fifteen degrees. Ships carried two or three chronometers to detect drift.",
    "A community orchard was planted on a former car park with forty fruit trees: apples, pears, plums and "
    "quinces, chosen from old local varieties. Volunteers removed the asphalt, brought in topsoil and "
    "planted wildflowers between the rows to attract pollinators. Every autumn the neighbourhood holds a "
    "harvest day with a shared apple press, and the juice is sold to pay for new trees. Children learn to "
    "graft branches in a winter workshop.",
    "Glaciers move because ice deforms under its own weight and slides over a film of meltwater at its "
    "base. As they flow they pluck rocks from the bedrock and grind them against the valley floor, carving "
    "U-shaped valleys, polishing slabs and leaving long scratches that show the direction of flow. When a "
    "glacier retreats it leaves moraines of mixed boulders and gravel, and lakes fill the hollows it "
    "scooped out. Many alpine glaciers have lost half their volume since 1900.",
    "The orchestra's new hall was designed around its acoustics. The audience sits in terraces that "
    "surround the stage like vineyards on a hillside, so no seat is more than thirty metres from the "
    "conductor. Curved panels of plaster and wood scatter sound evenly, and an adjustable canopy above "
    "the stage lets players hear one another. Before the opening, engineers fired starter pistols in the "
    "empty hall to measure reverberation and adjusted the panels by a few centimetres.",
    "Tidal pools are harsh homes. Twice a day the sea retreats, and the water left in the rocks warms in the "
    "sun, loses oxygen and grows saltier as it evaporates; then the waves return and churn everything. "
    "Anemones close into jelly-like blobs, snails seal their shells with a trapdoor, and crabs hide under "
    "ledges. Limpets return to the exact scar on the rock that fits their shell. Visitors are asked to put "
    "every stone back the way they found it.",
)
QUESTIONS: tuple[str, ...] = (
    "Summarise the text above in detail.",
    "Explain the main ideas of this text step by step.",
    "What are the most important facts in this passage? Describe each one.",
    "Rewrite the passage above as a short story for a child.",
    "List the key points of the text and explain why each matters.",
    "Describe what happens in this text, in your own words.",
)


# -- set-up ------------------------------------------------------------------------------------


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes (a development smoke run)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--model",
        default="default",
        help="default (the bundled SmolLM2-135M-Instruct), a model directory or a .gguf file; e.g. a "
        "random model of another size from benchmarks/random_model.py (speed only: its replies are noise)",
    )
    parser.add_argument("--model-cache-dir", type=Path, default=DEFAULT_MODEL_CACHE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    return parser


def setup(args: argparse.Namespace) -> Engine:
    """Threads, seeds, warnings; load the model (`--model`, the real default one unless told) once and
    warm it up."""
    # A deprecated call in our path (e.g. the old `past_key_values=` kwarg) must fail loudly.
    warnings.simplefilter("error", FutureWarning)
    warnings.simplefilter("error", DeprecationWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(load_model(args.model, args.model_cache_dir, device, args.dtype))
    warm_up(engine)
    return engine


def warm_up(engine: Engine) -> None:
    """One short prefill and a few decode steps outside any measurement (kernel and allocator set-up)."""
    ids = engine.tokenizer.encode(PARAGRAPHS[0], add_special_tokens=False)[:96]
    working = engine.empty_cache(None).to_working_cache(len(ids) + 8)
    from sessions.sampling import SamplingParams

    for _ in engine.generate(working, ids, SamplingParams(max_new_tokens=4)):
        pass
    naive_first_token(engine, [{"role": "user", "content": PARAGRAPHS[1]}])
    sync(engine)


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def settings_for(home: Path, model_cache_dir: Path, **overrides: Any) -> Settings:
    """Settings on `home` with a fixed master key and budgets large enough that nothing moves unless
    the benchmark says so."""
    values: dict[str, Any] = {
        "home": home,
        "model_cache_dir": model_cache_dir,
        "master_key": BENCH_MASTER_KEY,
        "device_budget_bytes": 8 * 2**30,
        "host_budget_bytes": 4 * 2**30,
        "disk_budget_bytes": 16 * 2**30,
        # The benchmarks measure the tiers they move caches to: always restore from them.
        "restore_or_recompute": False,
    }
    values.update(overrides)
    return Settings(**values)


def open_manager(home: Path, engine: Engine, model_cache_dir: Path, **overrides: Any) -> SessionManager:
    return SessionManager(settings_for(home, model_cache_dir, **overrides), engine=engine)


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"chatkv-bench-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- inputs ------------------------------------------------------------------------------------


def user_message(engine: Engine, index: int, target_tokens: int, question: str | None = None) -> str:
    """A deterministic user message of about `target_tokens` tokens: paragraphs from `PARAGRAPHS`,
    starting at `index` (cyclically), then a question that asks for a long-ish answer."""
    question = question or QUESTIONS[index % len(QUESTIONS)]
    parts: list[str] = []
    count = len(engine.tokenizer.encode(question, add_special_tokens=False))
    i = index
    while count < target_tokens:
        paragraph = PARAGRAPHS[i % len(PARAGRAPHS)]
        ids = engine.tokenizer.encode(paragraph, add_special_tokens=False)
        room = target_tokens - count
        if len(ids) > room:
            # cut at a word boundary near the remaining room
            text = engine.tokenizer.decode(ids[:room])
            paragraph = text.rsplit(" ", 1)[0] + "."
        parts.append(paragraph)
        count += len(ids)
        i += 1
    return "\n\n".join([*parts, question])


# -- the naive baseline ------------------------------------------------------------------------


def chat_messages(system_prompt: str | None, turns: Sequence[tuple[str, str]], user_text: str) -> list[dict[str, str]]:
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return [*messages, {"role": "user", "content": user_text}]


def naive_first_token(engine: Engine, messages: list[dict[str, str]]) -> tuple[float, int, int]:
    """The naive backend's time to first token: re-template the whole conversation, tokenise, prefill
    it from scratch with plain `transformers` (fresh `DynamicCache` passed as `cache=`, logits of the
    last position only, as `generate` does) and take the greedy token.

    Returns (seconds, first token id, context tokens).
    """
    model, tokenizer = engine.model, engine.tokenizer
    sync(engine)
    started = time.perf_counter()
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    input_ids = encoded["input_ids"].to(engine.device)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        token = int(torch.argmax(out.logits[0, -1]).item())
    seconds = time.perf_counter() - started
    return seconds, token, int(input_ids.shape[1])


def cached_forward_floor_s(engine: Engine, messages: list[dict[str, str]], new_tokens: int, repeats: int) -> float:
    """The model's own cost of a follow-up turn with perfect KV reuse: plain `transformers` with the
    whole history already in a `DynamicCache`, one forward pass of the last `new_tokens` tokens of
    the templated conversation and the greedy token (no templating, no chatkv). Median seconds of
    `repeats`; the cache is cropped back between repeats. No exact KV-reuse system can beat it."""
    model, tokenizer = engine.model, engine.tokenizer
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    input_ids = encoded["input_ids"].to(engine.device)
    cached = int(input_ids.shape[1]) - new_tokens
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=input_ids[:, :cached], cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(repeats):
            sync(engine)
            started = time.perf_counter()
            out = model(input_ids=input_ids[:, cached:], cache=cache, use_cache=True, logits_to_keep=1)
            int(torch.argmax(out.logits[0, -1]).item())
            times.append(time.perf_counter() - started)
            cache.crop(cached - cache.get_seq_length())  # transformers 5 crops by a negative count
    return median(times)


# -- a chatkv server over HTTP -----------------------------------------------------------------


@contextlib.contextmanager
def chatkv_server(home: Path, args: argparse.Namespace, settings: Mapping[str, str], log: Path) -> Iterator[str]:
    """`chatkv serve` on `home` (this checkout's code) until the block ends; yields its `/v1` URL.

    The server gets the benchmark's device, dtype, threads, model cache and budgets large enough that
    nothing moves, then `settings` (`CHATKV_*` variables, e.g. `{"CHATKV_REUSE_KV": "0"}`); no
    `CHATKV_*` variable of the caller's environment reaches it. Its output goes to `log`.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATKV_")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "GRADIO_ANALYTICS_ENABLED": "False",
            "CHATKV_HOME": str(home),
            "CHATKV_MODEL": args.model,
            "CHATKV_MODEL_CACHE_DIR": str(args.model_cache_dir),
            "CHATKV_MASTER_KEY": BENCH_MASTER_KEY,
            "CHATKV_DEVICE": args.device,
            "CHATKV_DTYPE": args.dtype,
            "CHATKV_DEVICE_BUDGET_BYTES": "8GiB",
            "CHATKV_HOST_BUDGET_BYTES": "4GiB",
            "CHATKV_DISK_BUDGET_BYTES": "16GiB",
            **({"CHATKV_THREADS": str(args.threads)} if args.threads else {}),
            **settings,
        }
    )
    command = [sys.executable, "-c", "from app.cli import main; main()", "serve", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url, process, log)
        yield f"{url}/v1"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_up(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"chatkv serve exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"chatkv serve did not answer within {SERVER_START_TIMEOUT_S} s:\n{log.read_text()}")


def stream_turn(client: OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed, greedy chat-completions turn. TTFT is from sending the request to the first
    chunk with content (seconds).

    Returns `ttft_s`, `text` (the reply as returned), `session_id` (the `X-Session-ID` header),
    `finish_reason`, and the usage: `prompt_tokens`, `cached_tokens`, `completion_tokens`.
    Raises `SystemExit` when the server sends no usage chunk.
    """
    started = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    usage = None
    finish_reason = None
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        session_id = response.headers["x-session-id"]
        for chunk in response.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    pieces.append(choice.delta.content)
                finish_reason = choice.finish_reason or finish_reason
    if usage is None or usage.prompt_tokens_details is None:
        raise SystemExit("the server sent no usage chunk")
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - started,
        "text": "".join(pieces),
        "session_id": session_id,
        "finish_reason": finish_reason,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens or 0,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
    }


# -- page cache --------------------------------------------------------------------------------


def resident_bytes(path: Path) -> int | None:
    """Bytes of `path` in the page cache (mincore), or `None` if it cannot be told."""
    size = path.stat().st_size
    if size == 0:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page = os.sysconf("SC_PAGE_SIZE")
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            rc = libc.mincore(ctypes.c_void_p(addr), size, vec)
            libc.munmap(ctypes.c_void_p(addr), size)
            if rc != 0:
                return None
            return min(size, sum(1 for b in vec if b & 1) * page)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return None


def drop_page_cache(paths: Sequence[Path], verify_skip: Sequence[str] = (".db-shm",)) -> str:
    """Evict `paths` from the page cache. Tries `echo 1 > /proc/sys/vm/drop_caches` (root only), then
    `posix_fadvise(DONTNEED)` per file; returns which method worked, verified with mincore (except
    for files ending in `verify_skip`: SQLite's shared-memory file stays mapped while open)."""
    os.sync()
    method = "none"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        method = "drop_caches"
    except OSError:
        for path in paths:
            with contextlib.suppress(OSError, AttributeError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    method = "fadvise(DONTNEED)"
                finally:
                    os.close(fd)
    checked = [p for p in paths if p.suffix not in verify_skip]
    total = sum(p.stat().st_size for p in checked)
    resident = [resident_bytes(p) for p in checked]
    if any(r is None for r in resident):
        return f"{method} (unverified: mincore unavailable)"
    left = sum(r for r in resident if r is not None)
    verdict = "verified not resident" if left == 0 else f"NOT dropped: {left} of {total} bytes still resident"
    return f"{method}, {verdict}"


# -- output ------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def p95(values: Sequence[float]) -> float:
    """The 95th percentile (nearest rank)."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))])


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def fmt_mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f} MB"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    print()
    print(title)
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()


def _cpu_model() -> str:
    name, family, model = platform.processor() or "unknown CPU", "", ""
    with contextlib.suppress(OSError):
        for raw in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = raw.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and name in ("unknown CPU", platform.processor()):
                name = value
            elif key == "cpu family" and not family:
                family = value
            elif key == "model" and not model:
                model = value
    detail = f" (family {family}, model {model})" if family else ""
    return f"{name}{detail}, {os.cpu_count()} logical CPUs"


def _git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
        return rev + (" + uncommitted changes" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment_lines(engine: Engine) -> list[str]:
    device = str(engine.device)
    if engine.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(engine.device)})"
    return [
        f"date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; host: {platform.node()}",
        f"cpu: {_cpu_model()}; torch threads: {torch.get_num_threads()}; "
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
        f"model: {engine.loaded.name} ({engine.layout.num_model_layers} model layers, "
        f"{engine.layout.kv_heads} KV heads x {engine.layout.head_dim}, "
        f"{engine.layout.bytes_per_token} KV bytes/token), dtype {engine.dtype}, device {device}",
        f"chatkv checkout: {_git_revision()}",
    ]


def print_header(title: str, engine: Engine, what: Sequence[str]) -> None:
    print(title)
    print("=" * len(title))
    for line in environment_lines(engine):
        print(line)
    for line in what:
        print(line)
    sys.stdout.flush()


def write_json(path: Path | None, payload: dict[str, Any], engine: Engine) -> None:
    if path is None:
        return
    payload = {"environment": environment_lines(engine), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"\nresults written to {path}")
