"""Time simple_rl's own Qwen3-MoE sparse layer (`simple_rl.MoE`: router GEMM, top-k, experts)
as the trainer runs it: fp32 master weights cast to bf16 once (weights_cast_once does it once a
step), bf16 activations, the kernels simple_rl.build_model gets on CUDA (vLLM's forwards, the
Triton backwards), forward and backward timed apart, at 1k-32k tokens, for each backward of
the experts:

    python benchmarks/bench_moe_layer.py --backward both --out moe.json

--backward loop: `moe_experts_backward` (a Python loop over the experts, one GEMM set each);
grouped: whatever `TRITON_BACKWARDS["moe_experts"]` is (the row names the function that ran);
both: the two on the same weights and inputs, the grouped row with its largest gradient
difference from the loop's. Qwen3-30B-A3B's layer shape by default (hidden 2048, 128 experts,
top-8, expert width 768), random weights (router logits of std ~2). Each row: 1 warm-up
(Triton compiles), then the mean over --repeats of a forward and its backward, each
synchronised; `repeatable`: every repeat's gradients (input, router, experts) bit-equal to
the first's. Memory, above what the weights and input hold: `saved`, what the forward keeps
for the backward (and its output); `peak`, the most in use during forward + backward (the fp32
weight gradients included). About a minute on one H200.

--device cpu runs the same path on the reference forwards and PyTorch backwards, for a smoke
test at a tiny shape (`--dim 64 --experts 8 --top-k 2 --moe-inter 32 --tokens 64`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS = [1024, 2048, 4096, 8192, 16384, 32768]


def layer_args(dim: int, experts: int, top_k: int, inter: int):
    """simple_rl's model args for a Qwen3-MoE layer of this shape, read from a Qwen3MoeConfig
    as simple_rl reads a checkpoint's config.json (top-k renormalised, as Qwen3-30B-A3B)."""
    from transformers import Qwen3MoeConfig

    import simple_rl as rl

    return rl.model_args_from_hf(Qwen3MoeConfig(
        hidden_size=dim, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=inter, norm_topk_prob=True, num_hidden_layers=1))


def experts_backward(backward: str):
    """The experts' backward: today's per-expert loop, or the Triton set's (the grouped one)."""
    import batch_invariant_backward as bib

    return {"loop": bib.moe_experts_backward,
            "grouped": bib.TRITON_BACKWARDS["moe_experts"]}[backward]


def layer_kernels(backward: str, device: str):
    """The kernels simple_rl.build_model gets on CUDA (`bib.vllm_kernels()`: vLLM's forwards,
    the Triton backwards), with the experts' backward chosen; on CPU the reference forwards
    and the PyTorch backwards."""
    import batch_invariant_backward as bib

    fwd, bwd = ((bib.vllm_forwards(), bib.TRITON_BACKWARDS) if device == "cuda"
                else (bib.reference_forwards(), bib.TORCH_BACKWARDS))
    return bib.custom_backward_kernels(fwd, dict(bwd, moe_experts=experts_backward(backward)))


def build_layer(args, backward: str, device: str, seed: int = 0):
    """simple_rl.MoE with fp32 master weights on `device`, random: the same for one seed."""
    import torch

    import simple_rl as rl

    with torch.device(device):
        moe = rl.MoE(args, layer_kernels(backward, device))
    g = torch.Generator(device).manual_seed(seed)
    std = {"router.gate.weight": 2 / args.dim**0.5, "experts.w13": 0.02, "experts.w2": 0.02}
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0, std[name], generator=g)
    return moe


