"""Time one RL step phase by phase, for three designs on the same model, data and token counts.

    (a) bitwise   simple_rl as it is: batch-invariant vLLM, the trainer on vLLM's kernels,
                  packed micro-batches, in-memory weight push
    (b) plain     the same engine settings with VLLM_BATCH_INVARIANT=0 (vLLM's default kernels),
                  the trainer on plain PyTorch kernels (cuBLAS GEMMs, SDPA flash attention,
                  autograd), packed micro-batches, in-memory push
    (c) seed      the seed's design: bitwise kernels, one training forward per sample,
                  weight sync by writing safetensors and calling vLLM's reload_weights

Each design runs in its own process (VLLM_BATCH_INVARIANT is read when vLLM is imported):

    python benchmarks/bench_rl.py --model CKPT --out bench.json [--profile]

Workload: 32 prompts x 8 samples, prompts of 128 random tokens, 256 new tokens, 1 warm-up
step and 3 measured steps. MFU counts 6 * params * tokens for the GEMMs (the LM head only
at generated positions, where the trainer computes it) plus 6 * layers * heads * head_dim *
sum(L^2) for causal attention, over a peak of 989 TFLOP/s (H100/H200 SXM dense bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM datasheet
DESIGNS = {"a": "bitwise", "b": "plain", "c": "seed"}


def flops_per_step(args, seq_lens: list[int], n_generated: int) -> float:
    """Training FLOPs (forward + backward) of one batch.

    GEMMs: 6 * P_layers * T  +  6 * V * d * N_gen  (the head runs at generated positions only);
    attention (causal): 6 * n_layers * n_heads * head_dim * sum_b L_b^2.
    """
    d, hd, hq, hk, inter = args.dim, args.head_dim, args.n_heads, args.n_kv_heads, args.hidden_dim
    per_layer = d * (hq + 2 * hk) * hd + hq * hd * d + 3 * d * inter  # qkv, o, gate/up, down
    tokens = sum(seq_lens)
    gemm = 6 * args.n_layers * per_layer * tokens + 6 * args.vocab_size * d * n_generated
    attention = 6 * args.n_layers * hq * hd * sum(n * n for n in seq_lens)
    return float(gemm + attention)


def plain_kernels():
    """(b): plain PyTorch forwards with autograd; attention by SDPA on the padded batch.

    Right padding with is_causal=True is exact for every real token: token i attends to
    keys 0..i, all of them real.
    """
    import torch.nn.functional as F

    import batch_invariant_backward as bib

    def attention(q, k, v, cu_seqlens, max_seqlen, scale):
        qp, valid = bib._pad(q, cu_seqlens, max_seqlen)
        kp, _ = bib._pad(k, cu_seqlens, max_seqlen)
        vp, _ = bib._pad(v, cu_seqlens, max_seqlen)
        o = F.scaled_dot_product_attention(qp.to(q.dtype), kp.to(q.dtype), vp.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True)
        return bib._unpad(o, valid).to(q.dtype)

    ref = bib.reference_kernels()
    return bib.Kernels(**{**ref.__dict__, "name": "plain", "attention": attention})


def workload_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()  # id 0 is eos in our test tokenizers


def measure(design: str, model_dir: str, steps: int, warmup: int, prompts_n: int, group: int, prompt_len: int,
            new_tokens: int, micro_batch_tokens: int, engine_factory=None, device=None, profile_to: Path | None = None) -> dict:
    """Run warm-up + measured steps of one design in this process; per-phase seconds and rates."""
    import torch

    import batch_invariant_backward as bib
    import simple_rl as rl

    cfg = rl.Config(model=model_dir, num_prompts=prompts_n, group_size=group, max_new_tokens=new_tokens,
                    max_model_len=prompt_len + new_tokens + 1, micro_batch_tokens=max(micro_batch_tokens, prompt_len + new_tokens + 1),
                    lr=1e-6, kernels="reference" if design == "b" else "vllm", dtype="bfloat16" if device is None else "float32")
    path, args, tokenizer, eos_ids = rl.load_model_files(cfg)
    device = device or torch.device("cuda")
    if engine_factory is None:  # (b) is the same engine: VLLM_BATCH_INVARIANT=0 gives it vLLM's default kernels
        engine_factory = seed_engine_class() if design == "c" else rl.VLLMEngine
    engine = engine_factory(cfg, path, eos_ids)
    kernels = plain_kernels() if design == "b" else bib.reference_kernels() if device.type == "cpu" else bib.vllm_kernels()
    model = rl.build_model(args, rl.hf_to_trainer(rl.load_hf_state_dict(path), args), kernels, rl.DTYPES[cfg.dtype], device)
    engine.push(model)
    optimizer = rl.make_optimizer(model, cfg)
    opt_time = wrap_timed(optimizer, device)
    prompts = workload_prompts(prompts_n, prompt_len, min(args.vocab_size, len(tokenizer)), 0)
    rows = []
    packed_micro_batches = rl.micro_batches
    if design == "c":  # the seed trained one sample per forward
        rl.micro_batches = lambda lengths, max_tokens: [range(i, i + 1) for i in range(len(lengths))]
    try:
        rows = [one_step(step, step < warmup, engine, model, optimizer, opt_time, prompts, cfg, device) for step in range(warmup + steps)]
        if profile_to:
            profile_train_step(model, optimizer, prompts, engine, cfg, device, profile_to)
    finally:
        rl.micro_batches = packed_micro_batches
    measured = [r for r in rows if not r["warmup"]]

    def mean(key):
        return sum(r[key] for r in measured) / len(measured)

    out = {k: mean(k) for k in ("rollout_s", "fwd_bwd_s", "optimizer_s", "push_s", "step_s", "generated_tokens", "trained_tokens", "flops")}
    out.update(design=design, name=DESIGNS[design], mismatched=sum(r["mismatched"] for r in measured),
               rollout_tok_s=out["generated_tokens"] / out["rollout_s"], trainer_tok_s=out["trained_tokens"] / out["fwd_bwd_s"],
               mfu=out["flops"] / out["fwd_bwd_s"] / PEAK_FLOPS,
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0, steps=rows)
    return out


def one_step(step, warmup, engine, model, optimizer, opt_time, prompts, cfg, device) -> dict:
    """rollout -> packed update with the parity check -> push, each phase timed on a synchronised clock."""
    import torch

    import simple_rl as rl

    sync(device)
    t0 = time.perf_counter()
    ro = engine.rollout(prompts, step)
    sync(device)
    t1 = time.perf_counter()
    packed = rl.pack(ro.prompts, ro.completions)
    rewards = torch.tensor([sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in ro.completions])  # synthetic
    adv = rl.group_advantages(rewards, cfg.group_size, True, 1e-6).to(device)
    opt_time["s"] = 0.0
    _, logp = rl.train_step(model, None, optimizer, packed, ro.logprobs.to(device), adv, cfg)
    parity = rl.parity_report(ro.logprobs, logp, packed.targets, 0)
    sync(device)
    t2 = time.perf_counter()
    engine.push(model)
    sync(device)
    t3 = time.perf_counter()
    lens = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    fwd_bwd = t2 - t1 - opt_time["s"]
    row = dict(step=step, warmup=warmup, rollout_s=t1 - t0, fwd_bwd_s=fwd_bwd, optimizer_s=opt_time["s"],
               push_s=t3 - t2, step_s=t3 - t0, generated_tokens=parity.n_tokens, trained_tokens=sum(lens),
               mismatched=parity.n_mismatch, flops=flops_per_step(model.args, lens, parity.n_tokens))
    print(json.dumps(row), flush=True)
    return row


def wrap_timed(optimizer, device) -> dict:
    """Time optimizer.step (synchronised) so it can be split from forward + backward."""
    spent = {"s": 0.0}
    step = optimizer.step

    def timed(*a, **k):
        sync(device)
        t = time.perf_counter()
        result = step(*a, **k)
        sync(device)
        spent["s"] += time.perf_counter() - t
        return result

    optimizer.step = timed
    return spent


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def seed_engine_class():
    import simple_rl as rl

    class SeedEngine(rl.VLLMEngine):
        """(c): weights go through safetensors on disk and vLLM's reload_weights, as in the seed."""

        def push(self, model):
            out = self.__dict__.setdefault("push_dir", Path(tempfile.mkdtemp(prefix="seed_push_")))  # rewritten each push
            rl.save_hf_checkpoint(out, rl.model_hf_state(model), Path(self.cfg.model))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(out)})
            self.llm.reset_prefix_cache()

    return SeedEngine


