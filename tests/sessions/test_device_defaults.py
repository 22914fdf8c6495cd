"""Defaults that depend on the device, decided from a device kind and memory figures (no GPU here:
the CUDA figures are those an H200 and a small card report), and the pinned-copy rule."""

from __future__ import annotations

import pytest
import torch

from cache.serialization import PIN_MIN_BYTES, pins_for_copy, to_device
from sessions.device_defaults import (
    DeviceFacts,
    default_device_budget_bytes,
    default_dtype,
    probe_device,
    resolve_dtype,
)
from sessions.settings import Settings
from tests.conftest import MASTER_KEY

GiB = 2**30
HOST_RAM = 64 * GiB


@pytest.mark.parametrize(
    ("facts", "budget"),
    [
        (DeviceFacts("cpu", HOST_RAM), 16 * GiB),
        (DeviceFacts("mps", HOST_RAM), 16 * GiB),
        # An H200 after a small model's weights: free less 10% of the card.
        (DeviceFacts("cuda", HOST_RAM, free_bytes=139 * GiB, total_bytes=140 * GiB), 139 * GiB - 14 * GiB),
        # An 8 GiB card: free less the 2 GiB floor of the headroom.
        (DeviceFacts("cuda", HOST_RAM, free_bytes=6 * GiB, total_bytes=8 * GiB), 4 * GiB),
        # A card the weights nearly fill still gets a small budget rather than none.
        (DeviceFacts("cuda", HOST_RAM, free_bytes=1 * GiB, total_bytes=8 * GiB), 64 * 2**20),
        # No memory figures: the host rule.
        (DeviceFacts("cuda", HOST_RAM), 16 * GiB),
    ],
)
def test_the_default_device_budget_comes_from_the_gpus_free_memory_on_cuda(facts: DeviceFacts, budget: int) -> None:
    assert default_device_budget_bytes(facts) == budget


@pytest.mark.parametrize(
    ("facts", "dtype"),
    [
        (DeviceFacts("cuda", HOST_RAM, bf16_supported=True), "bfloat16"),
        (DeviceFacts("cuda", HOST_RAM, bf16_supported=False), "float16"),
        (DeviceFacts("cpu", HOST_RAM), "float32"),
        (DeviceFacts("mps", HOST_RAM), "float32"),
    ],
)
def test_auto_dtype_is_bf16_on_cuda_fp16_without_bf16_and_float32_on_a_cpu(facts: DeviceFacts, dtype: str) -> None:
    assert default_dtype(facts) == dtype
    assert resolve_dtype("auto", facts) == dtype
    assert resolve_dtype("float16", facts) == "float16"  # a dtype that was set is kept


def test_a_dtype_that_is_no_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^dtype must be auto, float32, bfloat16 or float16, got 'int8'$"):
        resolve_dtype("int8", DeviceFacts("cpu", HOST_RAM))
    with pytest.raises(ValueError, match=r"dtype must be auto, float32, bfloat16 or float16, got 'int8'"):
        Settings(master_key=MASTER_KEY, dtype="int8")  # type: ignore[arg-type]


def test_this_cpu_machine_resolves_auto_to_float32_and_keeps_its_ram_budget() -> None:
    facts = probe_device("cpu", HOST_RAM)
    assert facts == DeviceFacts("cpu", HOST_RAM)
    assert resolve_dtype(Settings(master_key=MASTER_KEY).dtype, facts) == "float32"


def test_settings_say_which_budgets_were_derived_so_a_gpu_can_replace_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DEVICE_BUDGET_BYTES", "HOST_BUDGET_BYTES", "DISK_BUDGET_BYTES", "TENANT_DEVICE_QUOTA_BYTES"):
        monkeypatch.delenv(f"CHATKV_{name}", raising=False)
    assert Settings(master_key=MASTER_KEY).derived_budgets == {
        "device_budget_bytes",
        "host_budget_bytes",
        "disk_budget_bytes",
        "tenant_device_quota_bytes",
    }
    given = Settings(master_key=MASTER_KEY, device_budget_bytes=GiB, tenant_device_quota_bytes=GiB // 2)
    assert given.derived_budgets == {"host_budget_bytes", "disk_budget_bytes"}
    monkeypatch.setenv("CHATKV_DEVICE_BUDGET_BYTES", "2GiB")
    assert "device_budget_bytes" not in Settings(master_key=MASTER_KEY).derived_budgets


def test_only_large_tensors_bound_for_cuda_are_copied_through_pinned_memory() -> None:
    assert pins_for_copy("cuda", PIN_MIN_BYTES)
    assert not pins_for_copy("cuda", PIN_MIN_BYTES - 1)
    assert not pins_for_copy("cpu", 100 * PIN_MIN_BYTES)
    assert not pins_for_copy("mps", 100 * PIN_MIN_BYTES)
    tensor = torch.arange(PIN_MIN_BYTES // 2, dtype=torch.float32)  # 2 MiB: on a CPU, no pinning
    moved = to_device(tensor, "cpu")
    assert torch.equal(moved, tensor) and not moved.is_pinned()
