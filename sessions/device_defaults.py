"""Defaults that depend on the device the model runs on: the device tier's KV budget and the
model's dtype. Pure decisions (a device kind and memory figures in, a budget or dtype out), so they
are tested without a GPU; `probe_device` reads the figures from torch.

On CUDA the device budget comes from the GPU's free memory after the weights are loaded, less a
headroom for activations, the engine's working KV buffers and the allocator; on a CPU (or MPS, whose
memory is the host's) the device tier shares the host's RAM, so it keeps 25% of it. On CUDA the
weights run in bfloat16 (float16 where the GPU has no bfloat16: before Ampere), as GPU inference
does; on a CPU float32, which is faster there than the half types.
"""

from __future__ import annotations

from dataclasses import dataclass

from sessions.settings import DtypeName

HOST_SHARE = 0.25
"""Share of the host's RAM the device tier may use when the device is the CPU (or MPS)."""
CUDA_HEADROOM_SHARE = 0.10
CUDA_HEADROOM_MIN_BYTES = 2 * 2**30
"""Left free on a GPU beside the budget: the larger of 10% of its memory and 2 GiB."""
MIN_DEVICE_BUDGET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class DeviceFacts:
    """What the defaults depend on. `kind`: `cpu`, `cuda` or `mps`; the memory figures are bytes
    (`None` where the device does not report them); `bf16_supported`: the GPU computes bfloat16."""

    kind: str
    host_ram_bytes: int
    free_bytes: int | None = None
    total_bytes: int | None = None
    bf16_supported: bool = False


def device_kind(device: str) -> str:
    """`cuda:1` -> `cuda`."""
    return device.split(":", 1)[0]


def default_device_budget_bytes(facts: DeviceFacts) -> int:
    """The device tier's budget when `device_budget_bytes` is not set: on CUDA the free memory
    (measured after the weights loaded) less max(10% of the GPU, 2 GiB), at least 64 MiB; else 25% of
    the host's RAM."""
    if facts.kind == "cuda" and facts.free_bytes is not None and facts.total_bytes is not None:
        headroom = max(int(facts.total_bytes * CUDA_HEADROOM_SHARE), CUDA_HEADROOM_MIN_BYTES)
        return max(facts.free_bytes - headroom, MIN_DEVICE_BUDGET_BYTES)
    return int(facts.host_ram_bytes * HOST_SHARE)


def default_dtype(facts: DeviceFacts) -> DtypeName:
    """The model's dtype when `dtype` is `auto`: bfloat16 on CUDA (float16 without bfloat16
    support), float32 elsewhere."""
    if facts.kind == "cuda":
        return "bfloat16" if facts.bf16_supported else "float16"
    return "float32"


def resolve_dtype(setting: str, facts: DeviceFacts) -> DtypeName:
    """`Settings.dtype` (`auto` or a dtype name) for the device described by `facts`."""
    if setting == "auto":
        return default_dtype(facts)
    if setting not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {setting!r}")
    return setting  # type: ignore[return-value]


def probe_device(device: str, host_ram_bytes: int) -> DeviceFacts:
    """The facts of a torch `device` as it is now (call after the weights are on it for the free
    memory the KV cache can use)."""
    import torch

    kind = device_kind(device)
    if kind != "cuda":
        return DeviceFacts(kind, host_ram_bytes)
    free, total = torch.cuda.mem_get_info(torch.device(device))
    with torch.cuda.device(torch.device(device)):
        bf16 = torch.cuda.is_bf16_supported()
    return DeviceFacts(kind, host_ram_bytes, int(free), int(total), bool(bf16))
