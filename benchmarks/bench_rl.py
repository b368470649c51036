"""Time one RL step phase by phase: simple_rl against the alternatives, on the same model,
prompts and token counts.

    (a) bitwise  simple_rl as it is: batch-invariant vLLM, the trainer on vLLM's kernels,
                 packed micro-batches, engine asleep while the trainer runs, in-memory push
    (b) plain    the same engine settings with VLLM_BATCH_INVARIANT=0 (vLLM's default kernels),
                 the trainer on plain PyTorch kernels (cuBLAS, SDPA on a padded batch, autograd),
                 at most 8192 tokens a micro-batch (`plain_micro_batch`)
    (c) seed     the seed's design: bitwise kernels, one training forward per sample, weights
                 synced by writing safetensors and calling vLLM's reload_weights
    (d) user     what users run without bitwise parity: vLLM with its defaults (torch.compile,
                 CUDA graphs, its V2 model runner, async scheduling, no per-request seeds,
                 vLLM 0.34 as requirements.txt pins it) in-process as TRL's
                 colocate mode runs it, and a Hugging Face transformers Qwen3 trainer (fp32
                 master weights, bf16 autocast, the best attention transformers offers,
                 right-padded micro-batches as TRL pads them, of as many full-length rows as
                 fit beside its awake engine: `user_micro_batch`), in-memory push

Each design runs in its own process (VLLM_BATCH_INVARIANT is read when vLLM is imported);
`--nproc N` runs design (a) under torchrun on N GPUs (FSDP2 trainer, one engine per GPU):

    python benchmarks/bench_rl.py --model CKPT --out bench.json [--designs abcd] [--profile]
    python benchmarks/bench_rl.py --model CKPT --out bench.json --designs ad --rounds 3
    python benchmarks/bench_rl.py --model CKPT --out bench_n2.json --designs a --nproc 2
    python benchmarks/bench_rl.py --model CKPT --out bench_2048.json --new-tokens 2048
    python benchmarks/bench_rl.py --model CKPT --out bench_lora.json --designs a --lora-rank 16

`--lora-rank R` runs (a) as `simple_rl.py --lora-rank R` (frozen base shared with the engine,
adapters on every linear layer); its MFU counts 4 * params * tokens for the GEMMs (forward and
input gradient: a frozen base has no weight gradient).

Qwen3-MoE: Qwen3-30B-A3B's layers (4 of its 48, random weights, 3.1B parameters), 16 prompts
x 8, 128 new tokens, (a) against (d) (vLLM's default MoE path, transformers'
Qwen3MoeForCausalLM as AutoModelForCausalLM loads it); about 4 minutes on one H200:

    python tests/test_moe_gpu.py CKPT --preset qwen3-30b-a3b-4l
    python benchmarks/bench_rl.py --model CKPT --designs ad --prompts 16 --group 8 \
        --new-tokens 128 --out bench_moe.json

Workload: 32 prompts x 8 samples, prompts of 128 random tokens, 256 new tokens, 1 warm-up
step and 3 measured steps; a timing is the median over the measured steps (of every round,
with `--rounds`, which runs the designs in turn that many times). MFU counts
6 * params * tokens for the GEMMs (the LM head only at generated positions, where the trainer
computes it; for Qwen3-MoE the router and the k experts a token runs, not all E) plus
6 * layers * heads * head_dim * sum(L^2) for causal attention, over N GPUs x 989 TFLOP/s
(H100/H200 SXM dense bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM datasheet
HBM_BYTES_S = 4.8e12  # H200 SXM datasheet
LOGIT_PASSES = 4  # the sampler's fp32 passes over a step's logits (write, log-softmax, noise, pick)
# (d)'s largest micro-batch: its padded fp32-master trainer peaked at 93-105 GiB with 8192
# tokens at 1.7B and 256 new tokens on an H200, so the 24576 that simple_rl picks would not fit.
USER_MICRO_BATCH = 8192
# (d)'s activations per token over what simple_rl's estimate counts for its own trainer: HF's
# Qwen3 keeps fp32 residuals and norms, and the logprobs of every position unfused. From that
# peak, 105 GiB: 11 KV cache + 3 engine weights + 26 trainer state + 3 bf16 weight copies + 4
# fixed leave 58 GiB of activations at 8192 tokens, where simple_rl's estimate counts 23.6.
USER_ACTIVATIONS = 2.5
DESIGNS = {"a": "bitwise", "b": "plain", "c": "seed", "d": "user"}
GEMM_FLOPS = {"full": 6, "lora": 4}  # per parameter and token: with, without weight gradients


def flops_per_step(args, seq_lens: list[int], n_generated: int, gemm: int = 6) -> float:
    """Training FLOPs (forward + backward) of one batch.

    GEMMs: g * P_layers * T  +  g * V * d * N_gen  (the head runs at generated positions only;
    g = 6, or 4 for a frozen base: GEMM_FLOPS),
    where a Qwen3-MoE sparse layer's MLP counts its router (d * E) and the k experts a token
    runs (k * 3 * d * I_moe) in place of the dense 3 * d * I (Qwen3.5-MoE: its shared expert
    and that expert's gate too, 3 * d * S + d); a Qwen3.5's full attention counts its output
    gate (q's projection is 2 Hq D wide), its Gated DeltaNet layers their projections,
    d (2 Hk Dk + 3 Hv Dv + 2 Hv) (in: q k v z, b a; out), and their rule as the recurrent form
    runs it, 3 * 6 Hv Dk Dv a token (q S, k S and the rank-one update, forward and backward;
    the conv, 4 taps, is left out);
    attention (causal): 6 * full-attention layers * n_heads * head_dim * sum_b L_b^2.
    """
    import simple_rl as rl

    d, hd, hq, hk, inter = args.dim, args.head_dim, args.n_heads, args.n_kv_heads, args.hidden_dim
    c, n_gdn = rl.qwen35(args), len(rl.gdn_layers(args))
    n_full = args.n_layers - n_gdn
    attn = d * (hq * (2 if c else 1) + 2 * hk) * hd + hq * hd * d  # q (+ gate), k, v; o
    mixers = n_full * attn
    if n_gdn:
        mixers += n_gdn * d * (2 * c.k_heads * c.k_dim + 3 * c.v_heads * c.v_dim
                                  + 2 * c.v_heads)
    n_sparse = len(rl.sparse_layers(args))
    mlp = 3 * d * inter * (args.n_layers - n_sparse)  # gate/up, down
    if n_sparse:
        m, shared = args.moe_args, getattr(c, "shared_expert_dim", 0)
        mlp += n_sparse * (m.top_k * 3 * d * args.moe_inter_dim + d * m.num_experts
                           + (3 * d * shared + d if shared else 0))
    tokens = sum(seq_lens)
    rule = 3 * 6 * n_gdn * c.v_heads * c.k_dim * c.v_dim * tokens if n_gdn else 0
    flops = gemm * (mixers + mlp) * tokens + gemm * args.vocab_size * d * n_generated + rule
    attention = 6 * n_full * hq * hd * sum(n * n for n in seq_lens)
    return float(flops + attention)


def plain_kernels():
    """(b): plain PyTorch forwards with autograd; attention by SDPA on the padded batch.

    Right padding with is_causal=True is exact for every real token: token i attends to keys
    0..i, all of them real.
    """
    import torch.nn.functional as F

    import batch_invariant_backward as bib

    def attention(q, k, v, cu_seqlens, max_seqlen, scale):
        qp, valid = bib._pad(q, cu_seqlens, max_seqlen)
        kp, _ = bib._pad(k, cu_seqlens, max_seqlen)
        vp, _ = bib._pad(v, cu_seqlens, max_seqlen)
        o = F.scaled_dot_product_attention(
            qp.to(q.dtype),
            kp.to(q.dtype),
            vp.to(q.dtype),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return bib._unpad(o, valid).to(q.dtype)

    ref = bib.reference_kernels()
    return bib.Kernels(**{**ref.__dict__, "name": "plain", "attention": attention})


def floors(args, samples: int, prompt_len: int, new_tokens: int, update_flops: float,
           world: int = 1) -> dict | None:
    """Seconds each phase would take on one of `world` H200s running every kernel at its
    datasheet peak, one kernel after another (a dense Qwen3 or Qwen3.5; None for an MoE):

        decode step t:  max(bf16 weights / HBM, 2 params x samples / FLOP/s)    the GEMMs
                        + samples x (prompt_len + t) x KV bytes a token / HBM  attention
                        + samples x 2 x Gated DeltaNet state bytes / HBM      (Qwen3.5) read,
                                                                               written
                        + LOGIT_PASSES x samples x vocab x 4 / HBM             the sampler
        update:         its FLOPs (6 N per token + attention) / FLOP/s
        push:           fp32 masters read + bf16 copy written, 6 params / HBM
    """
    import simple_rl as rl

    if rl.sparse_layers(args):
        return None
    params, per_rank = rl.count_params(args), samples // world
    kv_token = rl.kv_bytes_per_token(args)
    state = 2 * len(rl.gdn_layers(args)) * rl.gdn_state_bytes(args) if rl.qwen35(args) else 0
    gemm = max(2 * params / HBM_BYTES_S, 2 * params * per_rank / PEAK_FLOPS)
    logits = LOGIT_PASSES * per_rank * args.vocab_size * 4 / HBM_BYTES_S
    kv = sum(per_rank * (prompt_len + t) * kv_token for t in range(new_tokens)) / HBM_BYTES_S
    out = dict(rollout_s=new_tokens * (gemm + logits + per_rank * state / HBM_BYTES_S) + kv,
               fwd_bwd_s=update_flops / (PEAK_FLOPS * world), push_s=6 * params / HBM_BYTES_S)
    out["step_s"] = sum(out.values())
    return out


def workload_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()  # id 0: eos in tests


def seed_engine_class():
    import simple_rl as rl

    class SeedEngine(rl.VLLMEngine):
        """(c): weights go through safetensors on disk and vLLM's reload_weights, as in the seed."""

        def push(self, weights) -> float:
            out = self.__dict__.setdefault("push_dir", Path(tempfile.mkdtemp(prefix="seed_")))
            t0 = time.perf_counter()
            if self.asleep:
                self.llm.wake_up()
                self.asleep = False
            wake_s = time.perf_counter() - t0
            rl.save_hf_checkpoint(out, dict(weights), Path(self.cfg.model))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(out)})
            self.llm.reset_prefix_cache()
            return wake_s

    return SeedEngine


