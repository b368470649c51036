"""Time the trainer alone, by micro-batch size: the update of one RL step without the engine.

    python benchmarks/bench_trainer.py --model CKPT --out trainer.json
    python benchmarks/bench_trainer.py --model CKPT --micro-batch-tokens 8192 24576 --profile

The batch has the shape of bench_rl.py's workload (32 prompts x 8 samples, 128 prompt tokens,
256 generated tokens each, packed), so MFU here is the fwd+bwd MFU of bench_rl.py's design (a)
without vLLM in the process: the same kernels (VLLM_BATCH_INVARIANT=1, vLLM's batch-invariant
mode switched on as the engine switches it on), the same `update`, the optimizer step timed
apart. Each size: 1 warm-up update, then the median of `--steps` updates. `--profile` adds,
per size, the top GPU ops of one more update and where the GPU sat idle (gaps between
kernels, with the kernels on either side): the host-bound stretches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GAP_US = 20  # idle stretches shorter than this are launch latency, not a stall


def synthetic_batch(samples: int, prompt_len: int, new_tokens: int, vocab: int, seed: int):
    """Random prompts and completions of the workload's lengths, packed as rl_step packs them."""
    import torch

    import simple_rl as rl

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (samples, prompt_len + new_tokens), generator=g).tolist()
    return rl.pack([s[:prompt_len] for s in ids], [s[prompt_len:] for s in ids])


def idle_gaps(prof, rows: int = 15) -> str:
    """The GPU's idle time between kernels in one profiled update, and the kernel pairs around
    the longest gaps in total: where the host, not the GPU, set the pace."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    idle, pairs, end, before = 0.0, Counter(), spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start - end > GAP_US:
            idle += start - end
            pairs[(before[:50], name[:50])] += start - end
        if stop > end:
            end, before = stop, name
    total = spans[-1][1] - spans[0][0]
    lines = [f"GPU idle {idle / 1e3:.1f} ms of {total / 1e3:.1f} ms in gaps > {GAP_US} us; "
             f"longest in total, by the kernels around them (ms):"]
    lines += [f"  {us / 1e3:8.1f}  {a}  ->  {b}" for (a, b), us in pairs.most_common(rows)]
    return "\n".join(lines) + "\n"


def run(args) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance

    import batch_invariant_backward as bib
    import simple_rl as rl
    from bench_rl import PEAK_FLOPS, flops_per_step, profile_section, sync, time_optimizer

    init_batch_invariance()  # what the engine does at its start: cuBLAS without split-K, ...
    dev = torch.device("cuda")
    path = Path(args.model)
    hf_args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), hf_args)
    model = rl.build_model(hf_args, state, bib.vllm_kernels(), torch.bfloat16, dev)
    del state
    packed = synthetic_batch(args.prompts * args.group, args.prompt_len, args.new_tokens,
                             hf_args.vocab_size, seed=0)
    lens = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    flops = flops_per_step(hf_args, lens, len(packed.targets))
    adv = torch.linspace(-1, 1, args.prompts * args.group, device=dev)
    results = []
    ranks = rl.Ranks(0, 1, dev)
    for mbt in args.micro_batch_tokens:
        cfg = rl.Config(model=str(path), num_prompts=args.prompts, group_size=args.group,
                        max_new_tokens=args.new_tokens, max_model_len=max(lens),
                        micro_batch_tokens=mbt)
        rl.validate(cfg)  # a size below one sequence: a clear error
        lengths = (args.prompt_len, args.prompt_len)
        cfg = rl.with_micro_batch(cfg, hf_args, ranks, lengths)  # 0: what simple_rl picks here
        mbt = cfg.micro_batch_tokens
        optimizer = rl.make_optimizer(model, cfg)
        old = torch.zeros(len(packed.targets), device=dev)
        times = []
        for i in range(args.warmup + args.steps):
            spent = time_optimizer(optimizer, dev)  # the optimizer step is timed apart
            sync(dev)
            t0 = time.perf_counter()
            logp = rl.update(model, None, optimizer, packed, old, adv, cfg).logprobs
            sync(dev)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0 - spent["s"])
            old = logp  # from the second update on, ratio = 1 as in an RL step
        fwd_bwd = statistics.median(times)
        row = dict(micro_batch_tokens=mbt, micro_batches=len(rl.plan_micro_batches(packed, cfg)),
                   fwd_bwd_s=fwd_bwd, min_s=min(times), max_s=max(times),
                   tok_s=sum(lens) / fwd_bwd, mfu=flops / fwd_bwd / PEAK_FLOPS,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        print(json.dumps(row), flush=True)
        if args.profile:
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                rl.update(model, None, optimizer, packed, old, adv, cfg)
                sync(dev)
                wall = time.perf_counter() - t0
            text = profile_section(f"update, micro-batch {mbt} ({row['micro_batches']} of them)",
                                   prof, wall, True, 25) + idle_gaps(prof)
            Path(f"{args.out}.mb{mbt}.profile.txt").write_text(text)
        results.append(row)
        del optimizer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Qwen3 checkpoint directory")
    p.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[8192, 16384, 24576],
                   help="sizes to time (0: what simple_rl picks)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default="trainer.json")
    args = p.parse_args()
    results = run(args)
    print(f"{'micro-batch':>11} {'n':>3} {'fwd+bwd s':>9} {'min-max s':>11} {'tok/s':>8} "
          f"{'MFU':>6} {'peak GiB':>8}")
    for r in results:
        print(f"{r['micro_batch_tokens']:>11} {r['micro_batches']:>3} {r['fwd_bwd_s']:>9.3f} "
              f"{r['min_s']:>5.2f}-{r['max_s']:<5.2f} {r['tok_s']:>8.0f} {r['mfu']:>6.1%} "
              f"{r['peak_gib']:>8.1f}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
