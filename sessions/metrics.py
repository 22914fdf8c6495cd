"""Prometheus metrics of one `SessionManager` (its own registry, so several managers never clash).

Counters move as turns run; tier gauges are read at scrape time from the tier manager. Per-tenant
labels appear only with `Settings.metrics_tenant_labels` (bounded tenant counts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache.budgets import TierUsage
from cache.ids import TenantId
from cache.tiers import LOCAL_TIERS, Tier
from sessions.engine.loop import BUSY_WINDOW_S, LoopStats
from sessions.records import RestoreSource

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)
_TO = ("host", "disk", "dropped")


class _TierCollector(Collector):
    def __init__(self, usage: Callable[[], TierUsage]) -> None:
        self._usage = usage

    def collect(self) -> Iterable[GaugeMetricFamily]:
        usage = self._usage()
        size = GaugeMetricFamily("chatkv_tier_bytes", "Bytes of KV cache held per tier", labels=["tier"])
        count = GaugeMetricFamily("chatkv_tier_sessions", "Session caches held per tier", labels=["tier"])
        budget = GaugeMetricFamily("chatkv_tier_budget_bytes", "Byte budget per tier", labels=["tier"])
        ratio = GaugeMetricFamily("chatkv_tier_budget_usage_ratio", "Bytes held / budget per tier", labels=["tier"])
        for tier in LOCAL_TIERS:
            size.add_metric([tier.value], usage.bytes[tier])
            count.add_metric([tier.value], usage.sessions[tier])
            budget.add_metric([tier.value], usage.budgets[tier])
            ratio.add_metric([tier.value], usage.bytes[tier] / max(1, usage.budgets[tier]))
        yield from (size, count, budget, ratio)


class _EngineCollector(Collector):
    """Gauges read from the engine loop (and the turns being prepared for it) at scrape time."""

    def __init__(
        self, stats: Callable[[], LoopStats], preparing: Callable[[], Mapping[TenantId, int]], tenant_labels: bool
    ) -> None:
        self._stats = stats
        self._preparing = preparing
        self._tenant_labels = tenant_labels

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stats = self._stats()
        label = ["tenant"]
        running = GaugeMetricFamily(
            "chatkv_requests_running",
            "Turns running: in the engine loop, or being prepared for it (restore, template, window)",
            labels=label,
        )
        waiting = GaugeMetricFamily("chatkv_requests_waiting", "Turns waiting for admission", labels=label)
        running_counts: dict[TenantId, int] = dict(stats.running)
        for tenant, count in self._preparing().items():
            running_counts[tenant] = running_counts.get(tenant, 0) + count
        for family, counts in ((running, running_counts), (waiting, stats.waiting)):
            if self._tenant_labels:
                for tenant, count in sorted(counts.items()):
                    family.add_metric([tenant], count)
            else:  # one series for all tenants: tenant ids are unbounded label values
                family.add_metric(["*"], sum(counts.values()))
        busy = GaugeMetricFamily(
            "chatkv_engine_busy_ratio",
            f"Share of the last {BUSY_WINDOW_S:.0f} s of wall time the engine loop spent in forward passes",
        )
        busy.add_metric([], stats.busy_fraction)
        yield from (running, waiting, busy)


class _ReplicaLabelled(Collector):
    """Every sample of `inner` with a `replica` label added: replicas behind one load balancer
    stay apart even when scraped through one address (Prometheus's own `instance` label then
    names the balancer, not the replica)."""

    def __init__(self, inner: CollectorRegistry, replica: str) -> None:
        self._inner, self._replica = inner, replica

    def collect(self) -> Iterable[Metric]:
        for family in self._inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                sample._replace(labels={**sample.labels, "replica": self._replica}) for sample in family.samples
            ]
            yield labelled


class Metrics:
    """Counters and histograms of turns and tiers; also the tier manager's `TierEvents`.

    Args:
        tenant_labels: label per-tenant series with the tenant id.
        replica: this replica's id, added as a `replica` label to every series (replicas only).
    """

    def __init__(self, tenant_labels: bool = False, replica: str | None = None) -> None:
        # Over 60 lines: the metric declarations, one per series, read best as one list.
        self.registry = CollectorRegistry(auto_describe=True)
        self._exposed = self.registry
        if replica is not None:
            self._exposed = CollectorRegistry(auto_describe=False)
            self._exposed.register(_ReplicaLabelled(self.registry, replica))
        self._tenant_labels = tenant_labels
        r = self.registry
        self.cache_queries = Counter(
            "chatkv_cache_queries", "Prompt tokens or turns looked up in the cache", ["unit"], registry=r
        )
        self.cache_hits = Counter(
            "chatkv_cache_hits",
            "Prompt tokens served from cache, or turns with any reuse",
            ["unit"],
            registry=r,
        )
        self.prefill_tokens = Counter("chatkv_prefill_tokens", "Tokens run through the model in prefill", registry=r)
        self.prefill_tokens_saved = Counter(
            "chatkv_prefill_tokens_saved", "Prompt tokens not prefilled because they were cached", registry=r
        )
        self.decode_tokens = Counter("chatkv_decode_tokens", "Tokens generated", registry=r)
        self.turns = Counter(
            "chatkv_turns", "Completed turns by where the cache came from", ["restored_from"], registry=r
        )
        self.tenant_turns = Counter("chatkv_tenant_turns", "Completed turns per tenant", ["tenant"], registry=r)
        self.prompt_tokens = Counter(
            "chatkv_prompt_tokens",
            "Prompt tokens of completed turns: served from the cache (source=cache) or prefilled "
            "(source=prefill), per tenant (tenant=* without tenant labels)",
            ["tenant", "source"],
            registry=r,
        )
        self.forks = Counter(
            "chatkv_forks",
            "Sessions forked from another's prefix, by where the fork's cache came from "
            "(device, host, disk, redis; rebuilt: prefilled from the transcript)",
            ["source"],
            registry=r,
        )
        self.restore_choices = Counter(
            "chatkv_restore_choices",
            "Turns whose cache was in a lower tier, by what they did: restore it, or recompute (prefill "
            "its tokens again, estimated cheaper)",
            ["choice"],
            registry=r,
        )
        self.routes = Counter(
            "chatkv_routes",
            "Turns asked of this replica, by where they ran: local; forward (to the session's owner, or "
            "away from this draining replica); handover (here, once the owner handed the session over); "
            "forward_failed (the owner could not be reached: handed over)",
            ["route"],
            registry=r,
        )
        self._tenant_tokens: dict[str, tuple[int, int]] = {}
        self._tenant_tokens_lock = threading.Lock()
        self.evictions = Counter(
            "chatkv_evictions",
            "Caches moved down a tier (to=dropped: discarded)",
            ["source", "target"],
            registry=r,
        )
        self.restores = Counter("chatkv_restores", "Caches restored to the device by source tier", ["tier"], registry=r)
        self.integrity_failures = Counter(
            "chatkv_integrity_failures",
            "Stored blobs that failed authentication or decoding",
            ["tier"],
            registry=r,
        )
        self.restore_seconds = Histogram(
            "chatkv_restore_seconds",
            "Time to restore a cache to the device",
            ["tier"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "chatkv_ttft_seconds", "Time to first token", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.queue_seconds = Histogram(
            "chatkv_queue_seconds",
            "Time from submitting a turn to the engine loop to the first step that ran it",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.step_requests = Histogram(
            "chatkv_step_requests", "Requests packed into one engine step", buckets=_COUNT_BUCKETS, registry=r
        )
        self.step_tokens = Histogram(
            "chatkv_step_tokens", "Tokens fed in one engine step", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            "chatkv_step_seconds", "Forward-pass time of one engine step", buckets=_SECONDS_BUCKETS, registry=r
        )

    def watch_tiers(self, usage: Callable[[], TierUsage]) -> None:
        self.registry.register(_TierCollector(usage))

    def watch_engine(self, stats: Callable[[], LoopStats], preparing: Callable[[], Mapping[TenantId, int]]) -> None:
        """Expose the engine loop's gauges; `preparing`: turns per tenant not yet in the loop."""
        self.registry.register(_EngineCollector(stats, preparing, self._tenant_labels))

    def step(self, requests: int, tokens: int, forward_s: float) -> None:
        """`StepObserver` of the engine loop."""
        self.step_requests.observe(requests)
        self.step_tokens.observe(tokens)
        self.step_seconds.observe(forward_s)

    def record_turn(
        self,
        tenant_id: str,
        prefill_tokens: int,
        reused_tokens: int,
        decode_tokens: int,
        ttft_s: float,
        restored_from: str,
        queue_s: float = 0.0,
        restore_choice: str | None = None,
    ) -> None:
        self.cache_queries.labels("tokens").inc(prefill_tokens + reused_tokens)
        if restore_choice is not None:
            self.restore_choices.labels(restore_choice).inc()
        self.cache_hits.labels("tokens").inc(reused_tokens)
        self.cache_queries.labels("turns").inc()
        if reused_tokens:
            self.cache_hits.labels("turns").inc()
        self.prefill_tokens.inc(prefill_tokens)
        self.prefill_tokens_saved.inc(reused_tokens)
        self.decode_tokens.inc(decode_tokens)
        self.turns.labels(restored_from).inc()
        self.ttft_seconds.observe(ttft_s)
        self.queue_seconds.observe(queue_s)
        if self._tenant_labels:
            self.tenant_turns.labels(tenant_id).inc()
        label = tenant_id if self._tenant_labels else "*"
        self.prompt_tokens.labels(label, "cache").inc(reused_tokens)
        self.prompt_tokens.labels(label, "prefill").inc(prefill_tokens)
        with self._tenant_tokens_lock:
            cached, prefilled = self._tenant_tokens.get(tenant_id, (0, 0))
            self._tenant_tokens[tenant_id] = (cached + reused_tokens, prefilled + prefill_tokens)

    def tenant_tokens(self) -> dict[str, tuple[int, int]]:
        """Prompt tokens of each tenant's turns since start: `(served from cache, prefilled)`
        (what `chatkv stats` shows per tenant, whatever the label settings)."""
        with self._tenant_tokens_lock:
            return dict(self._tenant_tokens)

    def stats(self, usage: TierUsage, pooled_bases: int) -> dict[str, Any]:
        """`SessionManager.stats` less the model's fields: sessions and bytes per tier (`copies`:
        sessions placed higher whose copy the tier also holds, the write-back's disk copies; their
        bytes count), budgets, cache hit rate, prefill tokens saved, evictions;
        `prompt_tokens_by_tenant`: each tenant's prompt tokens served from cache and prefilled
        since start (by tenant id); `forks`: forks by the tier their cache came from.

        Args:
            usage: the tier manager's now; pooled_bases: base layers in the prefix pool.
        """

        def value(name: str, **labels: str) -> float:
            return self.registry.get_sample_value(f"chatkv_{name}_total", labels) or 0.0

        queries = value("cache_queries", unit="tokens")
        moved = {f"{s.value}->{t}": value("evictions", source=s.value, target=t) for s in LOCAL_TIERS for t in _TO}
        forks = {source: value("forks", source=source) for source in get_args(RestoreSource)}
        return {
            "tiers": {
                t.value: {
                    "sessions": usage.sessions[t],
                    "copies": usage.copies.get(t, 0),
                    "bytes": usage.bytes[t],
                    "budget_bytes": usage.budgets[t],
                    "budget_used": usage.bytes[t] / max(1, usage.budgets[t]),
                }
                for t in LOCAL_TIERS
            },
            "base_layers_in_pool": pooled_bases,
            "cache_hit_rate_tokens": value("cache_hits", unit="tokens") / queries if queries else 0.0,
            "prefill_tokens": value("prefill_tokens"),
            "prefill_tokens_saved": value("prefill_tokens_saved"),
            "evictions": {name: n for name, n in moved.items() if n},
            "integrity_failures": sum(value("integrity_failures", tier=t.value) for t in LOCAL_TIERS),
            "prompt_tokens_by_tenant": {
                tenant_id: {
                    "cached_tokens": cached,
                    "prefilled_tokens": prefilled,
                    "hit_rate_tokens": cached / (cached + prefilled) if cached + prefilled else 0.0,
                }
                for tenant_id, (cached, prefilled) in sorted(self.tenant_tokens().items())
            },
            "forks": {source: n for source, n in forks.items() if n},
        }

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry (with the `replica` label, if any)."""
        return generate_latest(self._exposed)

    # -- TierEvents ----------------------------------------------------------------------------

    def moved(self, source: Tier, target: Tier | None, nbytes: int) -> None:
        self.evictions.labels(source.value, target.value if target else "dropped").inc()

    def restored(self, source: Tier, seconds: float) -> None:
        self.restores.labels(source.value).inc()
        self.restore_seconds.labels(source.value).observe(seconds)

    def rejected(self, source: Tier) -> None:
        self.integrity_failures.labels(source.value).inc()
