"""Attention of one packed decode step: per-request SDPA over contiguous buffers vs one SDPA over a
block-diagonal mask (the two ways the engine loop could keep requests apart; `sessions/engine/batch.py`).

For N requests of L cached tokens, each with one new query, with the default model's shapes
(9 query heads, 3 KV heads, head_dim 64, 30 model layers): the per-request path makes N SDPA calls
per model layer; the block-diagonal path first gathers every request's keys and values into one
tensor (a copy per model layer per step) and runs one masked SDPA. Prints both, their ratio and the
largest difference between their outputs. No model is loaded.

    .venv/bin/python benchmarks/packed_attention.py [--threads 1] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, MODEL_LAYERS = 9, 3, 64, 30


def step_ms(
    n: int, cached: int, repeats: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[float, float, float]:
    """Median ms of one step's attention over `MODEL_LAYERS` layers, per-request then block-diagonal,
    and the largest absolute difference between the two outputs. On CUDA the device is synchronised
    before each clock read."""
    query = torch.randn(1, HEADS, n, HEAD_DIM, device=device, dtype=dtype)
    keys = [torch.randn(1, KV_HEADS, cached, HEAD_DIM, device=device, dtype=dtype) for _ in range(n)]
    values = [torch.randn(1, KV_HEADS, cached, HEAD_DIM, device=device, dtype=dtype) for _ in range(n)]
    mask = torch.zeros(n, n * cached, dtype=torch.bool, device=device)
    for i in range(n):
        mask[i, i * cached : (i + 1) * cached] = True

    def per_request() -> torch.Tensor:
        rows = [
            F.scaled_dot_product_attention(query[:, :, i : i + 1], keys[i], values[i], enable_gqa=True)
            for i in range(n)
        ]
        return torch.cat(rows, dim=2)

    def block_diagonal() -> torch.Tensor:
        k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    diff = float((per_request() - block_diagonal()).abs().max())
    timings = []
    for fn in (per_request, block_diagonal):
        runs = []
        fn()  # warm-up (kernel selection on a GPU)
        for _ in range(repeats):
            sync()
            began = time.perf_counter()
            for _ in range(MODEL_LAYERS):
                fn()
            sync()
            runs.append(time.perf_counter() - began)
        timings.append(sorted(runs)[repeats // 2] * 1000)
    return timings[0], timings[1], diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device} {args.dtype}; "
        f"one decode step, {MODEL_LAYERS} model layers"
    )
    print(f"{'N':>3} {'cached':>6} {'per-request ms':>15} {'block-diagonal ms':>18} {'ratio':>6} {'max diff':>9}")
    for n, cached in ((4, 300), (8, 300), (16, 300), (8, 2000)):
        ours, block, diff = step_ms(n, cached, args.repeats, device, dtype)
        print(f"{n:>3} {cached:>6} {ours:>15.1f} {block:>18.1f} {block / ours:>5.1f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
