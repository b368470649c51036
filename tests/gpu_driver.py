"""GPU parity experiments, one engine per process (vLLM keeps process-wide state); under
torchrun, one engine per rank and the FSDP2 trainer.

    VLLM_BATCH_INVARIANT=1 python tests/gpu_driver.py parity --tied --temperature 1.0 --out r.json
    VLLM_BATCH_INVARIANT=1 python -m torch.distributed.run --nproc-per-node 2 \\
        tests/gpu_driver.py parity --ckpt CKPT --out r.json
    VLLM_BATCH_INVARIANT=1 python tests/gpu_driver.py rollouts --ckpt CKPT --out r.json

`tests/test_gpu.py` runs these and asserts on the JSON that rank 0 writes.
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
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import batch_invariant_backward as bib  # noqa: E402
import simple_rl as rl  # noqa: E402
from helpers import first_turns, make_checkpoint, vllm_name  # noqa: E402


def weights_equal(engine, model) -> tuple[bool, int]:
    """Every trainer weight (compute dtype, gathered one at a time under FSDP) equals vLLM's
    tensor of the same role, bitwise; on this rank."""

    def check(m):
        theirs = dict(m.named_parameters())
        # a name vllm_name does not map (Qwen3.5's): the engine's name as simple_rl adopts it
        adopted = {rl.trainer_name(k): v for k, v in theirs.items()}
        bad = []
        for n, p in model.named_parameters():  # every rank gathers in the same order
            t = theirs.get(vllm_name(n), adopted.get(n))
            # in the engine's dtype: the compute dtype, but Qwen3.5's A_log (fp32 in both)
            ours = rl.full_tensor(p.detach().to(model.dtype if t is None else t.dtype))
            if t is None or not torch.equal(t, ours):
                bad.append(n)
        return bad

    bad = engine.llm.apply_model(check)[0]
    return not bad, len(list(model.parameters()))


def linear_on_cublaslt(engine) -> bool:
    """Every linear layer and the LM head of the engine's model call simple_rl's cuBLASLt route
    (the `apply` of their quant method is the patched one)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    def check(m):
        methods = [type(x.quant_method) for x in m.modules()
                   if isinstance(x, (LinearBase, VocabParallelEmbedding))]
        return bool(methods) and all(getattr(t.apply, "cublaslt", False) for t in methods)

    return engine.llm.apply_model(check)[0]


def setup(args):
    ranks = rl.init_ranks("cuda")
    path = Path(args.ckpt) if args.ckpt else None
    if path is None:
        path = make_checkpoint(
            Path(tempfile.mkdtemp()) / "ckpt",
            tied=args.tied,
            layers=args.layers,
            vocab=args.vocab,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            inter=args.inter,
            dtype=torch.bfloat16,
            seed=args.seed,
        )
    cfg = rl.Config(
        model=str(path),
        num_prompts=args.prompts,
        group_size=args.group,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        max_model_len=max(1024, args.max_prompt + args.max_new_tokens),
        lr=args.lr,
        seed=args.seed,
        micro_batch_tokens=args.micro_batch_tokens,
        cuda_graphs=args.cuda_graphs,
        engine_sleep=args.engine_sleep,
    )
    rl.validate(cfg)
    files = rl.load_model_files(cfg)
    cfg = rl.with_micro_batch(cfg, files.args, ranks, (1, args.max_prompt))  # prompts_for's
    t0 = time.perf_counter()
    engine = rl.VLLMEngine(cfg, files, ranks)
    engine_s = time.perf_counter() - t0
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), files.args) if ranks.main else {}
    model = rl.build_model(
        files.args, state, bib.vllm_kernels(), torch.bfloat16, ranks.device, ranks.world
    )
    return cfg, ranks, engine, model, engine_s


