"""Time one Qwen3-30B-A3B MoE layer's router and experts on vLLM's kernels, forward and
forward + backward, at a few token counts (the experts backward loops over the experts):

    VLLM_BATCH_INVARIANT=1 python benchmarks/bench_moe_layer.py --tokens 2048 8192 --out moe.json

Random bf16 weights of the layer's exact shape; each row: 1 warm-up (Triton compiles), then the
mean of --repeats calls, ms per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")

D, E, K, INTER = 2048, 128, 8, 768  # Qwen3-30B-A3B: hidden, experts, experts per token, moe I


def time_layer(tokens: int, repeats: int) -> dict:
    import torch

    import batch_invariant_backward as bib

    vk = bib.vllm_kernels()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    x = rand(tokens, D).requires_grad_()
    gate, gy = rand(E, D, scale=0.02), rand(tokens, D)
    w13 = rand(E, 2 * INTER, D, scale=0.02).requires_grad_()
    w2 = rand(E, D, INTER, scale=0.02).requires_grad_()

    def step(backward):
        w, ids = vk.moe_topk(torch.nn.functional.linear(x, gate), K, True)
        out = vk.moe_experts(x, w13, w2, w, ids)
        if backward:
            torch.autograd.grad((out * gy).sum(), [x, w13, w2])

    row = {"tokens": tokens}
    for backward in (False, True):
        step(backward)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            step(backward)
        torch.cuda.synchronize()
        row["fwd_bwd_ms" if backward else "fwd_ms"] = (time.perf_counter() - t0) / repeats * 1e3
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_moe_layer.json")
    a = p.parse_args()
    rows = [time_layer(t, a.repeats) for t in a.tokens]
    Path(a.out).write_text(json.dumps(rows, indent=1))
    print("tokens | forward ms | forward + backward ms")
    for r in rows:
        print(f"{r['tokens']} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f}")


if __name__ == "__main__":
    main()
