"""Time one Qwen3.5 Gated DeltaNet rule (the linear attention's core, after the conv) as
simple_rl's trainer runs it, against its earlier backward and fla's chunked kernels alone:

    python benchmarks/bench_gdn.py --out gdn.json

simple_rl: `bib.GatedDeltaRuleFn` on vLLM's kernels in the engine's schedule (each sample's
prompt through the chunked rule vLLM ships, its generated tokens through the recurrent decode
kernel), its backward fla's chunked one (`gated_delta_rule_backward_fla`). fp32-bwd: the same
forward, its backward the autograd of the fp32 reference (`gated_delta_rule_backward`) over
every sample in its own chunks: the reference the gradients are compared with. fla:
`chunk_gated_delta_rule` from flash-linear-attention (what transformers' Qwen3.5 calls), its
L2 norms in its kernels, forward and its own chunked backward, its kernels on the configs
simple_rl pins (`bib.pin_fla`). Qwen3.5-4B's shape by default
(16 k heads and 32 v heads of 128), B samples of --prompt + --completion tokens, at each B of
--samples, bf16 inputs.

Each row: one warm-up (Triton compiles), then the mean over --repeats of a forward and of its
backward, each synchronised; `peak`, the most memory in use above the inputs; `grad_rel`, the
largest relative difference, over q, k, v, a, b, between a design's input gradients and
fp32-bwd's. About a minute on one GPU.

--device cpu: fp32-bwd only, on the reference forms at a tiny shape (a smoke test).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batch_invariant_backward as bib  # noqa: E402
from bench_moe_layer import clock  # noqa: E402


def rule_inputs(samples: int, prompt: int, completion: int, k_heads: int, v_heads: int,
                dim: int, device: str, seed: int = 0) -> tuple[list, torch.Tensor, torch.Tensor]:
    """q, k (T, Hk, D), v (T, Hv, D), a, b (T, Hv) in bf16 (fp32 on CPU), A_log fp32, dt_bias,
    all requiring grad; cu_seqlens (B+1,) int32; prefill (B,): the prompt lengths."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    T = samples * (prompt + completion)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    x = [r(T, k_heads, dim), r(T, k_heads, dim), r(T, v_heads, dim), r(T, v_heads),
         r(T, v_heads),
         (torch.rand(v_heads, generator=g, device=device) * 0.5 + 1e-3).log(),  # A_log fp32
         r(v_heads, scale=0.5)]
    for t in x:
        t.requires_grad_()
    cu = torch.arange(samples + 1, device=device, dtype=torch.int32) * (prompt + completion)
    return x, cu, torch.full((samples,), prompt)


def trainer_rule(ops: bib.Kernels, x: list, cu: torch.Tensor, prefill: torch.Tensor):
    return ops.gated_delta_rule(*x, cu, int((cu[1:] - cu[:-1]).max()), prefill)


def fla_rule(x: list, cu: torch.Tensor, prefill: torch.Tensor):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, a, b, A_log, dt_bias = x
    gate, beta = bib.gdn_gates(a, b, A_log, dt_bias)  # (T, Hv) fp32 each
    o, _ = chunk_gated_delta_rule(q[None], k[None], v[None], gate[None],
                                  beta.to(q.dtype)[None],  # as transformers' Qwen3.5 passes it
                                  cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)
    return o[0]


def timed(fn, x: list, go: torch.Tensor, repeats: int, device: str) -> dict:
    """Mean forward and backward seconds of fn over repeats (after one warm-up), peak memory
    above what was in use before, and the last repeat's input gradients."""
    cuda = device == "cuda"
    fwd = bwd = 0.0
    for i in range(repeats + 1):
        for t in x:
            t.grad = None
        if cuda and i == repeats:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = clock(device)
        o = fn(x)
        t1 = clock(device)
        o.backward(go)
        t2 = clock(device)
        if i:
            fwd, bwd = fwd + (t1 - t0) / repeats, bwd + (t2 - t1) / repeats
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
    return dict(forward_ms=1e3 * fwd, backward_ms=1e3 * bwd, peak_gib=peak,
                grads=[t.grad.detach().float() for t in x[:5]])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--k-heads", type=int, default=16)
    p.add_argument("--v-heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default="gdn.json")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    fwd = bib.vllm_forwards() if cuda else bib.reference_forwards()
    fp32 = bib.custom_backward_kernels(fwd, bib.TORCH_BACKWARDS)  # the rule's: the reference's
    ops = bib.vllm_kernels() if cuda else None
    have_fla = cuda and importlib.util.find_spec("fla") is not None
    if have_fla:
        bib.pin_fla()  # before fla's import, as in a run
    rows = []
    head = f"{'B':>5} {'tokens':>7} {'design':>9} {'fwd ms':>8} {'bwd ms':>8} {'peak GiB':>9} "
    print(head + f"{'grad_rel':>9}")
    for n in a.samples:
        x, cu, prefill = rule_inputs(n, a.prompt, a.completion, a.k_heads, a.v_heads, a.dim,
                                     a.device)
        go = torch.randn(len(x[0]), a.v_heads, a.dim, device=a.device, dtype=x[2].dtype)
        designs = {"fp32-bwd": lambda x: trainer_rule(fp32, x, cu, prefill)}
        if have_fla:  # simple_rl's backward is fla's: without it, only the reference's
            designs["simple_rl"] = lambda x: trainer_rule(ops, x, cu, prefill)
            designs["fla"] = lambda x: fla_rule(x, cu, prefill)
        got = {name: timed(fn, x, go, a.repeats, a.device) for name, fn in designs.items()}
        for name, r in got.items():
            rel = None
            if name != "fp32-bwd":
                rel = max(((g - w).norm() / w.norm()).item()
                          for g, w in zip(r["grads"], got["fp32-bwd"]["grads"]))
            row = dict(samples=n, tokens=len(x[0]), design=name, grad_rel=rel,
                       **{k: v for k, v in r.items() if k != "grads"})
            rows.append(row)
            rel_s = f"{rel:9.2e}" if rel is not None else f"{'-':>9}"
            print(f"{n:>5} {row['tokens']:>7} {name:>9} {row['forward_ms']:8.2f} "
                  f"{row['backward_ms']:8.2f} {row['peak_gib']:9.2f} {rel_s}")
    if not have_fla and cuda:
        print("fla is not installed (pip install flash-linear-attention): the fp32 backward only")
    Path(a.out).write_text(json.dumps(dict(args=vars(a), rows=rows), indent=1))
    print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
