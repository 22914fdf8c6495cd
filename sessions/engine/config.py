"""The engine loop's limits (a light module: `Settings` builds them without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine loop.

    Attributes:
        max_step_tokens: tokens fed per forward pass (decodes plus prefill chunks).
        max_prefill_tokens: prefill tokens per forward pass while other requests run or wait (of
            all prefilling requests together, split max-min fairly over their tenants; 0: no such
            limit, `max_step_tokens` only). On a CPU a shared step costs about its token count,
            so this bounds how long a long prefill holds the other turns back; a prefill alone in
            the loop takes `max_step_tokens`. Raise it on a GPU.
        max_running_requests: requests holding a working KV buffer at once.
        max_running_per_tenant: running requests one tenant may have (0: `max_running_requests`).
        max_batch_requests: requests per step (0: every running request). 1 turns batching off:
            the running requests then take turns, one forward pass each, as before the engine loop.

    Raises:
        ValueError: for a limit below its minimum, naming it.
    """

    max_step_tokens: int = 256
    max_prefill_tokens: int = 32
    max_running_requests: int = 32
    max_running_per_tenant: int = 0
    max_batch_requests: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_step_tokens", 1),
            ("max_prefill_tokens", 0),
            ("max_running_requests", 1),
            ("max_running_per_tenant", 0),
            ("max_batch_requests", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

    @property
    def tenant_limit(self) -> int:
        return self.max_running_per_tenant or self.max_running_requests