def prompts_for(args, vocab: int) -> list[list[int]]:
    """Prompt lengths spread from 1 to max_prompt tokens; ids avoid eos (0)."""
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.linspace(1, args.max_prompt, args.prompts).round().long().tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def parity(args) -> dict:
    cfg, ranks, engine, model, engine_s = setup(args)
    optimizer = rl.make_optimizer(model, cfg)
    prompts = prompts_for(args, min(args.vocab, model.args.vocab_size))
    mine = rl.my_prompts(len(prompts), ranks)
    out = dict(
        engine_start_s=engine_s,
        world=ranks.world,
        micro_batch_tokens=cfg.micro_batch_tokens,
        steps=[],
        weights_equal_at_start=all(rl.all_gather_objects(weights_equal(engine, model)[0])),
        # the engine's speed settings that the parity runs vouch for
        async_scheduling=engine.llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        linear_on_cublaslt=linear_on_cublaslt(engine),
        # simple_rl's banner estimate for this run (GiB per GPU), beside each step's peaks
        memory_estimate_gib=rl.memory_estimate(cfg, model.args, ranks.world,
                                               (1, args.max_prompt))["peak"] / 2**30,
    )
    for step in range(args.steps):
        t0 = time.perf_counter()
        ro = first_turns(engine, [prompts[i] for i in mine], mine, step)
        if step == 0:  # vLLM's sampler: three prompts alone draw what they drew in the batch
            alone = first_turns(engine, [prompts[i] for i in mine[:3]], mine[:3], step)
            n = sum(map(len, alone.completions))
            out["batch_free"] = (alone.completions == ro.completions[:len(alone.completions)]
                                 and torch.equal(alone.logprobs, ro.logprobs[:n]))
        engine.sleep()
        t1 = time.perf_counter()
        packed = rl.pack(ro.prompts, ro.completions)
        # a synthetic verifiable reward: share of even token ids (gives nonzero advantages)
        rewards = torch.tensor(
            [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in ro.completions]
        )
        adv = rl.group_advantages(rewards, cfg.group_size, True, 1e-6).cuda()
        n_micro, n_tokens = rl.batch_over_ranks(packed, cfg, ranks.device)
        update = rl.update(
            model, None, optimizer, packed, ro.logprobs.cuda(), adv, cfg, n_micro, n_tokens
        )
        sums, logp = update.sums, update.logprobs
        par = rl.parity_report(ro.logprobs, logp, packed.targets, rl.generated_lengths(ro), 6)
        t2 = time.perf_counter()
        engine.push(rl.hf_weights(model))
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        eq, n_w = weights_equal(engine, model)
        lens = [len(c) for c in ro.completions]
        # where they differ: a sample's first token comes from the prefill, the rest from decodes
        differ = ro.logprobs.float().view(torch.int32) != logp.detach().float().cpu().view(
            torch.int32)
        first = torch.tensor([0] + lens[:-1]).cumsum(0)
        mine_rec = dict(
            rank=ranks.rank,
            tokens=par.n_tokens,
            mismatched=par.n_mismatch,
            first_token_mismatched=int(differ[first].sum()),
            max_abs_diff=par.max_abs_diff,
            samples=len(lens),
            stopped_at_eos=sum(ro.completed),
            hit_max_tokens=sum(not s for s in ro.completed),
            max_completion=max(lens),
            weights_equal_after_push=eq,
            n_weights=n_w,
            prompt_lens=[min(len(prompts[i]) for i in mine), max(len(prompts[i]) for i in mine)],
            rollout_s=t1 - t0,
            train_s=t2 - t1,
            push_s=t3 - t2,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            device_used_gib=rl.device_in_use(ranks.device) / 2**30,
        )
        per_rank = rl.all_gather_objects(mine_rec)
        loss = float(rl.all_reduce(sums[:1].clone())) / n_tokens
        rec = dict(
            step=step,
            per_rank=per_rank,
            loss=loss,
            tokens=sum(r["tokens"] for r in per_rank),
            mismatched=sum(r["mismatched"] for r in per_rank),
            first_token_mismatched=sum(r["first_token_mismatched"] for r in per_rank),
            max_abs_diff=max(r["max_abs_diff"] for r in per_rank),
            samples=sum(r["samples"] for r in per_rank),
            stopped_at_eos=sum(r["stopped_at_eos"] for r in per_rank),
            hit_max_tokens=sum(r["hit_max_tokens"] for r in per_rank),
            max_completion=max(r["max_completion"] for r in per_rank),
            prompt_lens=[
                min(r["prompt_lens"][0] for r in per_rank),
                max(r["prompt_lens"][1] for r in per_rank),
            ],
            weights_equal_after_push=all(r["weights_equal_after_push"] for r in per_rank),
        )
        if ranks.main:
            print(par.table)
            print(json.dumps({k: v for k, v in rec.items() if k != "per_rank"}), flush=True)
        out["steps"].append(rec)
    if args.debug:
        assert ranks.world == 1, "the debugger runs in one process"
        debug(args, engine, model, prompts, cfg, out)
    return out