def profile_train_step(model, optimizer, prompts, engine, cfg, device, path: Path, rows: int = 30) -> None:
    """One more step's update under torch.profiler: the ops that take the GPU time, to a text file."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import simple_rl as rl

    ro = engine.rollout(prompts, 10_000)
    packed = rl.pack(ro.prompts, ro.completions)
    adv = torch.linspace(-1, 1, len(ro.completions), device=device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
        rl.train_step(model, None, optimizer, packed, ro.logprobs.to(device), adv, cfg)
        sync(device)
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total", row_limit=rows))


def table(results: list[dict]) -> str:
    head = f"{'design':<9} {'step s':>8} {'rollout s':>9} {'fwd+bwd s':>9} {'optim s':>8} {'push s':>7} {'roll tok/s':>10} {'train tok/s':>11} {'MFU':>6} {'peak GiB':>8} {'mismatch':>8}"
    lines = [head]
    for r in results:
        lines.append(f"{r['name']:<9} {r['step_s']:>8.2f} {r['rollout_s']:>9.2f} {r['fwd_bwd_s']:>9.2f} {r['optimizer_s']:>8.3f} {r['push_s']:>7.3f} "
                     f"{r['rollout_tok_s']:>10.0f} {r['trainer_tok_s']:>11.0f} {r['mfu']:>6.1%} {r['peak_mem_gib']:>8.1f} {r['mismatched']:>8}")
    by = {r["design"]: r for r in results}
    if "a" in by and "b" in by:
        lines.append(f"trainer penalty (b/a tokens/s): {by['b']['trainer_tok_s'] / by['a']['trainer_tok_s']:.2f}x (target <= 1.5x)")
    if "a" in by:
        lines.append(f"trainer MFU (a): {by['a']['mfu']:.1%} (target >= 35%); weight push (a): {by['a']['push_s']:.3f} s (target <= 0.3 s)")
    if "a" in by and "c" in by:
        lines.append(f"full step, seed design / ours: {by['c']['step_s'] / by['a']['step_s']:.1f}x (target >= 10x)")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF Qwen3 checkpoint directory (e.g. tests/make_checkpoint.py --preset qwen3-1.7b)")
    p.add_argument("--designs", default="abc", help="which of a (bitwise), b (plain), c (seed) to run")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--out", default="bench.json")
    p.add_argument("--profile", action="store_true", help="also profile one more update of designs a and b (<out>.<design>.profile.txt)")
    p.add_argument("--worker", choices=sorted(DESIGNS), help=argparse.SUPPRESS)
    a = p.parse_args()
    knobs = dict(steps=a.steps, warmup=a.warmup, prompts_n=a.prompts, group=a.group, prompt_len=a.prompt_len,
                 new_tokens=a.new_tokens, micro_batch_tokens=a.micro_batch_tokens)
    if a.worker:
        profile_to = Path(a.out).with_suffix(".profile.txt") if a.profile and a.worker != "c" else None  # c: 256 updates, too long a trace
        Path(a.out).write_text(json.dumps(measure(a.worker, a.model, **knobs, profile_to=profile_to)))
        return
    results = []
    for d in a.designs:
        out = Path(a.out).with_suffix(f".{d}.json")
        env = dict(os.environ, VLLM_BATCH_INVARIANT="0" if d == "b" else "1", VLLM_USE_V2_MODEL_RUNNER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", d, "--out", str(out)], check=True, env=env)
        results.append(json.loads(out.read_text()))
    Path(a.out).write_text(json.dumps({"workload": knobs, "peak_flops": PEAK_FLOPS, "results": results}, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