def user_engine_class():
    """(d): vLLM with its defaults, in this process (as TRL's colocate mode runs it)."""
    import simple_rl as rl

    class UserEngine(rl.VLLMEngine):
        def __init__(self, cfg, files, ranks):
            from vllm import LLM

            self.cfg = rl.dataclasses.replace(cfg, engine_sleep=False)  # TRL's default
            self.stop_ids, self.asleep = files.eos_ids, False
            self.returns_routes = False  # users' stacks do not compare routed experts
            samples = rl.samples_per_rank(cfg, ranks.world)
            self.llm = LLM(
                model=str(files.path),
                skip_tokenizer_init=True,
                dtype=cfg.dtype,
                seed=cfg.seed,
                max_model_len=cfg.max_model_len,
                kv_cache_memory_bytes=rl.kv_cache_bytes(cfg, files.args, ranks.world),
                gpu_memory_utilization=0.5,
                logprobs_mode="processed_logprobs",
                max_num_seqs=samples,
            )

        def sampling_params(self, seed, **kw):
            return super().sampling_params(None, **kw)  # unseeded, as TRL asks: one noise draw

    return UserEngine


def user_peak(cfg, args, tokens: int) -> float:
    """(d)'s peak bytes on one GPU at `tokens` a micro-batch: what it keeps resident through
    the update (the engine awake: bf16 weights and KV cache; fp32 master, gradient and AdamW
    state; autocast's bf16 copy of every weight), fixed costs, and USER_ACTIVATIONS times the
    activations simple_rl's estimate counts for that many tokens."""
    import simple_rl as rl

    # any prompt lengths: (d)'s padded rows all go through its head
    est = rl.memory_estimate(rl.dataclasses.replace(cfg, micro_batch_tokens=tokens,
                                                    engine_sleep=False), args, 1)
    resident = est["engine"] + est["trainer state"] + est["bf16 weights"]
    return resident + rl.MEMORY_FIXED + USER_ACTIVATIONS * est["activations"]


