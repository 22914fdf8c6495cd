"""What a manager's start-up tells the operator, as it happens (issue 28: a start-up silent for 10-20 s).

At `info`, one line per step of `sessions.assembly.assemble`, before the slow ones: the database
(its URL without the password), the model being loaded (name, device, dtype) and then what it is
(model layers, context, KV bytes per token, fingerprint, seconds taken), the tier budgets (and
which were derived from the machine), the context window, the engine loop's limits, the Redis tier
and the disk blobs found, and the whole start-up's time. At `debug`, the finer facts (the scheduler's
every limit, the master key's source). Everything here only formats and logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from sessions.engine import Engine, SchedulerConfig
from sessions.settings import RedisConfig, TierConfig, WindowConfig

log = logging.getLogger("sessions.startup")


def size(nbytes: int) -> str:
    """`nbytes` for a person: `512 B`, `12.0 MiB`, `1.5 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def safe_url(url: str) -> str:
    """`url` with any password masked (a database or Redis URL may carry one)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("@")[-1] if "@" in url else url


@contextmanager
def step(message: str, *args: object) -> Iterator[None]:
    """Log `message` at info now, and at debug how long the block took once it is done."""
    log.info(message, *args)
    started = time.perf_counter()
    yield
    log.debug("%s: done in %.2f s", message % args, time.perf_counter() - started)


def model_loading(model: str, device: str, dtype: str) -> float:
    """Log the model about to load; return the time, for `model_loaded`."""
    log.info("loading model %s on %s as %s", model, device, dtype)
    return time.perf_counter()


def model_loaded(engine: Engine, started: float) -> None:
    layout = engine.layout
    log.info(
        "model %s loaded in %.1f s: %d model layers, context %d tokens, %d KV bytes per token, fingerprint %s",
        engine.loaded.name,
        time.perf_counter() - started,
        layout.num_model_layers,
        engine.max_context_tokens,
        layout.bytes_per_token,
        engine.fingerprint[:16],
    )


def budgets(tiers: TierConfig, derived: frozenset[str]) -> None:
    def given(name: str, nbytes: int) -> str:
        return f"{size(nbytes)}{' (derived)' if name in derived else ''}"

    log.info(
        "tier budgets: device %s (tenant quota %s), host %s, disk %s; caches persisted %s, offloaded %s",
        given("device_budget_bytes", tiers.device_budget_bytes),
        given("tenant_device_quota_bytes", tiers.tenant_device_quota_bytes),
        given("host_budget_bytes", tiers.host_budget_bytes),
        given("disk_budget_bytes", tiers.disk_budget_bytes),
        "after each turn (write-back)" if tiers.write_back else "on eviction",
        tiers.offload_precision,
    )


def window(config: WindowConfig, budget_tokens: int, context_tokens: int, scheduler: SchedulerConfig) -> None:
    lossy = config.window_policy in ("attention", "agnostic")
    log.info(
        "context window %d of the model's %d tokens (policy %s%s); engine loop: %d tokens per step (%d of them "
        "prefill), %d running requests",
        budget_tokens,
        context_tokens,
        config.window_policy,
        f", {config.window_budget_allocation.replace('_', '-')} budgets" if lossy else "",
        scheduler.max_step_tokens,
        scheduler.max_prefill_tokens,
        scheduler.max_running_requests,
    )
    log.debug("engine loop limits: %s", scheduler)


def redis_tier(config: RedisConfig | None) -> None:
    if config is None:
        log.debug("no Redis tier (CHATKV_REDIS_URL unset): a single process")
        return
    log.info(
        "redis tier %s%s (prefix %s, TTL %.0f s, budget %s); connects on first use",
        safe_url(config.redis_url),
        " (cluster)" if config.redis_cluster else "",
        config.redis_prefix,
        config.redis_ttl_s,
        size(config.redis_budget_bytes) if config.redis_budget_bytes else "none",
    )


def disk_blobs(found: int, folder: object) -> None:
    log.info("disk tier: %d cached blob%s found in %s", found, "" if found == 1 else "s", folder)


def ready(started: float) -> None:
    log.info("sessions ready: start-up took %.1f s", time.perf_counter() - started)