def clock(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def time_layer(moe, tokens: int, repeats: int, device: str, reference=None) -> tuple[dict, list]:
    """1 warm-up, then `repeats` forward + backward calls of `moe` on bf16 x (T, dim): the
    row (mean ms each, memory GiB, repeatable) and the first repeat's gradients; with
    `reference` (another backward's gradients), the largest |difference| over its largest |g|."""
    import torch

    cuda = device == "cuda"
    g = torch.Generator(device).manual_seed(tokens)
    dim = moe.router.gate.weight.shape[1]
    x = torch.randn(tokens, dim, device=device, generator=g).bfloat16().requires_grad_()
    gy = torch.randn(tokens, dim, device=device, generator=g).bfloat16()  # dL/d out
    e = moe.experts  # the trainer casts the experts once a step (weights_cast_once), not per call
    e.compute_weights = e.cast(x.dtype)
    fwd_s, bwd_s, first, repeatable, saved, peak = [], [], None, True, 0, 0
    for r in range(repeats + 1):  # r = 0: the warm-up
        x.grad = None
        moe.zero_grad(set_to_none=True)
        if cuda and r == 1:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = clock(device)
        out = moe(x)  # (T, dim)
        t1 = clock(device)
        if cuda and r == 1:
            saved = torch.cuda.memory_allocated() - base
        out.backward(gy)
        t2 = clock(device)
        del out
        if r == 0:
            continue
        grads = [x.grad] + [p.grad for p in moe.parameters()]
        if r == 1:
            peak = torch.cuda.max_memory_allocated() - base if cuda else 0
            first = [t.clone() for t in grads]
        repeatable &= all(torch.equal(a, b) for a, b in zip(first, grads))
        fwd_s.append(t1 - t0)
        bwd_s.append(t2 - t1)
    fwd, bwd = 1e3 * sum(fwd_s) / repeats, 1e3 * sum(bwd_s) / repeats
    row = dict(tokens=tokens, fwd_ms=fwd, bwd_ms=bwd, bwd_over_fwd=bwd / fwd,
               saved_gib=saved / 2**30, peak_gib=peak / 2**30, repeatable=repeatable)
    if reference is not None:
        row["diff_vs_loop"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                  for a, b in zip(first, reference))
    return row, first


HEADER = (f"{'backward':<30} {'tokens':>6} {'fwd ms':>7} {'bwd ms':>7} {'bwd/fwd':>7} "
          f"{'saved GiB':>9} {'peak GiB':>8} {'repeatable':>10} {'vs loop':>8}")


def table_row(r: dict) -> str:
    """A row of the table; a grouped row run beside the loop shows its gradients' largest
    difference from the loop's, relative to the loop's largest."""
    name = f"{r['backward'] + ' (' + r['function'] + ')':<30} {r['tokens']:>6}"
    if "error" in r:
        return f"{name} failed: {r['error']}"
    diff = f"{r['diff_vs_loop']:.1e}" if "diff_vs_loop" in r else "-"
    return (f"{name} {r['fwd_ms']:>7.2f} {r['bwd_ms']:>7.2f} {r['bwd_over_fwd']:>7.1f} "
            f"{r['saved_gib']:>9.2f} {r['peak_gib']:>8.2f} "
            f"{'yes' if r['repeatable'] else 'NO':>10} {diff:>8}")


def summary(rows: list[dict], tokens: int = 8192) -> str:
    """The issue's target at 8192 tokens: a sparse layer's backward at most 3x its forward."""
    at = [f"{r['backward']} {r['bwd_over_fwd']:.1f}x" for r in rows
          if r["tokens"] == tokens and "error" not in r]
    return f"backward / forward at {tokens} tokens: {', '.join(at) or '-'} (target <= 3x)"


def run(a, save) -> list[dict]:
    """Every token count for each backward asked, the loop first (its rows are saved before
    the grouped one runs), on the same weights and inputs; `save(rows)` after every row. A
    row that fails (an assert, out of memory) is recorded with its error and the rest run."""
    args = layer_args(a.dim, a.experts, a.top_k, a.moe_inter)
    kinds = ["loop", "grouped"] if a.backward == "both" else [a.backward]
    rows, loop_grads = [], {}  # tokens -> the loop's gradients
    for kind in kinds:
        moe = build_layer(args, kind, a.device)
        fn = experts_backward(kind)
        named = dict(backward=kind, function=getattr(fn, "__name__", repr(fn)))  # partial: repr
        for tokens in a.tokens:
            try:
                row, grads = time_layer(moe, tokens, a.repeats, a.device, loop_grads.get(tokens))
            except Exception as e:
                error = f"{type(e).__name__}: {e}".splitlines()[0][:300]  # one line
                row, grads = dict(tokens=tokens, error=error), None
            if kind == "loop" and len(kinds) > 1 and grads:
                loop_grads[tokens] = grads
            rows.append(dict(row, **named))
            print(table_row(rows[-1]), flush=True)
            save(rows)
        del moe
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--backward", choices=["loop", "grouped", "both"], default="both")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-inter", type=int, default=768)
    p.add_argument("--out", default="bench_moe_layer.json")
    a = p.parse_args(argv)
    shape = dict(dim=a.dim, experts=a.experts, top_k=a.top_k, moe_inter=a.moe_inter)

    def save(rows):
        Path(a.out).write_text(json.dumps(dict(shape=shape, repeats=a.repeats, device=a.device,
                                               rows=rows), indent=1))

    if a.device == "cuda":  # before vLLM is imported: the environment simple_rl runs in
        import simple_rl as rl

        rl.prepare_environment(rl.Config())
    print(HEADER, flush=True)
    rows = run(a, save)
    print(summary(rows))
    failed = [f"{r['backward']} at {r['tokens']}" for r in rows if "error" in r]
    if failed:
        sys.exit(f"bench_moe_layer: failed: {', '.join(failed)}; the other rows are in {a.out}")
    return rows


if __name__ == "__main__":
    main()