def user_micro_batch(cfg, args, total: float) -> int:
    """(d)'s micro-batch in tokens: k full-length rows (its rows are padded to the longest), the
    most k with k rows <= USER_MICRO_BATCH tokens whose `user_peak` fits `total` bytes; else one
    row. With the KV cache resident, 2048 new tokens leave room for 2 rows at 1.7B on an H200,
    where 256 leave room for 21 (the 3 rows that 8192 tokens hold at 2048 ran out of memory)."""
    seq = cfg.max_model_len
    rows = [k for k in range(1, max(1, USER_MICRO_BATCH // seq) + 1)
            if user_peak(cfg, args, k * seq) <= total]
    return max(rows, default=1) * seq


def plain_micro_batch(cfg) -> int:
    """(b)'s micro-batch: what simple_rl picks, at most USER_MICRO_BATCH tokens (or one row).
    Its padded batches hold more per token than simple_rl's packed ones: at 2048 new tokens on
    an H200 the 24576 tokens simple_rl picks at 1.7B ran out of memory, 8192 peaked at 137 of
    its 140 GiB (a smaller GPU needs --micro-batch-tokens)."""
    return min(cfg.micro_batch_tokens, max(USER_MICRO_BATCH, cfg.max_model_len))


class HFTrainer:
    """(d)'s trainer: transformers' Qwen3 in fp32 with bf16 autocast, right-padded micro-batches,
    the same GRPO loss, fused AdamW. A Qwen3-MoE checkpoint loads as Qwen3MoeForCausalLM with
    transformers' default experts (`experts`: grouped_mm where torch has it, else a loop) and no
    router logits or load-balancing loss (output_router_logits is false in Qwen3-MoE's config)."""

    def __init__(self, path, cfg, device):
        import importlib.util

        import torch
        from transformers import AutoModelForCausalLM

        self.attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=self.attn
        ).to(device)
        self.model.gradient_checkpointing_disable()
        self.experts = getattr(self.model.config, "_experts_implementation", None)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, fused=True)
        self.cfg, self.device = cfg, device

    def step(self, rollout, adv, n_tokens: int):
        """One update over padded micro-batches; returns the logprobs (N,) of the first pass."""
        import torch

        import simple_rl as rl

        cfg, dev = self.cfg, self.device
        lens = [len(p) + len(c) for p, c in zip(rollout.prompts, rollout.completions)]
        out = []
        for group in rl.micro_batches(lens, cfg.micro_batch_tokens):
            rows = [rollout.prompts[i] + rollout.completions[i] for i in group]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            gen = torch.zeros(len(rows), width, dtype=torch.bool)  # positions predicting a target
            targets = []
            for r, i in enumerate(group):
                p, c = rollout.prompts[i], rollout.completions[i]
                ids[r, : len(p) + len(c)] = torch.tensor(p + c)
                mask[r, : len(p) + len(c)] = 1
                gen[r, len(p) - 1 : len(p) + len(c) - 1] = True
                targets += c
            ids, mask, gen = ids.to(dev), mask.to(dev), gen.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, L, V)
            z = logits[gen].float() / cfg.temperature  # (N_mb, V)
            t = torch.tensor(targets, device=dev)
            logp = z.gather(-1, t[:, None])[:, 0] - torch.logsumexp(z, -1)
            sample = torch.tensor(
                [j for j, i in enumerate(group) for _ in rollout.completions[i]], device=dev
            )
            n0 = sum(len(rollout.completions[i]) for i in range(group.start))
            old = rollout.logprobs[n0 : n0 + len(targets)].to(dev)
            pg, _, _ = rl.ppo_clip_loss(logp, old, adv[sample + group.start], cfg.clip_eps)
            (pg.sum() / n_tokens).backward()
            out.append(logp.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.cat(out)

    def weights(self):
        import torch

        return ((k, v.detach().to(torch.bfloat16)) for k, v in self.model.state_dict().items())


def measure(
    design: str,
    model_dir: str,
    steps: int,
    warmup: int,
    prompts_n: int,
    group: int,
    prompt_len: int,
    new_tokens: int,
    micro_batch_tokens: int,
    engine_factory=None,
    device_type: str = "cuda",
    profile_to: Path | None = None,
    lora_rank: int = 0,
) -> dict:
    """Warm-up + measured steps of one design in this process (or this torchrun rank)."""

    import batch_invariant_backward as bib
    import simple_rl as rl

    ranks = rl.init_ranks(device_type)
    cpu = device_type == "cpu"
    seq = prompt_len + new_tokens + 1
    cfg = rl.Config(
        model=model_dir,
        num_prompts=prompts_n,
        group_size=group,
        max_new_tokens=new_tokens,
        max_model_len=seq,
        micro_batch_tokens=micro_batch_tokens and max(micro_batch_tokens, seq),
        lr=1e-6,
        kernels="reference" if design == "b" else "vllm",
        dtype="float32" if cpu else "bfloat16",
        lora_rank=lora_rank if design == "a" else 0,
    )
    files = rl.load_model_files(cfg)
    files.args.frozen_base = bool(cfg.lora_rank)  # step_row's MFU: no weight gradient
    if design == "d" and not cfg.micro_batch_tokens:  # the most rows its memory rule fits
        cuda = rl.torch.cuda
        total = float("inf") if cpu else cuda.get_device_properties(ranks.device).total_memory
        mbt = user_micro_batch(cfg, files.args, total)
        cfg = rl.dataclasses.replace(cfg, micro_batch_tokens=mbt)
    lengths = (prompt_len, prompt_len)  # every prompt is prompt_len tokens
    cfg = rl.with_micro_batch(cfg, files.args, ranks, lengths)  # 0: what simple_rl picks here
    if design == "b" and not micro_batch_tokens:
        cfg = rl.dataclasses.replace(cfg, micro_batch_tokens=plain_micro_batch(cfg))
    if not cpu and design != "d":  # a config simple_rl would refuse, refused before the engine
        rl.check_memory(cfg, files.args, ranks, lengths)
    if engine_factory is None:  # (b) is (a)'s engine: VLLM_BATCH_INVARIANT=0 changes its kernels
        engine_factory = {
            "a": rl.VLLMEngine,
            "b": rl.VLLMEngine,
            "c": seed_engine_class(),
            "d": user_engine_class(),
        }[design]
    engine = engine_factory(cfg, files, ranks)
    if design == "d":
        hf_trainer = HFTrainer(files.path, cfg, ranks.device)
        engine.push(hf_trainer.weights())
        model = optimizer = None
        experts = f"transformers {hf_trainer.experts}"
    else:
        kernels = (
            plain_kernels()
            if design == "b"
            else bib.reference_kernels() if cpu else bib.vllm_kernels()
        )
        read = ranks.main and not (cfg.lora_rank and engine_factory is rl.VLLMEngine)
        state = rl.load_hf_state_dict(files.path) if read or (cfg.lora_rank and cpu) else {}
        model, _ = rl.build_models(cfg, files.args, state, kernels, ranks, engine)
        experts = kernels.name  # the experts' forward, and on vLLM's kernels their backward
        if kernels.name == "vllm":
            backward = bib.TRITON_BACKWARDS["moe_experts"]
            experts += f" + {getattr(backward, '__name__', repr(backward))}"
        engine.push(rl.policy_weights(model))
        optimizer = rl.make_optimizer(model, cfg)
        hf_trainer = None
    vocab = min(files.args.vocab_size, len(files.tokenizer))
    prompts = workload_prompts(prompts_n, prompt_len, vocab, 0)
    packed_micro_batches = rl.micro_batches
    if design == "c":  # the seed trained one sample per forward
        rl.micro_batches = lambda lengths, max_tokens: [
            range(i, i + 1) for i in range(len(lengths))
        ]
    try:
        if design == "d":
            rows = [user_step(step, step < warmup, engine, hf_trainer, prompts, cfg, ranks,
                              files) for step in range(warmup + steps)]
        else:
            trainer = bench_trainer(cfg, Recording(engine), model, optimizer, files, ranks,
                                    prompts)
            rows = [timed_rl_step(trainer, step, step < warmup, files.args)
                    for step in range(warmup + steps)]
        if profile_to and design in "ab":
            profile_update(model, optimizer, prompts, engine, cfg, ranks, profile_to)
    finally:
        rl.micro_batches = packed_micro_batches
    out = summarize(rows, design, ranks.world, hf_trainer.attn if hf_trainer else "fa3-varlen")
    out["micro_batch_tokens"] = cfg.micro_batch_tokens
    if cfg.lora_rank:
        out["name"] += f"+lora{cfg.lora_rank}"
    estimate = (user_peak(cfg, files.args, cfg.micro_batch_tokens) if design == "d"
                else rl.memory_estimate(cfg, files.args, ranks.world, lengths)["peak"])
    out["estimate_gib"] = estimate / 2**30  # what the design's memory rule expects
    if rl.sparse_layers(files.args):
        out["experts"] = experts
    out["floor"] = floors(files.args, prompts_n * group, prompt_len, new_tokens, out["flops"],
                          ranks.world)
    if ranks.world > 1:
        out["all_gather_gb_s"] = all_gather_bandwidth(ranks)
    return out


TIMINGS = ("rollout_s", "fwd_bwd_s", "optimizer_s", "push_s", "step_s", "sleep_s")
COUNTS = ("generated_tokens", "trained_tokens", "samples", "flops")


def summarize(rows: list[dict], design: str, world: int, attention: str) -> dict:
    """One design's row from its steps: the median of each timing over the measured steps (a
    noisy host's slow step moves it less than a mean), the mean of each count, the largest
    memory peak, the mismatches summed; rates and MFU from those."""
    measured = [r for r in rows if not r["warmup"]]
    out = {k: statistics.median(r[k] for r in measured) for k in TIMINGS}
    out.update({k: sum(r[k] for r in measured) / len(measured) for k in COUNTS})
    out.update(
        design=design,
        name=DESIGNS[design],
        nproc=world,
        mismatched=sum(r["mismatched"] for r in measured),
        rollout_tok_s=out["generated_tokens"] / out["rollout_s"],
        trainer_tok_s=out["trained_tokens"] / out["fwd_bwd_s"],
        samples_s=out["samples"] / out["step_s"],
        mfu=out["flops"] / out["fwd_bwd_s"] / (PEAK_FLOPS * world),
        peak_gib=max(r["peak_gib"] for r in rows),
        steps=rows,
        attention=attention,
    )
    return out


def pool(rounds: list[dict]) -> dict:
    """One design's rounds (separate processes, interleaved with the other designs) as one row
    over all their steps."""
    first = rounds[0]
    steps = [s for r in rounds for s in r["steps"]]
    out = summarize(steps, first["design"], first["nproc"], first["attention"])
    out["micro_batch_tokens"] = first.get("micro_batch_tokens", 0)
    out["floor"] = first.get("floor")
    for key in ("all_gather_gb_s", "estimate_gib", "experts"):
        if key in first:
            out[key] = first[key]
    out["name"] = first["name"]  # with its LoRA rank, if any
    return out


def device_used_gib(ranks) -> float:
    """Memory in use on this GPU now (every allocator: PyTorch's and vLLM's), max over ranks."""
    import torch

    import simple_rl as rl

    used = torch.tensor([rl.device_in_use(ranks.device) / 2**30], device=ranks.device)
    return float(rl.all_reduce(used, rl.dist.ReduceOp.MAX))


def stand_in_reward(completion: str, answer: str) -> float:
    """A reward that needs no task: 1 for a completion whose text has an even length. Random
    tokens give both kinds in a group, so the advantages, and the update, are not zero."""
    return float(len(completion) % 2 == 0)


def bench_trainer(cfg, engine, model, optimizer, files, ranks, prompts):
    """simple_rl's own Trainer over the workload: the random prompts as the task's prompts,
    scored by the stand-in reward."""
    import simple_rl as rl

    problems = [rl.Problem(f"prompt {i}", "") for i in range(len(prompts))]
    task = rl.Task(problems, prompts, eval_problems=[], eval_prompt_ids=[])
    return rl.Trainer(cfg, engine, files.tokenizer, model, None, optimizer, task, ranks,
                      reward_fn=stand_in_reward)


class Recording:
    """An engine that keeps its last rollout (the step's first turn, which is all of a step
    without an env) as the trainer packs it: its lengths give the step's trained tokens."""

    def __init__(self, engine):
        self.engine, self.last = engine, None

    def first_turn(self, prompts, indices, step):
        outs = self.engine.first_turn(prompts, indices, step)
        self.last = first_turns(prompts, outs, self.engine)
        return outs

    def __getattr__(self, name):  # sleep, push, greedy, llm: the engine's own
        return getattr(self.engine, name)


def first_turns(prompts, outs, engine):
    """A step's first turn (the engine's first_turn's completions) as simple_rl's trainer packs
    it: one episode of one turn per sample, with no env."""
    import simple_rl as rl

    episodes = rl.start_episodes([None] * sum(map(len, outs)), prompts, outs, engine.cfg)
    return rl.episodes_rollout(episodes, engine.returns_routes)


def timed_rl_step(trainer, step: int, warmup: bool, args) -> dict:
    """simple_rl's `rl_step` as it is, timed by the phases it already separates (rollout,
    update with the parity check, push), with optimizer.step timed apart.

    Times are the slowest rank's; token counts are summed over ranks."""
    import torch

    import simple_rl as rl

    dev = trainer.ranks.device
    spent = time_optimizer(trainer.optimizer, dev)
    sync(dev)
    metrics, parity = rl.rl_step(trainer, step)
    ro = trainer.engine.last
    lens = [len(p) + len(c) for p, c in zip(ro.prompts, ro.completions)]
    rollout_s, train_s, push_s = (metrics[f"time/{k}_s"] for k in ("rollout", "train", "push"))
    local = torch.tensor([rollout_s, train_s - spent["s"], spent["s"], push_s,
                          metrics["time/step_s"], metrics["time/engine_sleep_s"]], device=dev)
    row = step_row(step, warmup, local, lens, sum(map(len, ro.completions)), parity, args,
                   trainer.ranks, trainer.cfg.num_prompts * trainer.cfg.group_size,
                   metrics.get("memory/in_use_gib", 0.0))
    row.update({k: v for k, v in metrics.items() if k.startswith("memory/")})  # by phase
    return row


def user_step(step, warmup, engine, trainer, prompts, cfg, ranks, files) -> dict:
    """(d)'s step, which differs from simple_rl's by design (an HF trainer on padded batches):
    rollout -> the same stand-in reward -> update with the parity count -> push."""
    import torch

    import simple_rl as rl

    dev = ranks.device
    mine = rl.my_prompts(len(prompts), ranks)
    sync(dev)
    t0 = time.perf_counter()
    mine_prompts = [prompts[i] for i in mine]
    ro = first_turns(mine_prompts, engine.first_turn(mine_prompts, mine, step), engine)
    sync(dev)
    peak = device_used_gib(ranks)
    t1 = time.perf_counter()
    packed = rl.pack(ro.prompts, ro.completions)
    texts = rl.decode(files.tokenizer, ro.completions)
    rewards = rl.score(stand_in_reward, texts, [""] * len(texts))
    adv = rl.group_advantages(rewards, cfg.group_size, True, 1e-6).to(dev)
    _, n_tokens = rl.batch_over_ranks(packed, cfg, dev)
    logp = trainer.step(ro, adv, n_tokens)
    parity = rl.parity_over_ranks(rl.parity_report(ro.logprobs, logp, packed.targets,
                                                      rl.generated_lengths(ro), 0), dev)
    sync(dev)
    peak = max(peak, device_used_gib(ranks))
    t2 = time.perf_counter()
    engine.push(trainer.weights())
    sync(dev)
    t3 = time.perf_counter()
    lens = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    local = torch.tensor([t1 - t0, t2 - t1, 0.0, t3 - t2, t3 - t0, 0.0], device=dev)  # no sleep
    return step_row(step, warmup, local, lens, len(logp), parity, files.args, ranks,
                    len(prompts) * cfg.group_size, max(peak, device_used_gib(ranks)))


def step_row(step, warmup, local, lens, n_generated, parity, args, ranks, samples,
             peak_gib) -> dict:
    """One step's row: times (rollout, update less optimizer.step, optimizer, push, step, and
    the engine's sleep within the rollout) as the slowest rank's, tokens and FLOPs summed over
    ranks (lens and n_generated are this rank's); printed as JSON on rank 0. The update holds
    the decode, reward and advantages (a few ms), and for (d) its optimizer step too."""
    import torch

    import simple_rl as rl

    times = rl.all_reduce(local, rl.dist.ReduceOp.MAX).tolist()
    gemm = GEMM_FLOPS["lora" if getattr(args, "frozen_base", False) else "full"]
    counts = rl.all_reduce(torch.tensor([sum(lens), flops_per_step(args, lens, n_generated, gemm)],
                                        device=ranks.device, dtype=torch.float64)).tolist()
    row = dict(
        step=step,
        warmup=warmup,
        rollout_s=times[0],
        fwd_bwd_s=times[1],
        optimizer_s=times[2],
        push_s=times[3],
        step_s=times[4],
        sleep_s=times[5],  # the engine's sleep, within rollout_s
        generated_tokens=parity.n_tokens,
        trained_tokens=int(counts[0]),
        samples=samples,
        mismatched=parity.n_mismatch,
        flops=counts[1],
        peak_gib=peak_gib,
    )
    if ranks.main:
        print(json.dumps(row), flush=True)
    return row


def time_optimizer(optimizer, device) -> dict:
    """Time optimizer.step (synchronised) so it can be split from forward + backward."""
    spent = {"s": 0.0}
    step = optimizer.__dict__.get("_untimed_step", optimizer.step)
    optimizer._untimed_step = step

    def timed(*a, **k):
        sync(device)
        t = time.perf_counter()
        result = step(*a, **k)
        sync(device)
        spent["s"] += time.perf_counter() - t
        return result

    optimizer.step = timed
    return spent


def all_gather_bandwidth(ranks, mib: int = 512, repeats: int = 5) -> float:
    """Bus bandwidth (GB/s) of an all-gather on the trainer's process group, as FSDP runs it:
    `mib` MiB of bf16 per rank, after vLLM has started (so its NCCL settings would show)."""
    import torch

    import simple_rl as rl

    n = mib * 2**20 // 2
    shard = torch.randn(n, device=ranks.device).bfloat16()
    full = torch.empty(n * ranks.world, device=ranks.device, dtype=torch.bfloat16)
    rl.dist.all_gather_into_tensor(full, shard)
    sync(ranks.device)
    t = time.perf_counter()
    for _ in range(repeats):
        rl.dist.all_gather_into_tensor(full, shard)
    sync(ranks.device)
    seconds = (time.perf_counter() - t) / repeats
    return full.numel() * 2 * (ranks.world - 1) / ranks.world / seconds / 1e9


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_update(
    model, optimizer, prompts, engine, cfg, ranks, path: Path, rows: int = 30
) -> None:
    """One more rollout and update under torch.profiler: for each, the wall time, the time the
    GPU spent in kernels, and the ops that take the GPU time, to a text file."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import simple_rl as rl

    cuda = ranks.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    mine = rl.my_prompts(len(prompts), ranks)
    with profile(activities=activities) as rollout_prof:
        t0 = time.perf_counter()
        mine_prompts = [prompts[i] for i in mine]
        ro = first_turns(mine_prompts, engine.first_turn(mine_prompts, mine, 10_000), engine)
        sync(ranks.device)
        rollout_s = time.perf_counter() - t0
    engine.sleep()
    packed = rl.pack(ro.prompts, ro.completions)
    adv = torch.linspace(-1, 1, len(ro.completions), device=ranks.device)
    n_micro, n_tokens = rl.batch_over_ranks(packed, cfg, ranks.device)
    with profile(activities=activities) as update_prof:
        t0 = time.perf_counter()
        rl.update(model, None, optimizer, packed, ro.logprobs.to(ranks.device), adv, cfg,
                  n_micro, n_tokens)
        sync(ranks.device)
        update_s = time.perf_counter() - t0
    engine.push(rl.hf_weights(model))
    if ranks.main:
        path.write_text(
            profile_section(f"rollout ({len(ro.completions)} samples, "
                            f"{max(map(len, ro.completions))} decode steps)",
                            rollout_prof, rollout_s, cuda, rows)
            + profile_section(f"update ({n_micro} micro-batches)", update_prof, update_s, cuda,
                              rows))


def profile_section(title: str, prof, wall_s: float, cuda: bool, rows: int) -> str:
    """A title, wall time vs GPU kernel time (busy fraction), and the top ops by their own GPU
    time (a parent op's total would count the profiler's launch-queue stalls as GPU time)."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "cpu_time_total"  # the kernels themselves
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy_s = sum(e.self_device_time_total for e in kernels) / 1e6  # each kernel counted once
    cpu_s = sum(e.self_cpu_time_total for e in events) / 1e6
    head = (f"== {title}: wall {wall_s:.3f} s, GPU kernels {busy_s:.3f} s "
            f"({busy_s / wall_s:.0%} busy), host ops {cpu_s:.3f} s (under the profiler)\n")
    return head + events.table(sort_by=key, row_limit=rows) + "\n\n"


def spread(result: dict, key: str) -> str:
    """'min-max' of one timing over a design's measured (not warm-up) steps."""
    values = [s[key] for s in result["steps"] if not s["warmup"]]
    return f"{min(values):.2f}-{max(values):.2f}"


def table(results: list[dict]) -> str:
    head = (
        f"{'design':<9} {'GPUs':>4} {'micro-b':>7} {'step s':>7} {'rollout s':>9} {'fwd+bwd s':>9} "
        f"{'optim s':>7} {'push s':>6} {'samples/s':>9} {'roll tok/s':>10} "
        f"{'train tok/s':>11} {'MFU':>6} {'peak GiB':>8} {'est GiB':>7} {'mismatch':>8}"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"{r['name']:<9} {r['nproc']:>4} {r.get('micro_batch_tokens', 0):>7} "
            f"{r['step_s']:>7.2f} {r['rollout_s']:>9.2f} "
            f"{r['fwd_bwd_s']:>9.2f} {r['optimizer_s']:>7.3f} {r['push_s']:>6.3f} "
            f"{r['samples_s']:>9.1f} {r['rollout_tok_s']:>10.0f} "
            f"{r['trainer_tok_s']:>11.0f} {r['mfu']:>6.1%} {r['peak_gib']:>8.1f} "
            f"{r.get('estimate_gib', 0):>7.1f} {r['mismatched']:>8}"
        )
    by = {(r["design"], r["nproc"]): r for r in results}
    a, d = by.get(("a", 1)), by.get(("d", 1))
    if a and d:
        lines.append(
            f"bitwise / user's stack: step {a['step_s'] / d['step_s']:.2f}x, rollout "
            f"{a['rollout_s'] / d['rollout_s']:.2f}x, trainer "
            f"{a['fwd_bwd_s'] / d['fwd_bwd_s']:.2f}x (target: step <= 1.0x)"
        )
    if a:
        lines.append(
            f"trainer MFU (a): {a['mfu']:.1%} (target >= 45%); weight push (a): "
            f"{a['push_s']:.3f} s; the engine's sleep within (a)'s rollout: "
            f"{a.get('sleep_s', 0):.3f} s"
        )
    if a and a.get("experts"):  # Qwen3-MoE: the targets, and which experts ran
        update = a["fwd_bwd_s"] + a["optimizer_s"]
        ran = {r["name"]: r["experts"] for r in results if "experts" in r}
        lines.append(f"MoE (a): update {update / a['rollout_s']:.2f}x the rollout (target <= "
                     "1.0x; step <= 0.6x (d)'s); experts: "
                     + ", ".join(f"{k} {v}" for k, v in ran.items()))
    if a and a.get("floor"):
        f = a["floor"]
        lines.append("floor (the H200's peak FLOP/s and bytes/s, kernel by kernel): " + ", ".join(
            f"{k[:-2]} {f[k]:.3g} s" for k in ("rollout_s", "fwd_bwd_s", "push_s", "step_s")))
    for r in results:  # a machine's step-to-step noise, next to the medians above
        if r.get("steps"):
            lines.append(f"{r['name']} per measured step, min-max s: " + ", ".join(
                f"{key} {spread(r, key)}" for key in ("step_s", "rollout_s", "fwd_bwd_s")))
    for (design, n), r in sorted(by.items()):
        if design == "a" and n > 1 and a:
            lines.append(
                f"(a) on {n} GPUs: {r['samples_s'] / a['samples_s']:.2f}x the samples/s "
                f"of 1 GPU; all-gather {r.get('all_gather_gb_s', 0):.0f} GB/s"
            )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        required=True,
        help="HF Qwen3 checkpoint directory (tests/make_checkpoint.py --preset ...)",
    )
    p.add_argument("--designs", default="abcd", help="which of a, b, c, d to run")
    p.add_argument("--nproc", type=int, default=1, help="GPUs for design (a), under torchrun")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the designs this many times, interleaved (a d a d ...), and pool their steps: "
        "a drifting machine then weighs on every design alike",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="0: what simple_rl picks")
    p.add_argument("--lora-rank", type=int, default=0, help="(a) with LoRA adapters of rank R")
    p.add_argument("--out", default="bench.json")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one more rollout and update of designs a and b (<out>.profile.txt)",
    )
    p.add_argument("--worker", choices=sorted(DESIGNS), help=argparse.SUPPRESS)
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():  # one sentence, not vLLM's traceback from a worker
        sys.exit("bench_rl: no CUDA GPU found; it measures simple_rl on GPUs (its designs' "
                 "CPU test: python -m pytest tests/test_bench.py).")
    knobs = dict(
        steps=a.steps,
        warmup=a.warmup,
        prompts_n=a.prompts,
        group=a.group,
        prompt_len=a.prompt_len,
        new_tokens=a.new_tokens,
        micro_batch_tokens=a.micro_batch_tokens,
        lora_rank=a.lora_rank,
    )
    if a.worker:
        profile_to = Path(a.out).with_suffix(".profile.txt") if a.profile else None
        import simple_rl as rl

        try:
            result = measure(a.worker, a.model, **knobs, profile_to=profile_to)
        except rl.ConfigError as e:  # one sentence and exit 2, as simple_rl.py says it
            print(f"bench_rl ({a.worker}): {e} (here --nproc is the GPUs)", file=sys.stderr)
            sys.exit(2)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(a.out).write_text(json.dumps(result))
        return
    assert a.nproc == 1 or a.designs == "a", "--nproc > 1 runs design a only"
    runs, failed = {d: [] for d in a.designs}, []
    for k, d in ((k, d) for k in range(a.rounds) for d in a.designs):
        out = Path(a.out).with_suffix(f".{d}{a.nproc}{f'.r{k}' if k else ''}.json")
        env = dict(
            os.environ,
            VLLM_BATCH_INVARIANT="0" if d in "bd" else "1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
        )
        launch = (
            [sys.executable]
            if a.nproc == 1
            else [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.nproc}"]
        )
        knob_args = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(a).items()
            if k not in ("nproc", "designs", "out", "worker", "profile", "rounds")
        ]
        done = subprocess.run(
            [
                *launch,
                __file__,
                *knob_args,
                *(["--profile"] if a.profile and k == 0 else []),
                "--worker",
                d,
                "--out",
                str(out),
            ],
            check=False,
            env=env,
        )
        if done.returncode:  # the other designs still run, and are reported
            failed.append(f"({d}) exited {done.returncode}")
            continue
        runs[d].append(json.loads(out.read_text()))
    results = [pool(runs[d]) for d in a.designs if runs[d]]
    workload = {**knobs, "rounds": a.rounds}
    Path(a.out).write_text(
        json.dumps({"workload": workload, "peak_flops": PEAK_FLOPS, "results": results}, indent=1)
    )
    print(table(results))
    if failed:
        sys.exit(f"bench_rl: {', '.join(failed)} (its output is above); the table has the rest")


if __name__ == "__main__":
    main()