def debug(args, engine, model, prompts, cfg, out) -> None:
    def one_turn(prompt: list[int], max_tokens: int):
        def play():
            (out,), = engine.generate([prompt], 1, [1], [max_tokens], cfg.temperature)
            return rl.Episode(rl.RewardEnv(), [rl.Turn(prompt, out)])
        return play

    for plen in (5, 120, 300):
        rows, n_bad, _ = rl.debug_parity(engine, model, one_turn(prompts[0][:1] * plen, 40))
        print(f"--- debug: prompt {plen} tokens, up to 40 generated, {n_bad} logprobs differ")
        print(rl.format_debug(rows))
        out[f"debug_{plen}"] = dict(first=rl.first_divergence(rows), n_bad=n_bad)
    # a one-ulp error in layer 1's SiluAndMul (a forward hook changes its first output): the
    # debugger must name that module
    calls = {"n": 0}

    def bump(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == 1:
            output = output.clone()
            output.view(-1).view(torch.int16)[0] += 1
        return output

    handle = model.layers[1].feed_forward.act_fn.register_forward_hook(bump)
    try:
        rows, _, _ = rl.debug_parity(engine, model, one_turn([5] * 10, 5))
    finally:
        handle.remove()
    print(rl.format_debug(rows))
    out["debug_injected"] = dict(first=rl.first_divergence(rows))


def rollouts(args) -> dict:
    """Step 0's samples of every prompt (token ids and logprobs), in prompt order."""
    cfg, ranks, engine, model, engine_s = setup(args)
    prompts = prompts_for(args, min(args.vocab, model.args.vocab_size))
    mine = rl.my_prompts(len(prompts), ranks)
    ro = first_turns(engine, [prompts[i] for i in mine], mine, 0)
    G = cfg.group_size
    lps = torch.split(ro.logprobs, [len(c) for c in ro.completions])
    per_prompt = [
        [(ro.completions[j * G + g], lps[j * G + g].tolist()) for g in range(G)]
        for j in range(len(mine))
    ]
    samples = rl.in_prompt_order(rl.all_gather_objects(per_prompt))
    return dict(
        world=ranks.world,
        engine_start_s=engine_s,
        samples=samples,
        tokens=sum(len(c) for p in samples for c, _ in p),
    )


# the experiment's knobs and their defaults (the tiny model: 3 layers, GQA 4/2, head_dim 128)
OPTIONS = dict(
    temperature=1.0,
    steps=4,
    prompts=16,
    group=8,
    max_new_tokens=256,
    max_prompt=220,
    layers=3,
    vocab=384,
    hidden=512,
    heads=4,
    kv_heads=2,
    inter=1024,
    lr=1e-3,
    seed=0,
    micro_batch_tokens=65536,
    ckpt="",
)  # one packed forward per step by default


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["parity", "rollouts"])
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--debug",
        action="store_true",
        help="also run the parity debugger " "(needs --no-cuda-graphs)",
    )
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--engine-sleep", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", required=True)
    for name, default in OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = p.parse_args()
    if args.debug and args.cuda_graphs:
        p.error(
            "the debugger hooks vLLM's modules, which CUDA graph replay skips: add "
            "--no-cuda-graphs"
        )
    result = parity(args) if args.mode == "parity" else rollouts(args)
    if rl.is_main():
        Path(args.out).write_text(json.dumps(result, indent=1))
    rl.end_process_groups()


if __name__ == "__main__":
    main()
