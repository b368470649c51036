"""GPU parity experiments, one engine per process (vLLM keeps process-wide state).

    VLLM_BATCH_INVARIANT=1 python tests/gpu_driver.py parity --tied --temperature 1.0 --out r.json

`tests/test_gpu.py` runs these and asserts on the JSON they write.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import batch_invariant_backward as bib  # noqa: E402
import simple_rl as rl  # noqa: E402
from helpers import make_checkpoint  # noqa: E402

# trainer name fragment -> vLLM name fragment, for comparing the two models' weights
TO_VLLM = [("tok_embeddings", "model.embed_tokens"), ("layers.", "model.layers."), ("attention.wqkv", "self_attn.qkv_proj"),
           ("attention.wo", "self_attn.o_proj"), ("attention.q_norm", "self_attn.q_norm"), ("attention.k_norm", "self_attn.k_norm"),
           ("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
           ("feed_forward.w13", "mlp.gate_up_proj"), ("feed_forward.w2", "mlp.down_proj"), ("output.", "lm_head.")]


def vllm_name(name: str) -> str:
    if name == "norm.weight":
        return "model.norm.weight"
    for a, b in TO_VLLM:
        name = name.replace(a, b, 1) if a in name else name
    return name


def weights_equal(engine, model) -> tuple[bool, int]:
    """Every trainer weight (compute dtype) equals vLLM's tensor of the same role, bitwise."""
    ours = {vllm_name(n): model.w(p.detach()) for n, p in model.named_parameters()}

    def check(m):
        theirs = dict(m.named_parameters())
        return [n for n, t in ours.items() if n not in theirs or not torch.equal(theirs[n], t)]

    bad = engine.llm.apply_model(check)[0]
    return not bad, len(ours)


def setup(args):
    work = Path(tempfile.mkdtemp())
    path = make_checkpoint(work / "ckpt", tied=args.tied, layers=args.layers, vocab=args.vocab, hidden=args.hidden,
                           heads=args.heads, kv_heads=args.kv_heads, inter=args.inter, dtype=torch.bfloat16, seed=args.seed)
    cfg = rl.Config(model=str(path), num_prompts=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, max_model_len=1024, lr=args.lr, seed=args.seed,
                    micro_batch_tokens=args.micro_batch_tokens, cuda_graphs=args.cuda_graphs)
    rl.validate(cfg)
    _, margs, tokenizer, eos_ids = rl.load_model_files(cfg)
    t0 = time.perf_counter()
    engine = rl.VLLMEngine(cfg, path, eos_ids)
    engine_s = time.perf_counter() - t0
    model = rl.build_model(margs, rl.hf_to_trainer(rl.load_hf_state_dict(path), margs), bib.vllm_kernels(), torch.bfloat16, torch.device("cuda"))
    return cfg, engine, model, eos_ids, engine_s


def prompts_for(args) -> list[list[int]]:
    """Prompt lengths spread from 1 to max_prompt tokens; ids avoid eos (0)."""
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.linspace(1, args.max_prompt, args.prompts).round().long().tolist()
    return [torch.randint(1, args.vocab, (n,), generator=g).tolist() for n in lens]


def parity(args) -> dict:
    cfg, engine, model, eos_ids, engine_s = setup(args)
    optimizer = rl.make_optimizer(model, cfg)
    prompts = prompts_for(args)
    out = dict(engine_start_s=engine_s, steps=[])
    eq, n_w = weights_equal(engine, model)
    out["weights_equal_at_start"] = eq
    for step in range(args.steps):
        t0 = time.perf_counter()
        ro = engine.rollout(prompts, step)
        t1 = time.perf_counter()
        packed = rl.pack(ro.prompts, ro.completions)
        # a synthetic verifiable reward: share of even token ids (gives nonzero advantages)
        rewards = torch.tensor([sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in ro.completions])
        adv = rl.group_advantages(rewards, cfg.group_size, True, 1e-6).cuda()
        metrics, logp = rl.train_step(model, None, optimizer, packed, ro.logprobs.cuda(), adv, cfg)
        par = rl.parity_report(ro.logprobs, logp, packed.targets, 6)
        t2 = time.perf_counter()
        engine.push(model)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        eq, n_w = weights_equal(engine, model)
        lens = [len(c) for c in ro.completions]
        rec = dict(step=step, tokens=par.n_tokens, mismatched=par.n_mismatch, max_abs_diff=par.max_abs_diff,
                   samples=len(lens), stopped_at_eos=sum(ro.stopped), hit_max_tokens=sum(not s for s in ro.stopped),
                   max_completion=max(lens), prompt_lens=[min(map(len, prompts)), max(map(len, prompts))],
                   weights_equal_after_push=eq, n_weights=n_w, rollout_s=t1 - t0, train_s=t2 - t1, push_s=t3 - t2,
                   loss=metrics["loss"], ratio_mean=metrics["ratio_mean"])
        print(par.table)
        print(json.dumps(rec))
        out["steps"].append(rec)
        bad = ro.logprobs.view(torch.int32) != logp.cpu().view(torch.int32)
        offset = torch.arange(len(packed.targets)) - torch.repeat_interleave(torch.cumsum(torch.bincount(packed.sample), 0) - torch.bincount(packed.sample), torch.bincount(packed.sample))
        rec["mismatch_first_token"] = int(bad[offset == 0].sum())
        rec["mismatch_later_tokens"] = int(bad[offset > 0].sum())
        print("mismatch first/later", rec["mismatch_first_token"], rec["mismatch_later_tokens"])
    if args.debug:
        for plen in (5, 120, 300):
            rows, n_bad = rl.debug_parity(engine.llm, model, prompts_for(args)[0][:1] * plen, 40, cfg.temperature, 1)
            print(f"--- debug: prompt {plen} tokens, 40 generated, {n_bad} logprobs differ")
            print(rl.format_debug(rows))
            out[f"debug_{plen}"] = dict(first=rl.first_divergence(rows), n_bad=n_bad)
        # inject a one-ulp error into SiluAndMul of layer 1 and check the debugger names it
        k = model.kernels
        calls = {"n": 0}

        def bumped(x):
            y = k.silu_and_mul(x)
            calls["n"] += 1
            if calls["n"] == 2:  # layer 1 of the prefill: raise one element by one ulp
                y.view(-1).view(torch.int16)[0] += 1
            return y

        model.kernels = bib.Kernels(**{**k.__dict__, "silu_and_mul": bumped})
        rows, n_bad = rl.debug_parity(engine.llm, model, [5] * 10, 5, cfg.temperature, 1)
        model.kernels = k
        print(rl.format_debug(rows))
        out["debug_injected"] = dict(first=rl.first_divergence(rows))
    return out


# the experiment's knobs and their defaults (the tiny model: 3 layers, GQA 4/2, head_dim 128)
OPTIONS = dict(temperature=1.0, steps=4, prompts=16, group=8, max_new_tokens=256, max_prompt=220, layers=3, vocab=384,
               hidden=512, heads=4, kv_heads=2, inter=1024, lr=1e-3, seed=0, micro_batch_tokens=65536)  # one packed forward per step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["parity"])
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--debug", action="store_true", help="also run the parity debugger (needs --no-cuda-graphs)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", required=True)
    for name, default in OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = p.parse_args()
    if args.debug and args.cuda_graphs:
        p.error("the debugger hooks vLLM's modules, which CUDA graph replay skips: add --no-cuda-graphs")
    Path(args.out).write_text(json.dumps(parity(args), indent=1))


if __name__ == "__main__":
    main()
