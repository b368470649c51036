"""simple_rl: bitwise-deterministic GRPO for Qwen3 and Qwen3.5 with vLLM rollouts, one GPU or many.

One file, the RL story first, in call order:

    config -> model -> load & convert -> rollout -> reward -> episodes -> advantages & loss
           -> update & parity check -> weight push -> rl_step, evaluate, train, setup

then, after one banner, the plumbing: validation, files, errors, ranks, vLLM patches, Qwen3.5
on vLLM, LoRA's engine slot, tools, the lookup task, checkpoints, run directory, logging,
memory estimate, console, stops, parity debugger.

vLLM samples `group_size` completions per prompt in batch-invariant mode. The trainer is a
TorchTitan-style Qwen3 whose forward calls *the same kernels* vLLM calls, with their backward
in `batch_invariant_backward.py`:
  * norms and activations: Triton RMSNorm, CUDA fused add+RMSNorm, rotary, SiluAndMul;
  * attention: FlashAttention 3 with num_splits=1; Qwen3.5's Gated DeltaNet: vLLM's conv1d and
    delta-rule kernels, the rule in the schedule vLLM ran (each prompt's prefill, then a step
    per generated token: the two forms' bits differ);
  * GEMMs: cuBLASLt without split-K, where vLLM's go on Hopper too (a layer of under 128
    output features: vLLM's Triton matmul on both sides); Qwen3-MoE: vLLM's top-k softmax and
    fused experts;
  * logprobs: a kernel that sums in the order of vLLM's Triton log_softmax.
So the trainer's logprob of every generated token equals vLLM's bit for bit (for MoE, every
token's experts too; checked where vLLM returns them: with its prefix cache on, the default);
every step checks that for every token of every sample, then pushes the new weights into vLLM.

The objective (GRPO, token-level, sample i of group g, generated token t):

    A_i     = (r_i - mean_g r) / (std_g r + eps)          (or r_i - mean_g r)
    rho_it  = exp(logp_theta(y_it) - logp_old(y_it))
    pg_it   = -min(rho_it A_i, clip(rho_it, 1 - eps_c, 1 + eps_c) A_i)
    kl_it   = exp(q_it) - q_it - 1,  q_it = logp_ref(y_it) - logp_theta(y_it)   (k3 estimator)
    L       = sum_it (pg_it + beta kl_it - c_H H_it) / (generated tokens in the batch, all ranks)

Departures from textbook GRPO/PPO:
  * The old policy is the one that sampled, as computed *by vLLM*. The trainer reproduces vLLM's
    numbers exactly, so rho = 1 at the first optimizer step; the clip acts only with
    `--updates-per-batch` > 1.
  * Logprobs are those of the sampling distribution softmax(logits / temperature): vLLM returns
    processed logprobs and the trainer divides its logits, cast to fp32, by it exactly as
    vLLM's sampler does, so parity holds at any temperature.
  * The loss is a token mean over the whole batch of every rank (each token weighs the same).
  * The trainer keeps fp32 master weights and computes in bf16; vLLM receives the bf16 cast,
    which is exactly what the trainer computes with (a Qwen3.5's A_log: fp32 on both sides).
  * LoRA (--lora-rank r): the base stays frozen in bf16 and is the engine's own tensors (one
    copy on the GPU); each --lora-targets layer adds (x A^T)(alpha/r B)^T through vLLM's LoRA
    kernels, the trainer's adapter casts being the engine's adapter slot, so the push moves no
    byte; the KL reference is the base (the adapters off).

Run (vLLM 0.34 + torch 2.14 + TorchTitan 0.2.2; `pip install -r requirements.txt`):

    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model Qwen/Qwen3-1.7B --steps 20
    VLLM_BATCH_INVARIANT=1 torchrun --nproc-per-node 2 simple_rl.py --model Qwen/Qwen3-8B
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model Qwen/Qwen3-14B --lora-rank 16 --lr 1e-5
    torchrun --nnodes M --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        simple_rl.py --model Qwen/Qwen3-8B
    tensorboard --logdir runs
    python simple_rl.py --resume latest --run-name RUN --steps 40     # continue a run

It learns (README "It learns"): a 25M Qwen3 warm-started here, then GRPO, on one GPU:

    python examples/warm_start.py --out warm/qwen3-arith
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model warm/qwen3-arith --steps 120 \\
        --num-prompts 64 --max-new-tokens 80 --max-model-len 128 --lr 1e-4 --eval-size 512 \\
        --eval-every 25 --no-engine-sleep

Held-out problems are scored greedily (temperature 0) before the first step, every --eval-every
steps and after the last (`eval/accuracy`); --reward FILE.py:FUNCTION and --task jsonl bring your
own reward and problems; --env FILE.py:NAME an environment of several turns (the model calls
a tool and goes on: an episode, trained on the model's tokens only; --env calc: a calculator).
    python simple_rl.py --model DIR --debug-parity                     # where do we differ?

Tests (any machine):

    python -m pip install -q -r requirements-cpu.txt && python -m pytest -q
"""

from __future__ import annotations

import os
import sys

# Run as a script this file is __main__; an env's `from simple_rl import ToolError` must find
# this module, not import a second copy whose ToolError end_turn would not catch.
if __name__ == "__main__":
    sys.modules.setdefault("simple_rl", sys.modules[__name__])

# PyTorch's C++ warnings (an experimental cuBLAS flag vLLM sets, a socket hostname lookup) and
# progress bars (vLLM 0.34's graph capture) are not the user's to act on; both settings are read
# when torch and tqdm load, so here. --verbose keeps them.
if "--verbose" not in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TQDM_DISABLE", "1")
# The trainer's allocator grows its segments in place rather than caching fixed blocks: at
# Qwen3-14B under LoRA the update's peak varied 96-130 GiB step to step without this, 91-92
# with it. vLLM's sleep-mode pool switches it off around its own allocations.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse
import contextlib
import dataclasses
import errno
import functools
import gc
import hashlib
import json
import math
import numbers
import pickle
import queue
import random
import re
import shutil
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not Exception

import batch_invariant_backward as bib


# ==========================================================================
# Config
# ==========================================================================


def flag(name: str) -> str:
    """A Config field's command-line flag: micro_batch_tokens -> --micro-batch-tokens."""
    return "--" + name.replace("_", "-")


def opt(group: str, default, help: str, choices: tuple | None = None):
    """A Config field: its --help group, text and allowed values drive the CLI."""
    return field(default=default, metadata=dict(group=group, help=help, choices=choices))


@dataclass
class Config:
    # --- model
    model: str = opt("model", "Qwen/Qwen3-1.7B",
                     "HF hub id, or a local directory with config.json, *.safetensors, tokenizer")
    dtype: str = opt("model", "bfloat16", "compute dtype of trainer and vLLM (float32: CPU tests)",
                     ("bfloat16", "float32"))
    kernels: str = opt("model", "auto", "auto (= vllm), vllm (batch-invariant; on a CPU, plain "
                       "PyTorch) or reference (not bitwise)", ("auto", "vllm", "reference"))
    # --- lora
    lora_rank: int = opt("lora", 0, "LoRA rank r: train adapters on a frozen bf16 base that the "
                         "engine shares (0: full fine-tuning). vLLM serves r in 1, 8, 16, 32, 64, "
                         "128, 256, 320, 512. LoRA wants about 10x full fine-tuning's --lr")
    lora_alpha: float = opt("lora", 32.0, "LoRA alpha: a layer adds (alpha / r) B A x")
    lora_targets: str = opt("lora", "all", "comma-separated layers that get adapters: q_proj, "
                            "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; Qwen3.5 "
                            "also in_proj_qkv, in_proj_z, out_proj, in_proj_b, in_proj_a (all: "
                            "every one but in_proj_b, in_proj_a; an MoE: no MLP)")
    export: str = opt("lora", "adapter", "the final export of a LoRA run: adapter (PEFT: "
                      "adapter_config.json + adapter_model.safetensors) or merged (a Hugging "
                      "Face checkpoint with B A added)", ("adapter", "merged"))
    # --- task: problems, reward, tools
    task: str = opt("task", "arithmetic", "arithmetic (embedded), gsm8k (hub or --data-files) "
                    "or jsonl (--data-files: your question/answer rows)",
                    ("arithmetic", "gsm8k", "jsonl"))
    data_files: str = opt("task", "", "local parquet or jsonl with question/answer fields")
    reward: str = opt("task", "", "FILE.py:FUNCTION, your reward(completion, answer) -> float "
                      "(default: 1 if the number after the last 'Answer:', else the last "
                      "number, is right)")
    env: str = opt("task", "", "episodes of several turns: calc (arithmetic with a calculator "
                   "tool), lookup (its own questions, 2-5 dependent <search> calls) or "
                   "FILE.py:NAME, your Env class (default: one turn, scored by --reward)")
    max_turns: int = opt("task", 4, "model turns per episode at most (each tool call ends one)")
    max_tool_tokens: int = opt("task", 0, "a tool message's tokens at most, the rest cut "
                               "(0: cut at --max-model-len); a message that leaves no room "
                               "for a token ends its episode as max_model_len")
    tool_workers: int = opt("task", 0, "threads running a turn's env calls at once, results "
                            "kept in episode order (0: one per episode)")
    tool_timeout: float = opt("task", 600.0, "seconds an env's step or reset (or a --reward "
                              "call) may run; past them its episode ends as tool_timeout, "
                              "reward 0 (0: no limit)")
    tool_stop: str = opt("task", "", "comma-separated strings, each one token, that end a turn "
                         "to call the tool (default: the env's tool_stop)")
    chat_template: str = opt("task", "auto", "wrap prompts in the tokenizer's chat template "
                             "(auto: when it has one)", ("auto", "on", "off"))
    enable_thinking: bool = opt("task", False, "let Qwen3 think (<think>...</think>) first")
    # --- generation (vLLM)
    num_prompts: int = opt("generation", 16, "prompts per step, over all ranks")
    group_size: int = opt("generation", 8, "completions sampled per prompt (G)")
    max_new_tokens: int = opt("generation", 256, "max tokens generated per turn")
    temperature: float = opt("generation", 1.0, "sampling temperature; logprobs are those of "
                             "softmax(logits / temperature)")
    max_model_len: int = opt("generation", 1024, "vLLM max sequence length (prompt + completion)")
    kv_cache_gib: float = opt("generation", 0.0, "vLLM KV cache per GPU in GiB (0: room for every "
                              "sample of a step at --max-model-len)")
    cuda_graphs: bool = opt("generation", True, "replay vLLM's decode steps as CUDA graphs (the "
                            "same kernels, fewer launches)")
    engine_sleep: bool = opt("generation", True, "free vLLM's KV cache while the trainer runs "
                             "(sleep mode), and, without LoRA, its weights")
    prefix_caching: bool = opt("generation", True, "let vLLM reuse the KV of prefixes it has seen "
                               "(an episode's earlier turns, a prompt's G samples); off, a "
                               "Qwen3-MoE's routes go unchecked (vLLM returns them with it)")
    # --- grpo
    clip_eps: float = opt("grpo", 0.2, "PPO clip range eps_c")
    kl_coef: float = opt("grpo", 0.0, "beta of the k3 KL to the frozen initial policy "
                         "(0: no reference model)")
    entropy_coef: float = opt("grpo", 0.0, "c_H, entropy bonus (entropy is always logged)")
    std_normalize: bool = opt("grpo", True, "divide advantages by the group std "
                              "(--no-std-normalize: mean-only)")
    adv_eps: float = opt("grpo", 1e-6, "eps in (r - mean) / (std + eps)")
    updates_per_batch: int = opt("grpo", 1, "optimizer steps per rollout batch "
                                 "(>1 makes the PPO clip act)")
    # --- optim
    steps: int = opt("optim", 10, "training steps (rollout + update + weight push)")
    lr: float = opt("optim", 1e-6, "AdamW learning rate")
    weight_decay: float = opt("optim", 0.0, "AdamW weight decay")
    beta1: float = opt("optim", 0.9, "AdamW beta1")
    beta2: float = opt("optim", 0.999, "AdamW beta2")
    grad_clip: float = opt("optim", 1.0, "max global grad norm (0: off)")
    micro_batch_tokens: int = opt("optim", 0, "max packed tokens per trainer forward/backward "
                                  "(0: the largest the GPU's memory fits, up to 32768 or one "
                                  "--max-model-len sequence)")
    # --- eval
    eval_every: int = opt("eval", 0, "held-out greedy eval every N steps (0: only before a "
                          "fresh run's first step and after the last)")
    eval_size: int = opt("eval", 256, "held-out problems, disjoint from the training pool "
                         "(0: no eval)")
    # --- logging
    seed: int = opt("logging", 0, "seed for prompts, sampling and everything else (the "
                    "held-out candidates are fixed)")
    log_dir: str = opt("logging", "runs", "TensorBoard root; a run logs to LOG_DIR/RUN_NAME")
    run_name: str = opt("logging", "", "run name: letters, digits, . _ - (default: time stamp)")
    output_dir: str = opt("logging", "", "final HF checkpoint (default: LOG_DIR/RUN_NAME/final)")
    parity_rows: int = opt("logging", 8, "rows of the parity table (first tokens, or the "
                           "first samples that differ)")
    parity_every: int = opt("logging", 10, "print the parity table every N steps (always when "
                            "a token differs)")
    strict_parity: bool = opt("logging", False, "stop at the first step with a differing token "
                              "or a token routed to other experts")
    debug_parity: bool = opt("logging", False, "compare trainer and vLLM op by op on step 0's "
                             "first episode, every turn, print where they diverge, exit")
    log_param_deltas: bool = opt("logging", False, "log weight deltas per parameter, not only "
                                 "per layer")
    verbose: bool = opt("logging", False, "show vLLM's and the libraries' INFO logs and warnings")
    check: bool = opt("logging", False, "run every check that needs no GPU (config, model files, "
                      "tokenizer, data, reward, run directory), one line each, and exit")
    # --- checkpoints
    save_every: int = opt("checkpoints", 10, "save a checkpoint every N steps (0: only on "
                          "Ctrl-C/SIGTERM)")
    keep_last: int = opt("checkpoints", 3, "checkpoints to keep")
    resume: str = opt("checkpoints", "", "continue from a checkpoint directory, or 'latest'")
    overwrite: bool = opt("checkpoints", False, "replace LOG_DIR/RUN_NAME if it holds a run")
    allow_changed_files: bool = opt("checkpoints", False, "resume with a --reward, --env, "
                                    "--model or --data-files whose files differ from the "
                                    "checkpoint's run's")


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ==========================================================================
# Model: Qwen3 (and Qwen3.5, Qwen3-MoE) computing exactly what vLLM computes
# ==========================================================================
# Each module owns its forward and calls the kernel vLLM's module of the same role calls.
# Parameters are fp32 masters (LoRA's frozen base: the engine's own bf16 tensors) that a forward
# casts to the compute dtype, so the bf16 weights it computes with are exactly vLLM's; where and
# how often each cast runs (FSDP2's all-gather, LoRA's adapter slot): `weights_cast_once`.


@dataclass(frozen=True)
class Qwen35Args:
    """What Qwen3.5 adds to TorchTitan's Qwen3ModelArgs (model_args_from_hf sets it on them as
    `qwen35`; Qwen3 has none): the kind of every layer, the linear attention's shape, the
    rotated part of a full-attention head, Qwen3.5-MoE's shared expert."""

    layer_types: tuple[str, ...]  # per layer: "linear_attention" (Gated DeltaNet) or "full_..."
    k_heads: int  # linear_num_key_heads
    v_heads: int  # linear_num_value_heads, a multiple of k_heads (each k head serves a group)
    k_dim: int  # linear_key_head_dim
    v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim: the causal convolution's taps
    rotary_dim: int  # head_dim * partial_rotary_factor (a quarter of each head)
    shared_expert_dim: int = 0  # shared_expert_intermediate_size (Qwen3.5-MoE; 0: none)


def qwen35(args) -> Qwen35Args | None:
    """What a Qwen3.5 adds to the model args, or None (Qwen3, Qwen3-MoE)."""
    return getattr(args, "qwen35", None)


def gdn_layers(args) -> tuple[int, ...]:
    """The layers whose token mixer is linear attention (Gated DeltaNet): Qwen3.5's three in
    four; Qwen3 has none."""
    c = qwen35(args)
    return tuple(i for i, t in enumerate(c.layer_types) if t == "linear_attention") if c else ()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for FSDP's DTensor shards)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of the tensor (its shard of an FSDP DTensor), without communication."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class Packed:
    """What every forward takes (pack builds it, in "Rollout"): sequences back to back, no
    padding. A sequence b is an episode (Rollout's b), or a Qwen3.5's turn (pack_rollout says
    whose episode); in a micro-batch (sub_pack), b counts from its first. E.g. prompts [a b],
    [c] and completions [x y], [z]: tokens a b x y c z, positions 0 1 2 3 0 1, cu_seqlens
    0 4 6, targets x y z, predicted at gen_index 1 2 4 (the rows of b, x, c), seq 0 0 1,
    prefill 2 1."""
    tokens: torch.Tensor  # (T,) prompt + completion of every sequence, back to back
    positions: torch.Tensor  # (T,) position within its sequence
    cu_seqlens: torch.Tensor  # (B+1,) int32 sequence boundaries
    max_seqlen: int
    gen_index: torch.Tensor  # (N,) index into T of the hidden state that predicts each target
    targets: torch.Tensor  # (N,) the generated tokens
    seq: torch.Tensor  # (N,) which sequence (0..B-1) each generated token belongs to
    prefill: torch.Tensor  # (B,) P_b, the tokens before sequence b's first generated one: what
    # vLLM prefilled where a sequence is one turn (a Qwen3.5's, the replay's schedule)

    def to(self, device) -> "Packed":
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if f.name != "max_seqlen"}
        return dataclasses.replace(self, **moved)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))
        self.dtype = dtype
        self.compute_weight: torch.Tensor | None = None  # the tied head's, see weights_cast_once

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens].to(self.dtype)  # gather, then cast: the grad sums in fp32


class Linear(nn.Module):
    """y = x W^T (no bias), with the GEMM vLLM's linear layers run, in x's dtype."""

    def __init__(self, d_in: int, d_out: int, ops: bib.Kernels):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.ops = ops
        self.compute_weight: torch.Tensor | None = None  # set only within weights_cast_once
        self.lora: LoRA | None = None  # add_lora's adapter; state-dict keys: ...wqkv.lora.a.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ops.linear(x, master, its cast or None): casts the master unless given the cast; the
        # gradient comes back in fp32
        y = self.ops.linear(x, self.weight, self.compute_weight)
        return y if self.lora is None else self.lora(x, y)


# LoRA: the trainer's fused layers that take adapters, with vLLM's (packed) LoRA layer and
# PEFT's module name of each slice, in FUSED order (vLLM's q, k, v slices of Qwen3.5's
# in_proj_qkvz are PEFT's in_proj_qkv: one A, copied into each).
LORA_LAYERS = {"attention.wqkv": ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
               "attention.wo": ("self_attn.o_proj", ("o_proj",)),
               "attention.in_proj_qkvz": ("linear_attn.in_proj_qkvz", ("in_proj_qkv",) * 3
                                          + ("in_proj_z",)),
               "attention.in_proj_ba": ("linear_attn.in_proj_ba", ("in_proj_b", "in_proj_a")),
               "attention.out_proj": ("linear_attn.out_proj", ("out_proj",)),
               "feed_forward.w13": ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
               "feed_forward.w2": ("mlp.down_proj", ("down_proj",))}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "out_proj", "in_proj_b", "in_proj_a")


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # PEFT names


class LoRA(nn.Module):
    """A linear layer's low-rank adapter as vLLM's LoRA layers add it: on each output slice s
    (LORA_LAYERS: q, k, v of qkv_proj; gate, up of gate_up_proj; ...; o_proj's is the whole)
        y_s <- y_s + (x A_s^T) B'_s^T,   B'_s = (alpha / r) B_s,
    B_s (n_s, r) and A_s (r, K) fp32 masters (one A per PEFT module: groups; the layers and
    their slices: LORA_LAYERS, above). The forward computes with `casts`: (A_s, B'_s) in the
    compute dtype, shaped as vLLM's lora_a_stacked / lora_b_stacked (1, 1, rows, cols). On a
    GPU, bind_lora (LoRA plumbing) makes them the engine's own tensors: refreshing them pushes."""

    def __init__(self, d_in: int, sizes: list[int], names: tuple[str | None, ...], rank: int,
                 scale: float, ops: bib.Kernels, dtype: torch.dtype):
        super().__init__()
        self.names = names  # PEFT's name of each slice, None where --lora-targets leaves it out
        # groups[s]: which A slice s uses; the slices of one PEFT module share one (see
        # LORA_LAYERS), an untargeted slice has its own. E.g. Qwen3.5's in_proj_qkvz, names
        # (in_proj_qkv x 3, in_proj_z): groups (0, 0, 0, 1)
        keys = [n or s for s, n in enumerate(names)]
        distinct = list(dict.fromkeys(keys))  # in order of first appearance
        self.groups = tuple(distinct.index(key) for key in keys)
        self.a = nn.ParameterList(nn.Parameter(torch.empty(rank, d_in))
                                  for _ in range(max(self.groups) + 1))
        self.b = nn.ParameterList(nn.Parameter(torch.empty(n, rank)) for n in sizes)
        self.scale = scale
        self.ops = ops
        self.dtype = dtype
        self.casts: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None
        self.enabled = True  # off: the base policy (the KL reference)

    def slice_a(self) -> list[nn.Parameter]:  # each slice's A (a shared one repeated)
        return [self.a[g] for g in self.groups]

    def refresh(self) -> None:
        """casts <- (A, B') rounded to the compute dtype (every process: FSDP gathers)."""
        with torch.no_grad():
            if self.casts is None:
                self.casts = tuple(tuple(torch.empty(1, 1, *p.shape, dtype=self.dtype,
                                                     device=p.device) for p in ps)
                                   for ps in (self.slice_a(), self.b))
            whole = [full_tensor(a) for a in self.a]  # a shared A gathered once
            for cast, g in zip(self.casts[0], self.groups):
                cast.view(whole[g].shape).copy_(whole[g])
            for cast, b in zip(self.casts[1], self.b):
                cast.view(b.shape).copy_(self.scale * full_tensor(b))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return y
        # the forward computes with the casts (the engine's bits); the gradient goes to the
        # fp32 masters A_s and B_s (the scale carries B'_s's gradient to B_s)
        return self.ops.lora(x, y, self.casts, self.scale, *self.slice_a(), *self.b)


def add_lora(model: Qwen3, spec: LoRASpec) -> None:
    """An adapter on every fused layer that holds a target; its untargeted slices (k_proj when
    the targets are q_proj,v_proj, say: vLLM's packed layer has them too) start at A = B = 0
    and so stay 0."""
    sizes = lora_slice_sizes(model.args)
    for block in model.layers:
        modules = dict(block.named_modules())  # a layer kind's (a sparse block: no MLP)
        for path, (_, names) in LORA_LAYERS.items():
            if set(names) & set(spec.targets) and path in modules:
                layer = modules[path]
                kept = tuple(n if n in spec.targets else None for n in names)
                layer.lora = LoRA(layer.weight.shape[1], sizes[path], kept, spec.rank,
                                  spec.alpha / spec.rank, model.ops, model.dtype)


class RMSNorm(nn.Module):
    """rms_norm(x) * w; given a residual, vLLM's fused (rms_norm(x + r) * w, x + r). Qwen3.5's
    norms (`gemma`) scale by 1 + w: their weights are stored zero-centred."""

    def __init__(self, dim: int, eps: float, ops: bib.Kernels, dtype: torch.dtype,
                 gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops
        self.dtype = dtype
        self.norms = (ops.gemma_rms_norm, ops.gemma_add_rms_norm) if gemma else \
            (ops.rms_norm, ops.add_rms_norm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        w = self.weight.to(self.dtype)
        if residual is None:
            return self.norms[0](x, w, self.eps)
        return self.norms[1](x, residual, w, self.eps)


class GatedRMSNorm(RMSNorm):
    """rms_norm(x) * w * silu(z), per head of Qwen3.5's linear attention (vLLM's RMSNormGated)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_gated(x, z, self.weight.to(self.dtype), self.eps)


class FlashAttention(nn.Module):
    """Causal varlen attention over the packed batch (vLLM's `attn`: FA3, num_splits=1). With
    one split, a query row's keys are reduced in one fixed order, whether they come from vLLM's
    paged cache (a decode step, a prefix-cache hit) or from this one pass: the bits match
    (tests/test_gpu.py), so a Qwen3 episode of several turns packs as one sequence."""

    def __init__(self, scale: float, ops: bib.Kernels):
        super().__init__()
        self.scale = scale
        self.ops = ops

    def forward(self, q, k, v, batch: Packed) -> torch.Tensor:
        return self.ops.attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, self.scale)


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate; up] (vLLM's `act_fn`)."""

    def __init__(self, ops: bib.Kernels):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class Attention(nn.Module):
    """Qwen3's attention (vLLM's Qwen3Attention: q/k RMSNorm per head, rotary, FlashAttention);
    Qwen3.5's (`gated`) projects a gate beside each q head (a head's q rows, then its gate's),
    scales the head's output by sigmoid(gate) and rotates the head's first rotary_dim dims only;
    its q and k norms are Gemma's, as every Qwen3.5 norm is (RMSNorm's `gemma`)."""

    def __init__(self, args, ops: bib.Kernels, dtype: torch.dtype):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.gated = qwen35(args) is not None
        # [Hq D (x2 in a Qwen3.5: each q head's gate), Hk D, Hk D] rows ("Load & convert")
        self.sizes = fused_sizes(args)["attention.wqkv.weight"]
        self.wqkv = Linear(args.dim, sum(self.sizes), ops)  # vLLM's qkv_proj = [q; k; v]
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, ops, dtype, gemma=self.gated)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, ops, dtype, gemma=self.gated)
        self.attn = FlashAttention(args.head_dim**-0.5, ops)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor, batch: Packed, rope: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        D = self.head_dim
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)  # (T, Hq D (x2)), (T, Hk D), (T, Hk D)
        if self.gated:  # as vLLM's one kernel: the gate split off, q and k normed, then rotated
            w = (self.q_norm.weight.to(x.dtype), self.k_norm.weight.to(x.dtype))
            q, k, gate = self.ops.gated_qk_norm_rope(q, k, *w, self.q_norm.eps, batch.positions,
                                                     rope)  # (T, Hq, D), (T, Hk, D), (T, Hq, D)
        else:
            q = self.q_norm(q.reshape(T, self.n_heads, D))  # (T, Hq, D)
            k = self.k_norm(k.view(T, self.n_kv_heads, D))  # (T, Hk, D)
            q, k = self.ops.rotary(q, k, batch.positions, rope)
        o = self.attn(q, k, v.reshape(T, self.n_kv_heads, D).contiguous(), batch)  # (T, Hq, D)
        if self.gated:
            o = self.ops.sigmoid_gate_mul(o, gate)
        return self.wo(o.reshape(T, -1))  # (T, dim)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention, as vLLM's QwenGatedDeltaNetAttention runs it:
        [q; k; v; z] = x W_qkvz^T,  [b; a] = x W_ba^T,  [q; k; v] <- silu(conv1d([q; k; v]))
        o = gated_delta_rule(l2norm(q), l2norm(k), v; g = -exp(A_log) softplus(a + dt_bias),
                             beta = sigmoid(b)),   o_t = Dk^-1/2 S_t^T q_t
        S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T   (S: Dk x Dv)
        y = (rms_norm(o) * w * silu(z)) W_out^T            (per head)
    (the state decays, then its error predicting v_t from k_t is written back). conv1d is causal and
    depthwise, K taps, over each sequence from zeros; the rule carries a state per head
    through each sequence as vLLM ran it: its whole prompt in one call of the rule's
    chunked form (its prefill; batch.prefill says where it ends), then its completion token
    by token in the recurrent form (its decode steps): the two forms differ in their bits. The
    engine is held to that schedule ("Qwen3.5 on vLLM", after the story): a prompt prefilled
    in one engine step, no prefix-cache hit, no preemption. Each turn of an episode is a
    sequence of its own (pack_rollout): vLLM prefilled its whole request."""

    def __init__(self, args, ops: bib.Kernels, dtype: torch.dtype):
        super().__init__()
        c = qwen35(args)
        self.shape = (c.k_heads, c.k_dim, c.v_heads, c.v_dim)
        self.sizes = fused_sizes(args)["attention.in_proj_qkvz.weight"]  # [q k v, z]
        self.in_proj_qkvz = Linear(args.dim, sum(self.sizes), ops)
        self.in_proj_ba = Linear(args.dim, 2 * c.v_heads, ops)
        self.conv1d = nn.Parameter(torch.empty(self.sizes[0], 1, c.conv_kernel))  # (C, 1, K)
        self.A_log = nn.Parameter(torch.empty(c.v_heads))  # used in fp32, as vLLM keeps it
        self.dt_bias = nn.Parameter(torch.empty(c.v_heads))
        self.norm = GatedRMSNorm(c.v_dim, args.norm_eps, ops, dtype)
        self.out_proj = Linear(c.v_heads * c.v_dim, args.dim, ops)
        self.ops = ops
        self.dtype = dtype

    def forward(self, x: torch.Tensor, batch: Packed, rope=None) -> torch.Tensor:
        T = x.shape[0]
        Hk, Dk, Hv, Dv = self.shape
        qkv, z = self.in_proj_qkvz(x).split(self.sizes, dim=-1)  # (T, 2 Hk Dk + Hv Dv), (T, Hv Dv)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)  # (T, Hv) each
        qkv = self.ops.causal_conv1d(qkv, self.conv1d[:, 0].to(self.dtype), batch.cu_seqlens,
                                     batch.max_seqlen)  # (T, 2 Hk Dk + Hv Dv)
        q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        o = self.ops.gated_delta_rule(q.view(T, Hk, Dk), k.view(T, Hk, Dk), v.view(T, Hv, Dv), a,
                                      b, self.A_log, self.dt_bias.to(self.dtype),
                                      batch.cu_seqlens, batch.max_seqlen,
                                      batch.prefill)  # (T, Hv, Dv)
        return self.out_proj(self.norm(o, z.view(T, Hv, Dv)).reshape(T, -1))  # (T, dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, inter: int, ops: bib.Kernels):
        super().__init__()
        self.w13 = Linear(dim, 2 * inter, ops)  # vLLM's gate_up_proj
        self.act_fn = SiluAndMul(ops)
        self.w2 = Linear(inter, dim, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w13(x)))  # (T, 2I) -> (T, I) -> (T, dim)


class Router(nn.Module):
    """Router logits z = x W_r^T, W_r (E, dim): vLLM's `gate` ReplicatedLinear, the same GEMM."""

    def __init__(self, dim: int, n_experts: int, ops: bib.Kernels):
        super().__init__()
        self.gate = Linear(dim, n_experts, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)  # (T, E) in x's dtype


class TopK(nn.Module):
    """p = softmax(z) in fp32; the k largest p per token, renormalised to sum 1 if asked
    (norm_topk_prob): (probs (T, k) fp32, ids (T, k) int32), as vLLM's router selects them.

    `ids` keeps the last call's choice (T, k), which Qwen3.routed_ids reads after a forward.
    """

    def __init__(self, top_k: int, renormalize: bool, ops: bib.Kernels):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.ops = ops
        self.ids: torch.Tensor | None = None

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, ids = self.ops.moe_topk(logits, self.top_k, self.renormalize)
        self.ids = ids.detach()
        return probs, ids


class GroupedExperts(nn.Module):
    """E SwiGLU experts in vLLM's FusedMoE layout: w13 (E, 2I, dim) = [gate; up] rows per
    expert, w2 (E, dim, I). y_t = sum_j probs_tj * w2[e] (silu(g) * u), [g; u] = w13[e] x_t,
    e = ids_tj (probs: the router's top-k probabilities)."""

    def __init__(self, n_experts: int, dim: int, inter: int, ops: bib.Kernels):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * inter, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter))
        self.ops = ops
        self.compute_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # weights_cast_once

    def cast(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in the compute dtype, outside autograd: what weights_cast_once holds."""
        with torch.no_grad():
            return self.w13.to(dtype), self.w2.to(dtype)

    def forward(self, x: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # casts the fp32 masters to x's dtype (unless given their casts); their gradient is fp32
        return self.ops.moe_experts(x, self.w13, self.w2, probs, ids,
                                    self.compute_weights)  # (T, dim)


class MoE(nn.Module):
    """Qwen3-MoE's sparse MLP in vLLM's order: router GEMM -> top-k -> experts (Qwen3.5-MoE:
    + sigmoid(x g^T) FFN(x), a gated shared expert). (T, dim) -> (T, dim)."""

    def __init__(self, args, ops: bib.Kernels):
        super().__init__()
        m = args.moe_args
        self.router = Router(args.dim, m.num_experts, ops)
        self.topk = TopK(m.top_k, m.route_norm, ops)
        self.experts = GroupedExperts(m.num_experts, args.dim, args.moe_inter_dim, ops)
        shared = getattr(qwen35(args), "shared_expert_dim", 0)
        self.shared_expert = FeedForward(args.dim, shared, ops) if shared else None
        self.shared_expert_gate = Linear(args.dim, 1, ops) if shared else None
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, ids = self.topk(self.router(x))  # (T, k) fp32, (T, k) int32
        y = self.experts(x, probs, ids)  # (T, dim)
        if self.shared_expert is not None:
            y = y + self.ops.sigmoid_gate_mul(self.shared_expert(x), self.shared_expert_gate(x))
        return y


def sparse_layers(args) -> tuple[int, ...]:
    """The layers with a sparse MLP, as transformers and vLLM decide (qwen3_moe.py): layer i is
    sparse iff num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0. Set on the args by model_args_from_hf; dense Qwen3 has none."""
    if getattr(args, "moe_enabled", False) and not hasattr(args, "sparse_layers"):
        raise ValueError("MoE args without sparse_layers (dataclasses.replace drops it): build "
                         "them with model_args_from_hf, or set it again")
    return getattr(args, "sparse_layers", ())


class Block(nn.Module):
    """One decoder layer, as vLLM runs it: the residual add is fused into the next norm.

    Its token mixer `attention` is softmax attention or, in a Qwen3.5 linear-attention layer,
    Gated DeltaNet; its MLP is `feed_forward` (dense) or, in a sparse layer, `moe` (TorchTitan's
    names)."""

    def __init__(self, args, ops: bib.Kernels, dtype: torch.dtype, sparse: bool = False,
                 gdn: bool = False):
        super().__init__()
        gemma = qwen35(args) is not None
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, ops, dtype, gemma=gemma)
        self.attention = (GatedDeltaNet if gdn else Attention)(args, ops, dtype)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, ops, dtype, gemma=gemma)
        self.sparse = sparse
        if sparse:
            self.moe = MoE(args, ops)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim, ops)

    def forward(self, x, residual, batch: Packed, rope) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: no residual to add yet
            h, residual = self.attention_norm(x), x
        else:
            h, residual = self.attention_norm(x, residual)
        h = self.attention(h, batch, rope)
        h, residual = self.ffn_norm(h, residual)
        return (self.moe if self.sparse else self.feed_forward)(h), residual


class Qwen3(nn.Module):
    """Qwen3 (-MoE, 3.5) with TorchTitan names and vLLM's fused layout, run as vLLM runs it."""

    def __init__(self, args, ops: bib.Kernels, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.ops = ops
        self.dtype = dtype
        self.tok_embeddings = Embedding(args.vocab_size, args.dim, dtype)
        sparse_at, gdn_at = sparse_layers(args), gdn_layers(args)
        self.layers = nn.ModuleList(Block(args, ops, dtype, i in sparse_at, i in gdn_at)
                                    for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, ops, dtype, gemma=qwen35(args) is not None)
        tied = args.enable_weight_tying
        self.output = None if tied else Linear(args.dim, args.vocab_size, ops)
        self.rope: torch.Tensor | None = None  # (max_seq_len, rotary dims) cos|sin: init_rope

    def init_rope(self, device) -> None:
        """The rotary cos/sin cache (of a head's rotated dims), built as vLLM builds its own."""
        a = self.args
        rotary_dim = qwen35(a).rotary_dim if qwen35(a) else a.head_dim
        self.rope = bib.rope_cos_sin_cache(rotary_dim, a.rope_theta, a.max_seq_len, device,
                                           self.dtype)

    def hidden(self, batch: Packed) -> torch.Tensor:
        """Packed varlen forward: tokens (T,) -> final hidden states (T, dim)."""
        h, residual = self.tok_embeddings(batch.tokens), None  # (T, dim)
        for block in self.layers:
            h, residual = block(h, residual, batch, self.rope)
        h, _ = self.norm(h, residual)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, V) in the compute dtype, through the tied or untied head."""
        if self.output is None:
            emb = self.tok_embeddings
            return self.ops.linear(h, emb.weight, emb.compute_weight)
        return self.output(h)

    def forward(self, batch: Packed, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """log softmax(logits / temperature)[target] and the entropy at every generated token,
        fp32 (N,)."""
        h = self.hidden(batch)[batch.gen_index]  # (N, dim): the states predicting the targets
        return self.ops.logprobs_entropy(self.logits(h), batch.targets, temperature)

    def routed_ids(self, batch: Packed) -> torch.Tensor:
        """The experts the last forward (of `batch`) chose for the tokens whose next token it
        scored: (N, sparse layers, k) int32 (the routing-parity check)."""
        return torch.stack([b.moe.topk.ids[batch.gen_index] for b in self.layers if b.sparse],
                           dim=1)


@contextlib.contextmanager
def weights_cast_once(model: Qwen3):
    """Within: every GEMM weight is cast to the compute dtype once, not in every micro-batch's
    forward (about 10 GB of memory traffic per micro-batch at 1.7B). The casts are the tensors
    each forward saves for its backward anyway, so peak memory does not grow. Leave before the
    optimizer step: the casts are of the weights as they were on entry.

    The contract: a Linear (or the tied head) whose `compute_weight` is set, or GroupedExperts
    whose `compute_weights` are, computes with it instead of casting its master in the
    forward; it is that same cast (`weight.to(dtype)`) of that same master, so no bit of a
    forward or a gradient changes, only how often the cast runs. On exit they are None again
    (LoRA's casts are refreshed and kept: bound, they are the engine's slot).
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if model.output is None:
        linears.append(model.tok_embeddings)  # the tied head's weight
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    # Nothing to cast under FSDP2 (full fine-tuning on several ranks: a DTensor master), whose
    # all-gather already gives the compute dtype (a Qwen3.5's Gated DeltaNet layers gather in
    # fp32, for A_log, and cast in their forward), nor in an fp32 model
    if hasattr(model.norm.weight, "to_local") or model.dtype == torch.float32:
        linears, experts = [], []
    for m in lora_modules(model):  # in every case, and kept: bound, they are the engine's slot
        m.refresh()
    with torch.no_grad():
        for m in linears:
            m.compute_weight = m.weight.to(model.dtype)
        for m in experts:
            m.compute_weights = m.cast(model.dtype)
    try:
        yield
    finally:
        for m in linears:
            m.compute_weight = None
        for m in experts:
            m.compute_weights = None


def policy_weights(model: Qwen3) -> Iterable[tuple[str, torch.Tensor]]:
    """What the engine needs to hold the trainer's policy: every weight (HF names), streamed, or
    under LoRA the adapter alone, a list (adapter_weights, LoRA plumbing): making it refreshes
    the casts, which are the engine's slot, so the call itself pushes."""
    return adapter_weights(model) if lora_modules(model) else hf_weights(model)


def build_models(cfg: Config, args, hf_state: dict, ops: bib.Kernels, ranks: Ranks,
                 engine: Engine | None = None):
    """The policy and, with --kl-coef > 0, its KL reference: (model, ref_model or None).

    Full fine-tuning: sharded over the ranks (rank 0 holds hf_state, the others get their
    shards); the reference is a second, frozen model. LoRA (lora_models, in the LoRA
    plumbing): every rank holds the whole base; the reference is the policy, adapters off."""
    if lora := lora_spec(cfg, args):
        return lora_models(cfg, args, hf_state, ops, ranks, engine, lora)
    state = hf_to_trainer(hf_state, args) if hf_state else {}
    build = functools.partial(build_model, args, state, ops, DTYPES[cfg.dtype], ranks.device,
                              ranks.world)
    return build(), build(frozen=True) if cfg.kl_coef else None


def build_model(args, state: dict[str, torch.Tensor], ops: bib.Kernels, dtype, device,
                world: int = 1, lora: LoRASpec | None = None, frozen: bool = False) -> Qwen3:
    """Build on the meta device, then load the fp32 masters: never materialised twice.

    One process: `assign=True` adopts the loaded tensors. Several: FSDP2 shards every block and
    the root; rank 0 holds `state` and set_model_state_dict broadcasts each rank its shard.
    LoRA: the base is frozen in the compute dtype (adopted as given: the engine's own tensors
    on a GPU), the adapters' fp32 masters come from `state` too, every rank holds all of it,
    and FSDP2 shards the adapters alone. `frozen`: no weight trains (the KL reference).
    """
    with torch.device("meta"):
        model = Qwen3(args, ops, dtype)
        # a LoRA's base: the weights before its adapters; frozen, adopted as the engine holds them
        frozen_base = {name for name, _ in model.named_parameters()} if lora else set()
        if lora:
            add_lora(model, lora)
    try:
        if world == 1 or lora:
            # the base adopted as given; the fp32 masters copied, so that the policy and the KL
            # reference, built from one `state`, never share a tensor
            loaded = {k: v.to(device, held_dtype(k, dtype)) if k in frozen_base
                      else v.to(device, torch.float32, copy=True) for k, v in state.items()}
            model.load_state_dict(loaded, strict=True, assign=True)
            for name, p in model.named_parameters():
                p.requires_grad_(not (frozen or name in frozen_base))
            if world > 1:
                shard_model(model, dtype)
        else:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_model_state_dict)

            shard_model(model, dtype)
            model.to_empty(device=device)
            masters = {k: v.float() for k, v in state.items()}
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, masters, options=options)
            model.requires_grad_(not frozen)
    except RuntimeError as e:  # missing, unexpected or mis-shaped tensors
        detail = " ".join(line.strip() for line in str(e).splitlines()[1:3]) or str(e)
        raise ConfigError(f"the checkpoint's weights do not match its config.json: "
                          f"{detail}") from e
    model.init_rope(device)
    return model


def hf_weights(model: Qwen3, fused_experts: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, weight in the compute dtype) for every weight, one trainer tensor at a time.

    Under FSDP every rank gathers each bf16 cast in turn (so every rank must run this to the
    end, in the same order); peak memory is one full tensor. Experts go fused (one
    gate_up_proj and one down_proj per layer, which vLLM's MoE loader takes whole) unless
    `fused_experts` is False (per expert: the hub's names, for files).
    """
    keys = hf_key_map(model.args)
    for name, p in model.named_parameters():
        yield from to_hf_items(name, full_tensor(p.detach().to(held_dtype(name, model.dtype))),
                               model.args, keys, fused_experts)


def held_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine holds a weight in: the compute dtype, but Gated DeltaNet's A_log in
    fp32, as vLLM's Qwen3.5 keeps it."""
    return torch.float32 if name.endswith("A_log") else dtype


# ==========================================================================
# Load & convert: HF checkpoint <-> trainer (vLLM layout)
# ==========================================================================
# The trainer holds weights as vLLM's Qwen3 layers do: q/k/v fused into one projection,
# gate/up fused into one (Qwen3.5's linear attention: q/k/v/z, b/a). TorchTitan's key map
# (hf_key_map) turns HF names into TorchTitan's and back; this table fuses the parts (on dim 0, in
# order) a layer has. One weight's three names: HF's model.layers.0.self_attn.q_proj.weight is
# TorchTitan's layers.0.attention.wq.weight, which the trainer holds as the first rows of
# layers.0.attention.wqkv.weight (vLLM's qkv_proj).
FUSED = {
    "attention.wqkv.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "feed_forward.w13.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
    "attention.in_proj_qkvz.weight": ("attention.in_proj_qkv.weight", "attention.in_proj_z.weight"),
    "attention.in_proj_ba.weight": ("attention.in_proj_b.weight", "attention.in_proj_a.weight"),
    "moe.shared_expert.w13.weight": ("moe.shared_expert.w1.weight", "moe.shared_expert.w3.weight"),
}
ROPE_BUFFER = "rotary_emb.inv_freq"  # a cache some exports store with the weights; not a weight


@dataclass
class ModelFiles:
    path: Path
    args: object  # TorchTitan's Qwen3ModelArgs
    tokenizer: object
    eos_ids: list[int]
    tool_ids: list[int] = field(default_factory=list)  # --tool-stop's ids: they end a turn too


def hf_key_map(args):
    """TorchTitan's Qwen3StateDictAdapter (.from_hf, .to_hf: HF <-> TorchTitan names), with
    Qwen3.5's names added. (In simple_rl an "adapter" is a LoRA's; this is the key map.)"""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    keys = Qwen3StateDictAdapter(args, None)
    keys.from_hf_map.update(QWEN35_NAMES)  # names a Qwen3 never has
    return keys


def fused_sizes(args) -> dict[str, list[int]]:
    """Row counts of the parts of each fused projection, in FUSED order."""
    q = args.n_heads * args.head_dim * (2 if qwen35(args) else 1)  # Qwen3.5: q, gate per head
    kv = args.n_kv_heads * args.head_dim
    return {"attention.wqkv.weight": [q, kv, kv],
            "feed_forward.w13.weight": [args.hidden_dim, args.hidden_dim],
            **qwen35_fused_sizes(args)}


def hf_to_trainer(hf_state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """HF names -> TorchTitan names (hf_key_map) -> fused vLLM-layout projections.

    A sparse layer's router and experts are taken out first by `moe_from_hf` (model files,
    after the story), as the trainer's router and stacked experts (E, rows, cols); it reads
    experts stored one by one (the hub's Qwen3-MoE files) or already stacked (vLLM's layout,
    which some checkpoints use). A fused projection is made in the layers that have it
    (`fused_in_layer`): a Qwen3.5's wqkv in its full-attention layers, in_proj_qkvz and
    in_proj_ba in its Gated DeltaNet layers.
    """
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith(ROPE_BUFFER)}
    try:
        moe = moe_from_hf(hf_state, args)  # pops what it takes from hf_state
        titan = hf_key_map(args).from_hf(hf_state)
        titan.update(moe)
        if args.enable_weight_tying:
            titan.pop("output.weight", None)  # tied: the trainer reads tok_embeddings.weight
        for i in range(args.n_layers):
            for fused, parts in FUSED.items():
                if fused_in_layer(fused, i, args):
                    titan[f"layers.{i}.{fused}"] = torch.cat([titan.pop(f"layers.{i}.{p}")
                                                              for p in parts], dim=0)
    except (KeyError, RuntimeError) as e:
        raise ConfigError(f"the checkpoint's weights do not match its config.json "
                          f"({type(e).__name__}: {e}).") from e
    return titan


def to_hf_items(name: str, tensor: torch.Tensor, args, keys, fused_experts=False):
    """One trainer tensor as [(HF name, tensor)]: fused projections split, names mapped by
    `keys` (hf_key_map(args))."""
    if ".moe.router." in name or ".moe.experts." in name:
        return moe_to_hf_items(name, tensor, args, fused_experts)
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if suffix in FUSED:
        prefix = name[: -len(suffix)]
        pieces = tensor.split(fused_sizes(args)[suffix], dim=0)
        titan = {prefix + part: piece for part, piece in zip(FUSED[suffix], pieces)}
    else:
        titan = {name: tensor}
    return list(keys.to_hf(titan).items())


# ==========================================================================
# Rollout: vLLM engine, sampling, packing
# ==========================================================================
# VLLMEngine.__init__ first patches vLLM in this process ("vLLM patches", after the story):
# - on Hopper its linear layers run on cuBLASLt, the trainer's GEMM: for speed (vLLM's Triton
#   matmul leaves most SMs idle at decode); with split-K off, cuBLASLt's bits are the Triton
#   kernel's (tests/test_gemm_gpu.py: every decode row count, and larger ones);
# - its fused add+RMSNorm calls run the trainer's function, rows padded to 256: vLLM 0.26's own
#   kernel changed its reduction at 256 rows; 0.34's does not, and the padding stays so that
#   both sides still make the one call whose bits were proved;
# - a Qwen3.5's Gated DeltaNet is let into batch-invariant mode (prepare_qwen35_engine).
# Sampling needs no patch: vLLM's sampler draws a token's noise from a hash of (request seed,
# position, token id), so a sample depends on its seed alone, not on the batch it was drawn in.


@dataclass
class Completion:
    """One completion of one request, as an engine returns it: one turn of an episode."""
    ids: list[int]  # generated token ids (a stop id, when it ended at one, is the last)
    logprobs: list[float]  # the engine's logprob of each (Python floats hold fp32 exactly)
    stopped: bool  # ended at a stop id (eos or a tool stop), not at its token limit
    # MoE: the experts vLLM chose at the position that predicts each generated token,
    # (len(ids), all layers, k) ints (a dense layer's rows are 0), or None where the engine
    # returned none
    routed: torch.Tensor | None = None


def turn_tokens(cfg: Config, request: list[int]) -> int:
    """The most tokens a turn after `request` may generate: --max-new-tokens, or what
    --max-model-len leaves (then the turn is capped, and ends as "max_model_len" at its limit)."""
    return min(cfg.max_new_tokens, cfg.max_model_len - len(request))


class Engine:
    """What the RL loop asks of a rollout engine (VLLMEngine, or the tests' CPU stand-in).
    A step's first turn is one `generate` call over its prompts, G samples each (`first_turn`);
    every later turn, one call over the episodes that go on, one sample each."""

    cfg: Config
    returns_routes = False  # vLLM returns the experts each token chose (MoE; VLLMEngine says when)
    reads_cache = True  # it reads vLLM's prefix cache (VLLMEngine says when not)
    lora: LoRASpec | None = None  # LoRA: the adapters the engine serves
    lora_tensors: dict | None = None  # LoRA: the adapter slot's tensors, by vLLM's layer name

    def base_weights(self, args) -> dict[str, torch.Tensor] | None:
        """LoRA: the base weights the engine lends the trainer (one copy), or None."""
        return None

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int | None],
                 max_tokens: list[int], temperature: float) -> list[list[Completion]]:
        """n completions of each prompt, stopping at the engine's stop ids; request j's k-th
        sample is seeded seeds[j] + k (None and temperature 0: greedy)."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Free the engine's GPU memory while the trainer runs (the push fills it again)."""
        raise NotImplementedError

    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load the trainer's policy (policy_weights); returns the seconds spent waking."""
        raise NotImplementedError

    def first_turn(self, prompts: list[list[int]], indices: list[int],
                   step: int) -> list[list[Completion]]:
        """The first turn (turn 0) of a step's episodes: G samples of each prompt; prompt j has
        the seed of its index in the whole step."""
        cfg = self.cfg
        return self.generate(prompts, cfg.group_size,
                             [request_seed(cfg, step, i) for i in indices],
                             [turn_tokens(cfg, p) for p in prompts], cfg.temperature)


# Decode steps of up to this many sequences replay CUDA graphs; vLLM's default cap, 512, left
# 1024-sample decode steps to launch every kernel from Python: 62 ms a step, 30 when captured.
CUDA_GRAPH_MAX_BATCH = 1024


class VLLMEngine(Engine):
    """This rank's vLLM engine, in this process, so its model is reachable for weight pushes.

    Tensor parallel 1: each rank generates its own share of the prompts. Under torchrun the
    engine joins the existing process group (vLLM's external launcher).
    """

    lora_request = None
    adapter_ptrs: frozenset[int] = frozenset()  # LoRA: the slot's tensor addresses (start_adapter)
    preempted: Callable[[], int] | None = None  # Qwen3.5: requests preempted since last asked

    def __init__(self, cfg: Config, files: ModelFiles, ranks: Ranks):
        from vllm import LLM
        from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

        self.lora = lora_spec(cfg, files.args)  # one adapter slot, shared with the trainer
        # The prefix cache. A Qwen3.5 never reads it: a cached prefix resumes its linear
        # attention from a saved state, a split the trainer does not replay. An MoE's engine
        # returns each token's experts (the routing-parity check) only with the cache on (vLLM
        # keeps them beside its blocks), so a Qwen3.5-MoE keeps it on, unread:
        #
        #     model          read (reads_cache)          on           experts returned
        #     Qwen3          under --prefix-caching      when read    -
        #     Qwen3-MoE      under --prefix-caching      when read    when on
        #     Qwen3.5        never                       no           -
        #     Qwen3.5-MoE    never                       yes          yes
        q35 = qwen35(files.args) is not None
        self.cfg = cfg
        self.reads_cache = cfg.prefix_caching and not q35
        self.returns_routes = bool(sparse_layers(files.args)) and (self.reads_cache or q35)
        # engine_setup ("vLLM patches", after the story) patches vLLM as the Rollout section
        # says, sizes the engine's memory and LoRA's slot, and returns LLM's other arguments
        # and wake_bytes, the bytes a wake-up maps back (push_weights frees the allocator's
        # cache when fewer are free).
        engine_kwargs, self.wake_bytes = engine_setup(cfg, files.args, ranks, self.lora)
        self.stop_ids = files.eos_ids + files.tool_ids  # every id that ends a turn
        self.asleep = False
        graphs = cfg.cuda_graphs and not cfg.debug_parity  # the debugger hooks eager steps only
        # What makes vLLM's numbers the trainer's: its kernels (patched above), its logprobs, the
        # attention backend, and no compiler.
        bitwise = dict(
            dtype=cfg.dtype,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",  # softmax(logits / temperature): what was sampled
            enable_return_routed_experts=self.returns_routes,
            attention_backend="FLASH_ATTN",
            # Schedule engine step t + 1 while the GPU runs t: the same kernels on the same rows.
            async_scheduling=True,
            # Never torch.compile: Inductor would fuse and reorder the ops the trainer mirrors.
            # CUDA graphs only replay the same kernels, so decode steps may use them.
            enforce_eager=not graphs,
            compilation_config=CompilationConfig(
                mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY,
                max_decode_cudagraph_capture_requests=min(engine_kwargs["max_num_seqs"],
                                                          CUDA_GRAPH_MAX_BATCH),
                # under LoRA every request has the adapter: no graphs for requests without one
                cudagraph_specialize_lora=False) if graphs else None,
        )
        self.llm = LLM(
            model=str(files.path),
            **bitwise,
            **engine_kwargs,
            max_model_len=cfg.max_model_len,
            enable_sleep_mode=cfg.engine_sleep,
            enable_prefix_caching=self.reads_cache or self.returns_routes,
            skip_tokenizer_init=True,  # we pass token ids; the reward decodes with our tokenizer
            use_tqdm_on_load=cfg.verbose,  # no progress bars for loading and graph capture
            distributed_executor_backend="external_launcher" if dist.is_initialized() else None,
        )
        self.lora_request = start_adapter(self, files) if self.lora else None
        self.preempted = preemption_counter(self.llm) if q35 else None

    def base_weights(self, args) -> dict[str, torch.Tensor]:
        """The engine's own weights (no copy) under the trainer's names, checked finite."""
        return engine_weights(self.llm, args, DTYPES[self.cfg.dtype])

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int | None],
                 max_tokens: list[int], temperature: float) -> list[list[Completion]]:
        """Engine.generate, one vLLM call. A greedy call (the held-out eval) drops the prefix
        cache it filled: the next rollout starts from the cache it would have had without an
        eval, so a run's schedule and memory do not depend on --eval-every."""
        from vllm import TokensPrompt

        params = [self.sampling_params(s, n=n, max_tokens=m, temperature=temperature)
                  for s, m in zip(seeds, max_tokens)]
        with gc_paused():
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                     use_tqdm=False, lora_request=self.lora_request)
        if self.preempted:  # a preempted request is prefilled again: not the replayed schedule
            check_no_preemption(self.preempted())
        if temperature == 0:
            self.llm.reset_prefix_cache()
        return [[Completion(list(c.token_ids), completion_logprobs(c), c.finish_reason == "stop",
                            generated_routing(c.routed_experts, len(p), len(c.token_ids))
                            if self.returns_routes else None)
                 for c in sorted(o.outputs, key=lambda c: c.index)]
                for p, o in zip(prompts, outs)]

    def sampling_params(self, seed: int | None, n: int | None = None,
                        max_tokens: int | None = None, temperature: float | None = None):
        """n (default G) samples of one prompt, seeded seed, seed + 1, ..., seed + n - 1 by vLLM.
        A stop id (eos or a tool stop) stays in the generated ids; finish_reason is "stop"."""
        from vllm import SamplingParams

        cfg = self.cfg
        # flat_logprobs: a few flat lists per request instead of a dict and an object per
        # token, so vLLM's output processing makes fewer Python objects at every decode step.
        # skip_reading_prefix_cache: a cache kept on for routes alone (a Qwen3.5-MoE's) is
        # never read.
        return SamplingParams(n=n or cfg.group_size,
                              temperature=cfg.temperature if temperature is None else temperature,
                              logprobs=0, flat_logprobs=True,
                              max_tokens=max_tokens or cfg.max_new_tokens, seed=seed,
                              stop_token_ids=self.stop_ids, detokenize=False,
                              skip_reading_prefix_cache=not self.reads_cache)

    def sleep(self) -> None:
        """Free the KV cache and the weights (under LoRA the KV cache alone) while the trainer
        runs (the push refills them)."""
        if self.cfg.engine_sleep and not self.asleep:
            with young_collections_only():
                if self.lora:
                    map_kv_cache(False)
                else:
                    self.llm.sleep(level=2)
            self.asleep = True

    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        return push_weights(self, weights)


def completion_logprobs(c) -> list[float]:
    """vLLM's logprob of each generated token of a CompletionOutput asked for logprobs=0 and
    flat_logprobs: one entry per position, for the sampled token itself."""
    flat = c.logprobs
    if flat.token_ids != list(c.token_ids) or len(flat.logprobs) != len(c.token_ids):
        raise RuntimeError(f"vLLM returned {len(flat.logprobs)} logprobs for "
                           f"{len(c.token_ids)} tokens, or for other tokens than it sampled")
    return flat.logprobs


def generated_routing(routed, n_prompt: int, n_gen: int) -> torch.Tensor | None:
    """A completion's routed experts (vLLM's CompletionOutput.routed_experts) at the positions
    that predict its generated tokens: (n_gen, layers, k), or None if it has not those rows
    (or generated none).

    vLLM returns a row per token that went through the model: the P prompt tokens (from its
    slot table when the prefill completes), then each fed generated token (the last sampled
    one is never fed): P + C - 1 rows. Token t of the completion is predicted at P - 1 + t.
    """
    if routed is None or len(routed) < n_prompt - 1 + n_gen or n_gen == 0:
        return None
    return torch.from_numpy(routed[n_prompt - 1: n_prompt - 1 + n_gen].astype("int32"))


def request_seed(cfg: Config, step: int, prompt: int) -> int:
    """Per-request seed: a sample depends on (seed, step, prompt) only, not on batching or ranks.

    vLLM seeds a prompt's G samples with seed, seed + 1, ..., seed + G - 1. The seed is a
    multiple of G below 2^48 (consecutive prompts' G apart, modulo that range): no two samples
    of a step share one (and with it their sampling noise), and seed + G - 1 stays below 2^48
    (turn_seed's turns).
    """
    base = cfg.seed * 1_000_003 + step * 10_007 + prompt
    return base % (2**48 // cfg.group_size) * cfg.group_size


def turn_seed(cfg: Config, step: int, prompt: int, g: int, turn: int) -> int:
    """Seed of turn `turn` (0: the first) of a prompt's sample g (of G): the first turn's is
    vLLM's request_seed + g; turn t's adds t 2^48, so no two turns of a step share one.
    E.g. seed 0, G = 8, step 1: prompt 3's samples start at 8 (10,007 + 3) = 80,080, so sample 2
    has 80,082 in turn 0 (vLLM's 80,080 + 2) and 80,082 + 2^48 in turn 1."""
    return request_seed(cfg, step, prompt) + g + turn * 2**48


def my_prompts(num_prompts: int, ranks: Ranks) -> list[int]:
    """The step's prompts this rank generates and trains on: i mod world == rank."""
    return list(range(ranks.rank, num_prompts, ranks.world))


def pack(prompts: list[list[int]], completions: list[list[int]],
         generated: list[list[bool]] | None = None) -> Packed:
    """Sequences back to back, no padding; token t of completion b is predicted at
    start_b + P_b - 1 + t. The targets are every completion token, or those generated[b][t]
    marks (an episode's tool tokens are context, not targets). Packed's example, prompts [a b],
    [c] and completions [x y], [z]: starts 0 4; x y at 0 + 2 - 1 + (0, 1) = 1 2; z at 4 + 1 - 1 = 4.
    """
    P = torch.tensor([len(p) for p in prompts])
    C = torch.tensor([len(c) for c in completions])
    L = P + C
    starts = torch.cumsum(L, 0) - L
    tokens = torch.tensor([t for p, c in zip(prompts, completions) for t in p + c])
    positions = torch.arange(len(tokens)) - torch.repeat_interleave(starts, L)
    seq = torch.repeat_interleave(torch.arange(len(C)), C)
    offset = torch.arange(int(C.sum())) - torch.repeat_interleave(torch.cumsum(C, 0) - C, C)
    if generated is not None:
        keep = torch.tensor([m for ms in generated for m in ms], dtype=torch.bool)  # (sum C,)
        seq, offset = seq[keep], offset[keep]
    return Packed(
        tokens=tokens,
        positions=positions,
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(L, 0)]).int(),
        max_seqlen=int(L.max()),
        gen_index=(starts + P - 1)[seq] + offset,  # start_b + P_b - 1 + t
        targets=tokens[(starts + P)[seq] + offset],
        seq=seq,
        prefill=P,
    )


def micro_batches(lengths: list[int], max_tokens: int) -> list[range]:
    """Consecutive sequence ranges whose total length fits max_tokens (each fits alone)."""
    out = []
    start = 0
    total = 0
    for i, n in enumerate(lengths):
        assert n <= max_tokens, f"a sequence of {n} tokens exceeds micro_batch_tokens={max_tokens}"
        if total + n > max_tokens:
            out.append(range(start, i))
            start = i
            total = 0
        total += n
    out.append(range(start, len(lengths)))
    return out


def sub_pack(packed: Packed, seqs: range) -> tuple[Packed, slice]:
    """Sequences [start, stop) as their own packed batch, and the slice of targets (N,) they own.
    E.g. range(1, 2) of Packed's example: tokens c z, cu_seqlens 0 2, gen_index 0, seq 0;
    slice(2, 3)."""
    t0, t1 = int(packed.cu_seqlens[seqs.start]), int(packed.cu_seqlens[seqs.stop])
    # packed.seq is sorted: the targets of sequences [start, stop) are one run of it
    bounds = torch.tensor([seqs.start, seqs.stop], device=packed.seq.device)
    n0, n1 = torch.searchsorted(packed.seq, bounds).tolist()
    cu = packed.cu_seqlens[seqs.start : seqs.stop + 1] - t0
    part = Packed(
        tokens=packed.tokens[t0:t1],
        positions=packed.positions[t0:t1],
        cu_seqlens=cu,
        max_seqlen=int((cu[1:] - cu[:-1]).max()),
        gen_index=packed.gen_index[n0:n1] - t0,
        targets=packed.targets[n0:n1],
        seq=packed.seq[n0:n1] - seqs.start,
        prefill=packed.prefill[seqs.start : seqs.stop],
    )
    return part, slice(n0, n1)


# ==========================================================================
# Reward: tasks with verifiable answers
# ==========================================================================


@dataclass
class Problem:
    question: str  # what the user asks, with the instruction on how to end the answer
    answer: str

    def __getitem__(self, field: str) -> str:
        """problem["answer"] reads problem.answer, as in the rows of --data-files."""
        if field not in ("question", "answer"):
            raise KeyError(f"{field!r}: a problem has the fields 'question' and 'answer'")
        return getattr(self, field)


@dataclass
class Task:
    problems: list[Problem]  # the training pool
    prompt_ids: list[list[int]]  # each problem as the model sees it (chat template or Q:/A:)
    eval_problems: list[Problem]  # held out: never in the training pool
    eval_prompt_ids: list[list[int]]


ARITH = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
ANSWER_FORMAT = "End with 'Answer: <number>'."
ARITHMETIC_POOL = 16_384  # problems drawn for a run; steps walk through them epoch by epoch
# Held-out problems come from their own fixed stream, whatever --seed, so every run is scored
# on the same problems; a candidate that is also in the run's training pool is skipped.
EVAL_SEED = 2**31 - 1
EVAL_CANDIDATES = 4096


def arithmetic_problems(n: int, seed: int) -> list[Problem]:
    """n generated problems "a op1 b op2 c" with exact integer answers.

    op1 is one of + - *, op2 one of + -, so the value is always (a op1 b) op2 c.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randint(2, 99)
        b = rng.randint(2, 99)
        c = rng.randint(1, 9)
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        value = ARITH[op2](ARITH[op1](a, b), c)
        out.append(Problem(f"What is {a} {op1} {b} {op2} {c}? {ANSWER_FORMAT}", str(value)))
    return out


def arithmetic_split(cfg: Config) -> tuple[list[Problem], list[Problem]]:
    """(training pool, held-out problems): the first --eval-size distinct candidates of the
    held-out stream that are not in the pool."""
    pool = arithmetic_problems(max(ARITHMETIC_POOL, cfg.num_prompts), cfg.seed)
    seen = {p.question for p in pool}
    heldout = []
    for p in arithmetic_problems(EVAL_CANDIDATES, EVAL_SEED):
        if len(heldout) == cfg.eval_size:
            break
        if p.question not in seen:
            seen.add(p.question)
            heldout.append(p)
    return pool, heldout


def step_problems(n_problems: int, num_prompts: int, step: int, seed: int) -> list[int]:
    """Indices of the step's prompts: a fresh shuffle of all problems per epoch, walked in order."""
    orders: dict[int, list[int]] = {}  # the epochs a step spans (several: a small pool)
    out = []
    for i in range(step * num_prompts, (step + 1) * num_prompts):
        epoch, at = divmod(i, n_problems)
        if epoch not in orders:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            orders[epoch] = torch.randperm(n_problems, generator=g).tolist()
        out.append(orders[epoch][at])
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_answer(text: str) -> Decimal | None:
    """The number after the last 'Answer:' (else the last number) of the final answer: after
    any </think> block, before the model starts a new 'Q:'."""
    text = text.rsplit("</think>", 1)[-1].split("\nQ:")[0]
    marked = "Answer:" in text
    tail = text.rsplit("Answer:", 1)[-1] if marked else text
    found = _NUMBER.findall(tail.replace("**", "").replace("$", ""))
    if not found:
        return None
    try:
        return Decimal((found[0] if marked else found[-1]).replace(",", ""))
    except InvalidOperation:
        return None


def reward(completion: str, answer: str) -> float:
    """1 if the parsed answer equals the expected one exactly (1,234 == 1234.0), else 0. An
    expected answer that is not a number is compared with the text after the last 'Answer:'."""
    try:
        want = Decimal(answer.replace(",", ""))
    except InvalidOperation:
        return float(completion.rsplit("Answer:", 1)[-1].strip() == answer.strip())
    got = parse_answer(completion)
    return float(got is not None and got == want)


RewardFn = Callable[[str, str], float]


# ==========================================================================
# Episodes: turns, tools and environments
# ==========================================================================
# An episode is a prompt and the model's turns, with a tool's message between two turns. It
# stays token ids from end to end: a turn's ids are kept as sampled (decoding and re-encoding
# them could change them) and a tool's message is rendered to ids and appended. A single-turn
# task is an episode of one turn, which RewardEnv scores with --reward.


class ToolError(Exception):
    """An env's step raises it when the model called the tool wrongly: the episode ends there,
    counted as a tool error, with reward 0."""


class Env:
    """One episode's environment. simple_rl makes one per episode (--env FILE.py:NAME: NAME()),
    calls reset once, then step after each of the model's turns, with that turn's text.

    step returns (tool message, None) to answer a tool call, and the model goes on in another
    turn, or (None, reward) to end the episode. tool_stop: the strings (comma-separated, one
    token each) that end a turn to call the tool; --tool-stop overrides it.

    The contract that keeps runs bit-exact, resumed ones too: an env is fresh per episode, and
    step is a deterministic function of the episode's texts (no state across episodes, no
    clock, no unseeded randomness). --env's reset and step run on worker threads (so they
    cannot set signal handlers: no signal.alarm); one that runs past --tool-timeout ends its
    episode.
    problem is a Problem: problem.question and problem.answer (or problem["answer"]).
    """

    tool_stop = ""

    def reset(self, problem: Problem) -> str:
        """The user's first message (the same for every episode of a problem)."""
        return problem.question

    def step(self, completion: str) -> tuple[str | None, float | None]:
        raise NotImplementedError


class RewardEnv(Env):
    """One turn, scored by reward_fn(completion, answer): without --env, this step is where a
    training reward comes from (`score`, after the story ends, scores texts outside episodes:
    the start's check of the reward and the benchmarks)."""

    def __init__(self, reward_fn: RewardFn = reward):
        self.reward_fn = reward_fn

    def reset(self, problem: Problem) -> str:
        self.answer = problem.answer
        return problem.question

    def step(self, completion: str) -> tuple[str | None, float | None]:
        return None, self.reward_fn(completion, self.answer)


class CalcEnv(RewardEnv):
    """--env calc: a turn that ends in <calc>EXPR</calc> (integers, + - *, parentheses) gets
    EXPR's value as the tool's message (`calculate`, with the tools after the story ends); a
    turn without one is scored by reward_fn."""

    tool_stop = "</calc>"

    def step(self, completion: str) -> tuple[str | None, float | None]:
        if not completion.endswith("</calc>"):
            return None, self.reward_fn(completion, self.answer)
        return str(calculate(completion[: -len("</calc>")].rsplit("<calc>", 1)[-1])), None


# completed: the env scored a turn that ended at a stop id; length: one that hit
# --max-new-tokens; max_model_len: the turn or the tool's message ran into --max-model-len;
# max_turns: the env answered a tool call at --max-turns; tool_error: step raised ToolError;
# tool_timeout: step or reset ran past --tool-timeout
EPISODE_ENDS = ("completed", "length", "max_model_len", "max_turns", "tool_error", "tool_timeout")


@dataclass
class Turn:
    context: list[int]  # the ids added before it: the prompt (the first turn), else a tool's
    out: Completion  # what the model generated
    capped: bool = False  # its token limit was what --max-model-len left, not --max-new-tokens


@dataclass
class Episode:
    env: Env
    turns: list[Turn]
    status: str = "running"  # then one of EPISODE_ENDS
    reward: float = 0.0  # the env's, or 0 if it ended without one
    tool_calls: int = 0  # tool messages the env gave (one at --max-turns: never read)
    tool_s: float = 0.0  # seconds in env.step (its calls: call_tools)

    def ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.context + turn.out.ids]

    def generated_tokens(self) -> int:
        return sum(len(turn.out.ids) for turn in self.turns)

    def end(self, status: str) -> None:  # the one place an episode ends
        assert self.status == "running" and status in EPISODE_ENDS, (self.status, status)
        self.status = status


@dataclass
class Rollout:
    """A step's episodes as the trainer packs them (episodes_rollout): sequence b is episode
    b's first prompt followed by everything after it (the model's turns, the tools' messages);
    pack_rollout cuts a Qwen3.5's into a sequence a turn (each its episode's advantage)."""
    prompts: list[list[int]]  # each episode's first prompt (a problem's, G times)
    completions: list[list[int]]  # everything after it: turns and tool messages, not one turn
    generated: list[list[bool]]  # generated[b][t]: completion b's token t is the model's
    logprobs: torch.Tensor  # (N,) fp32: vLLM's logprob of every generated token, concatenated
    completed: list[bool]  # the episode completed: its env scored a turn that ended at a stop id
    # MoE: per episode, the experts vLLM chose for its generated tokens (Completion.routed, all
    # layers, the turns concatenated), or None where the engine returned none; None if the
    # engine returns no routes (a dense model, or a Qwen3-MoE under --no-prefix-caching)
    routed: list[torch.Tensor | None] | None
    episodes: list[Episode]


def new_episodes(trainer: Trainer, problems: list[Problem], prompt_ids: list[list[int]],
                 m: int) -> tuple[list[Env | None], list[list[int]]]:
    """m fresh envs per problem (G; 1 for the eval), reset, and each problem's first prompt as
    ids: the task's (prompt_ids) when reset gives the question, else its message formatted as
    the task's (the chat template's user turn, or 'Q: ...\\nA:'). An env whose reset ran past
    --tool-timeout is None: its episode ends at once. Episode j m + k (the rank's; an error
    names it) is problem j's k-th: problems a, b with m = 2 give envs a0 a1 b0 b1, and firsts[2] is
    b's first message."""
    make = trainer.make_env or (lambda: RewardEnv(trainer.reward_fn))
    envs = [make() for _ in range(len(problems) * m)]
    # firsts: each episode's first message, the same for a problem's m (reset_all refuses
    # others); late: the episodes whose reset ran past --tool-timeout
    firsts, late = reset_all(envs, problems, m, trainer.cfg)
    envs = [None if i in late else env for i, env in enumerate(envs)]
    # problems whose envs reset to another message than the question (firsts[j m]: problem j's)
    changed = [j for j, p in enumerate(problems) if firsts[j * m] != p.question]
    prompts = list(prompt_ids)
    new = first_prompt_ids([firsts[j * m] for j in changed], trainer.tokenizer, trainer.cfg,
                           samples=[j * m for j in changed])  # for an error's message
    for j, ids in zip(changed, new):
        prompts[j] = ids
    return envs, prompts


def start_episodes(envs: list[Env | None], prompts: list[list[int]],
                   outs: list[list[Completion]], cfg: Config) -> list[Episode]:
    """Every episode after its first turn: prompt j's m completions outs[j] begin episodes
    j m, ..., j m + m - 1, whose envs are envs[j m + k]."""
    turns = [Turn(list(p), c, capped=turn_tokens(cfg, p) < cfg.max_new_tokens)
             for p, cs in zip(prompts, outs) for c in cs]
    return [Episode(env, [turn]) for env, turn in zip(envs, turns)]


def play(engine: Engine, tokenizer, cfg: Config, episodes: list[Episode],
         seed_of: Callable[[int, int], int | None], temperature: float) -> float:
    """Advance every episode until it ends, all together. After each turn, every live
    episode's env reads the turn's text (`env_turn`; what ends an episode: end_turn's table);
    a tool message is rendered to ids (`going_on`), and the episodes that go on get it and
    their next turn from one engine.generate over all of them (`next_turns`). seed_of(i, k)
    seeds episode i's turn k (0: the first, already generated). Returns the seconds the turns
    waited on the envs.

    For example, --env calc on "What is 3*4?": turn 0 ends "...<calc>3*4</calc>"; the env
    answers ("12", None), a tool message, so the episode goes on, and turn 1 is generated after
    prompt + turn 0 + the message's ids. It ends "Answer: 12" at a stop id: the env answers
    (None, 1.0), a reward and no message, and end_turn ends the episode as "completed"."""
    for e in episodes:
        if e.env is None:  # its reset ran past --tool-timeout
            e.end("tool_timeout")
    live = [i for i, e in enumerate(episodes) if e.env is not None]
    waited = 0.0
    for k in range(1, cfg.max_turns + 1):  # k turns played; the next is turn k
        messages, seconds = env_turn(episodes, live, tokenizer, cfg, played=k)
        waited += seconds
        going = going_on(episodes, messages, tokenizer, cfg)
        if not going:
            return waited
        next_turns(engine, episodes, going, [seed_of(g.episode, k) for g in going],
                   temperature, cfg)
        live = [g.episode for g in going]
    return waited


def env_turn(episodes: list[Episode], live: list[int], tokenizer, cfg: Config,
             played: int) -> tuple[dict[int, str], float]:
    """The envs of the live episodes read their last turn's text (--env's on threads, --reward's
    inline: call_tools, "Tools"): the tool message of each episode that goes on ({episode:
    message}), and the seconds the calls took. end_turn ends the others. A RewardError (its
    message names the episode, `.sample`) records `.played`, the turns played (1: the first)."""
    texts = decode(tokenizer, [episodes[i].turns[-1].out.ids for i in live])
    t0 = time.perf_counter()
    called = call_tools([lambda i=i, text=text: env_step(episodes[i].env, text, i)
                         for i, text in zip(live, texts)], cfg)
    seconds = time.perf_counter() - t0
    messages = {}
    for i, c in zip(live, called):
        try:
            message = end_turn(episodes[i], c, played == cfg.max_turns)
        except RewardError as e:
            e.played = played
            raise
        if message is not None:
            messages[i] = message
    return messages, seconds


class Going(NamedTuple):
    episode: int  # its index
    ids: list[int]  # the tool message's ids: the next turn's context
    max_tokens: int  # the next turn's token limit: --max-new-tokens, or what --max-model-len left


def going_on(episodes: list[Episode], messages: dict[int, str], tokenizer,
             cfg: Config) -> list[Going]:
    """The episodes whose tool message leaves room for a token in --max-model-len; the others
    end as "max_model_len"."""
    going = []
    for (i, message), ids in zip(messages.items(),
                                 tool_message_ids(tokenizer, list(messages.values()), cfg)):
        room = turn_tokens(cfg, episodes[i].ids() + ids)
        if room < 1:  # no room left for a token
            episodes[i].end("max_model_len")
        else:
            going.append(Going(i, ids, room))
    return going


def next_turns(engine: Engine, episodes: list[Episode], going: list[Going],
               seeds: list[int | None], temperature: float, cfg: Config) -> None:
    """One engine.generate over the episodes that go on: each gets its tool message and its
    next turn."""
    outs = engine.generate([episodes[g.episode].ids() + g.ids for g in going], 1, seeds,
                           [g.max_tokens for g in going], temperature)
    for g, (out,) in zip(going, outs):  # n = 1: one completion a request
        capped = g.max_tokens < cfg.max_new_tokens
        episodes[g.episode].turns.append(Turn(g.ids, out, capped=capped))


class Called(NamedTuple):
    """A call to an env as call_tools reports it ("Tools", after the story ends)."""
    value: object  # what it returned (None if it raised)
    error: BaseException | None  # what it raised (ToolTimeout: it ran too long), else None
    seconds: float


def end_turn(episode: Episode, called: Called, last: bool) -> str | None:
    """What the env made of the episode's last turn (env_step's (message, reward), or what it
    raised): the tool message if the episode goes on, else None, the episode ended:

        the env                           the episode
        raised ToolError, or timed out    ends "tool_error" / "tool_timeout", reward 0
        raised anything else              the run stops (env_step made it a RewardError)
        answered (None, reward)           ends "completed" (the turn ended at a stop id), else
                                          "max_model_len" (its limit was the context's), "length"
        answered (message, r)             ends "max_turns" if this was turn --max-turns
        answered (message, r), else       goes on (going_on: "max_model_len" if no room left)
    """
    episode.tool_s += called.seconds
    if isinstance(called.error, (ToolError, ToolTimeout)):  # ends the episode, reward 0
        episode.reward = 0.0
        episode.end("tool_error" if isinstance(called.error, ToolError) else "tool_timeout")
        return None
    if called.error is not None:
        raise called.error
    message, given = called.value
    episode.reward = given or 0.0
    if message is None:
        last_turn = episode.turns[-1]
        episode.end("completed" if last_turn.out.stopped
                    else ("max_model_len" if last_turn.capped else "length"))
        return None
    episode.tool_calls += 1
    if last:
        episode.end("max_turns")
        return None
    return message


def episodes_rollout(episodes: list[Episode], routes: bool) -> Rollout:
    """The episodes as the trainer packs them: the first turn's prompt, then the rest (the
    model's turns and the tools' ids, marked in `generated`), vLLM's logprobs of the model's;
    routes: the engine returned each token's experts (Engine.returns_routes)."""
    completions, generated, routed = [], [], []
    for e in episodes:
        parts = [(turn.context if k else [], turn.out.ids) for k, turn in enumerate(e.turns)]
        completions.append([t for tool, ids in parts for t in tool + ids])
        generated.append([m for tool, ids in parts
                          for m in [False] * len(tool) + [True] * len(ids)])
        got = [turn.out.routed for turn in e.turns]
        routed.append(None if any(r is None for r in got) else torch.cat(got))
    logprobs = [x for e in episodes for turn in e.turns for x in turn.out.logprobs]
    return Rollout(
        prompts=[e.turns[0].context for e in episodes],
        completions=completions,
        generated=generated,
        logprobs=torch.tensor(logprobs, dtype=torch.float32),  # Python floats hold fp32 exactly
        completed=[e.status == "completed" for e in episodes],
        routed=routed if routes else None,
        episodes=episodes,
    )


def pack_rollout(rollout: Rollout, by_turn: bool) -> tuple[Packed, torch.Tensor]:
    """The update's sequences, and each one's episode (B,) int64. An episode is one sequence:
    its first prompt, then its turns (the targets) and the tools' messages between them. By turn
    (a Qwen3.5, whose linear attention vLLM ran from a zero state over each turn's whole
    request): each turn is a sequence, prompted with its request. E.g. prompt p, turn x y, tool
    message t, turn z: [p | x y] and [p x y t | z], of episode 0 both; targets keep their order."""
    if not by_turn:
        return (pack(rollout.prompts, rollout.completions, rollout.generated),
                torch.arange(len(rollout.prompts)))
    requests, outs, episode = [], [], []
    for i, e in enumerate(rollout.episodes):
        ids = []
        for turn in e.turns:  # turn k's request: the turns before it, then its context
            ids = ids + turn.context
            requests.append(ids)
            outs.append(turn.out.ids)
            episode.append(i)
            ids = ids + turn.out.ids
    return pack(requests, outs), torch.tensor(episode)


# ==========================================================================
# Advantages & loss (pure functions)
# ==========================================================================


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool,
                     eps: float) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), or r_i - mean_g r.

    rewards: (n G,) grouped consecutively (n prompts, G samples each).
    """
    assert rewards.numel() % group_size == 0, "rewards must come in whole groups"
    r = rewards.view(-1, group_size)  # (n, G)
    a = r - r.mean(-1, keepdim=True)
    if std_normalize:
        a = a / (r.std(-1, keepdim=True) + eps)  # unbiased std; equal rewards give A = 0
    return a.view(-1)


def finite_advantages(rewards: torch.Tensor, cfg: Config,
                      text: Callable[[int], str]) -> torch.Tensor:
    """group_advantages of the rewards (n G,); RewardError naming the largest |reward| of the
    first group whose advantages are not finite (its mean or std overflows fp32).
    text(i): episode i's last completion, read only for the message."""
    G = cfg.group_size
    adv = group_advantages(rewards, G, cfg.std_normalize, cfg.adv_eps)  # (n G,)
    bad = (~torch.isfinite(adv)).nonzero().flatten().tolist()
    if bad:
        first = bad[0] // G * G
        i = first + int(rewards[first:first + G].abs().argmax())
        raise RewardError(f"returned {rewards[i].item():.3g}, so large that its group's "
                          "advantages are not finite", i, text(i))
    return adv


def ppo_clip_loss(logp, old_logp, adv, clip_eps: float):
    """Per token: rho = exp(logp - old), pg = -min(rho A, clip(rho, 1-eps, 1+eps) A).

    Returns (pg, rho, clipped), each (N,); clipped is 1 where the clipped term is the smaller.
    """
    ratio = torch.exp(logp - old_logp)
    plain = ratio * adv
    bounded = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    return -torch.minimum(plain, bounded), ratio, (bounded < plain).float()


def kl_k3(logp, ref_logp) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(q) - q - 1 (>= 0), q = ref_logp - logp."""
    q = ref_logp - logp
    return torch.exp(q) - q - 1


# ==========================================================================
# Update & parity check: trainer vs vLLM, every generated token, fp32 bit patterns
# ==========================================================================


def batch_over_ranks(packed: Packed, cfg: Config, device) -> tuple[int, int]:
    """(micro-batches every rank runs, generated tokens over all ranks): `update`'s n_micro
    (FSDP's collectives need the same count on every rank) and its loss denominator."""
    n_micro = torch.tensor([len(plan_micro_batches(packed, cfg))], device=device)
    n_micro = all_reduce(n_micro, dist.ReduceOp.MAX)
    n_tokens = all_reduce(torch.tensor([len(packed.targets)], device=device))
    return int(n_micro), int(n_tokens)


def plan_micro_batches(packed: Packed, cfg: Config) -> list[range]:
    """micro_batches of the sequences (setup has made --micro-batch-tokens 0 a number)."""
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    return micro_batches(lengths, cfg.micro_batch_tokens)


class Pass(NamedTuple):
    """One forward and backward over every micro-batch (accumulate_gradients); `update`
    returns its first pass (the policy that sampled), with the gradient norm."""
    loss: torch.Tensor  # () the summed loss
    sums: torch.Tensor  # (5,) this rank's token sums of pg, kl, entropy, ratio, clipped
    logprobs: torch.Tensor  # (N,) fp32: the trainer's side of the parity check
    experts: torch.Tensor | None  # (N, sparse layers, k) int32: each token's (MoE)
    grad_norm: torch.Tensor | None = None  # () the global one, before clipping (`update`'s)


def update(model, ref_model, optimizer, packed: Packed, old_logp, seq_adv, cfg: Config,
           n_micro: int | None = None, n_tokens: int | None = None) -> Pass:
    """The update: `updates_per_batch` optimizer steps, each after a pass over all
    micro-batches of this rank's sequences.

    old_logp (N,) and seq_adv (B,) (packed sequence b's episode's advantage) live on the model's
    device.
    n_micro: micro-batches every rank runs (FSDP's collectives need the same count on every
    rank; a rank with fewer runs zero-counted ones); n_tokens: generated tokens over all
    ranks, the loss's denominator. Returns the first pass (Pass): its summed loss, token sums,
    global grad norm, logprobs (N,) and experts, what the parity check compares. Raises
    NonFiniteError (on every rank at once) if a logprob, the loss or the gradient norm is not
    finite before an optimizer step, or a weight after it.
    """
    device = old_logp.device
    n_tokens = len(packed.targets) if n_tokens is None else n_tokens
    parts = micro_batch_parts(packed, cfg, n_micro, device)
    # L = sum over every rank's tokens / n_tokens; FSDP averages the ranks' gradients, so each
    # rank's part is scaled by the world size (exact when it is a power of two). E.g. 2 ranks
    # of 100 and 60 tokens: each rank's sum times 2/160; FSDP's mean halves the sum of both.
    per_token = world_size() / n_tokens
    first = None
    for k in range(cfg.updates_per_batch):  # the k-th pass over the rollout
        optimizer.zero_grad(set_to_none=True)
        this_pass = accumulate_gradients(model, ref_model, parts, old_logp, seq_adv, cfg,
                                         per_token)
        # clip on the global norm; every rank agrees that all is finite before stepping (the
        # NaN checks are with the stops, after the story ends)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        check_finite(this_pass.logprobs, this_pass.loss, norm, packed, k, cfg.updates_per_batch)
        if first is None:
            first = this_pass._replace(grad_norm=norm.detach())
        optimizer.step()
        if not weights_finite(model, device):
            raise NonFiniteError("weights after the optimizer step", [], k, cfg.updates_per_batch)
    optimizer.zero_grad(set_to_none=True)  # the gradients' memory is the rollout's until next step
    return first


class MicroBatch(NamedTuple):
    batch: Packed  # its sequences packed on their own, on the model's device
    owned: slice  # its targets' slice of the rank's N
    seqs: range  # its sequences' range of the rank's B
    real: bool  # False for a padding micro-batch (it runs FSDP's collectives only, its loss x 0)


def micro_batch_parts(packed: Packed, cfg: Config, n_micro: int | None,
                      device) -> list[MicroBatch]:
    """The rank's micro-batches, padded to n_micro with uncounted copies of the first sequence."""
    def part(seqs: range, real: bool) -> MicroBatch:
        batch, owned = sub_pack(packed, seqs)
        return MicroBatch(batch.to(device), owned, seqs, real)

    parts = [part(g, True) for g in plan_micro_batches(packed, cfg)]
    padding = (n_micro or 0) - len(parts)
    return parts + [part(range(0, 1), False)] * padding if padding > 0 else parts


def accumulate_gradients(model, ref_model, parts: list[MicroBatch], old_logp, seq_adv,
                         cfg: Config, per_token: float) -> Pass:
    """Forward + backward of every micro-batch; gradients accumulate in fp32. Returns the
    pass's summed loss, token sums, logprobs and (MoE) the experts it chose."""
    device = old_logp.device
    loss_total = torch.zeros((), device=device)
    logps = torch.empty(len(old_logp), dtype=torch.float32, device=device)  # (N,)
    sums = torch.zeros(5, device=device)  # token sums: pg, kl, entropy, ratio, clipped
    sparse_at = sparse_layers(model.args)
    experts = torch.empty(len(old_logp), len(sparse_at), model.args.moe_args.top_k,
                          dtype=torch.int32, device=device) if sparse_at else None
    with weights_cast_once(model):  # the weights do not change until the optimizer steps
        for batch, owned, seqs, real in parts:
            logp, ent = model(batch, cfg.temperature)  # (N_mb,) each
            # read now: under LoRA the reference is this model (BasePolicy: adapters off), whose
            # forward overwrites TopK.ids
            if experts is not None and real:
                experts[owned] = model.routed_ids(batch)
            # batch.seq counts from the micro-batch's first sequence, seq_adv from the rank's
            adv_tok = seq_adv[batch.seq + seqs.start]  # (N_mb,) its sequence's advantage
            pg, ratio, clipped = ppo_clip_loss(logp, old_logp[owned], adv_tok, cfg.clip_eps)
            kl = torch.zeros_like(logp)
            if cfg.kl_coef > 0:
                with torch.no_grad():
                    ref_logp, _ = ref_model(batch, cfg.temperature)
                kl = kl_k3(logp, ref_logp)
            loss = real * per_token * (pg + cfg.kl_coef * kl - cfg.entropy_coef * ent).sum()
            loss.backward()
            if not real:
                continue  # a padding micro-batch: its collectives ran, its numbers don't count
            loss_total += loss.detach()
            logps[owned] = logp.detach()
            sums += torch.stack([pg.sum(), kl.sum(), ent.sum(), ratio.sum(),
                                 clipped.sum()]).detach()
    return Pass(loss_total, sums, logps, experts)


@dataclass
class Parity:
    """One step's check: the trainer's logprob of every generated token (and, for an MoE,
    its experts) against vLLM's, bit for bit. It checks, it does not block: the update's first
    forward is its trainer side, so the step updates and pushes whatever it finds. A mismatch
    is printed with a table of where each differing sample first differs, and charted in
    TensorBoard (a run total); --strict-parity stops the run after that step, exit 4, keeping
    the last checkpoint; --debug-parity shows which op differs first."""
    n_tokens: int
    n_mismatch: int
    max_abs_diff: float
    table: str
    routes_checked: bool = False  # vLLM returned the experts it chose: the counts below count
    routing_tokens: int = 0  # generated tokens whose experts vLLM returned and we compared
    routing_mismatch: int = 0  # of those, tokens where any sparse layer chose other experts


def routing_report(engine_routed: list[torch.Tensor | None], trainer_ids: torch.Tensor,
                   gen_counts: list[int], layers: tuple[int, ...]) -> tuple[int, int]:
    """(tokens compared, tokens whose expert set differs in any sparse layer).

    engine_routed: per episode (C_b, all layers, k) or None (not compared): Rollout.routed,
    vLLM's experts for every layer, a dense one's included; trainer_ids
    (N, sparse layers, k), N = sum C_b in episode order (a Qwen3.5's turns keep it); layers:
    the sparse layers' indices.
    Sets are compared (both sides sorted), so the order of the k ids does not matter.
    """
    kept = [b for b, r in enumerate(engine_routed) if r is not None and gen_counts[b]]
    if not kept:
        return 0, 0
    ours = trainer_ids.cpu().split(gen_counts)
    our_sets = torch.cat([ours[b] for b in kept]).long().sort(dim=-1).values  # (N', sparse, k)
    their_sets = torch.cat([engine_routed[b] for b in kept])[:, list(layers)]
    their_sets = their_sets.long().sort(dim=-1).values  # (N', sparse layers, k)
    return len(our_sets), int((their_sets != our_sets).flatten(1).any(dim=1).sum())


def parity_report(vllm_lp: torch.Tensor, trainer_lp: torch.Tensor, tokens: torch.Tensor,
                  gen_counts: list[int], rows: int) -> Parity:
    """Compare int32 views of two fp32 vectors (N,), the generated tokens in episode order
    (gen_counts: per episode). Bits, not values: -0.0 against +0.0 is a mismatch, a NaN matches
    only the same NaN. With the table of where each of the first `rows` differing samples
    first differs (`parity_table`)."""
    a, b = vllm_lp.float().cpu(), trainer_lp.detach().float().cpu()
    n, bad = len(a), a.view(torch.int32) != b.view(torch.int32)  # (N,)
    assert sum(gen_counts) == n, f"generated counts sum to {sum(gen_counts)}, not to {n} tokens"
    return Parity(n, int(bad.sum()), float((a - b).abs().max()) if n else 0.0,
                  parity_table(a, b, bad, tokens, gen_counts, rows))


def parity_over_ranks(p: Parity, device) -> Parity:
    """Token and mismatch counts summed, max |delta| over every rank; rank 0's table (another
    rank's differing samples are in its counts, not in the table)."""
    totals = all_reduce(torch.tensor([p.n_tokens, p.n_mismatch, p.routing_tokens,
                                      p.routing_mismatch], device=device))
    # NaN deltas must count as the largest; +inf stands in for them in the MAX reduction
    worst = all_reduce(torch.tensor([p.max_abs_diff], device=device).nan_to_num(math.inf),
                       dist.ReduceOp.MAX)
    n_tokens, n_mismatch, routing_tokens, routing_mismatch = totals.tolist()
    return Parity(n_tokens, n_mismatch, worst.item(), p.table, p.routes_checked, routing_tokens,
                  routing_mismatch)


def parity_line(p: Parity) -> str:
    routing = (f" | routing: {p.routing_mismatch}/{p.routing_tokens} tokens chose other "
               "experts" if p.routes_checked else "")
    return (f"parity: identical={'yes' if p.n_mismatch == 0 else 'no'} | {p.n_mismatch}/"
            f"{p.n_tokens} tokens differ | max |delta| {p.max_abs_diff:.3g}{routing}")


# ==========================================================================
# Weight push: trainer -> the running vLLM engine, in memory
# ==========================================================================


def push_weights(engine: VLLMEngine, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Full fine-tuning: hand the weights the trainer computes with (bf16; A_log fp32) to
    vLLM's own loader, which fuses q/k/v and gate/up itself and copies in place (no file). A
    sleeping engine gets its weight memory back first and its KV cache after. LoRA: making
    `weights` (policy_weights) already wrote the engine's adapter slot; this checks it, and
    wakes the KV cache. Either way the prefix cache is dropped (its KV is of the old weights).
    Returns the seconds the waking took.
    """
    lora = engine.lora
    t0 = time.perf_counter()
    if engine.asleep:
        free, _ = torch.cuda.mem_get_info()
        # the trainer's allocator keeps freed blocks cached, which the engine needs; under
        # LoRA, kept, they would sit beside the whole KV cache through the rollout (measured
        # at 14B: 133 of 140 GiB in use), so they are always released
        if free < engine.wake_bytes or lora:
            torch.cuda.empty_cache()
        if not lora:
            with waking():  # no room to map the weights back: exit 5, as any out of memory
                engine.llm.wake_up(tags=["weights"])
    t1 = time.perf_counter()
    if lora:  # policy_weights refreshed the adapter's casts, the engine's slot: nothing to copy
        check_in_slot(engine, weights)
    else:
        # engine_names: a Qwen3.5 with a vision tower holds them under model.language_model.
        engine.llm.apply_model(lambda m: m.load_weights(engine_names(m, weights)))
    t2 = time.perf_counter()  # the copies may still run: the wake-up below does not wait
    if engine.asleep:
        with waking():
            if lora:
                map_kv_cache(True)
            else:
                engine.llm.wake_up(tags=["kv_cache"])
        engine.asleep = False
    wake_s = (t1 - t0) + (time.perf_counter() - t2)
    engine.llm.reset_prefix_cache()
    return wake_s


# ==========================================================================
# Training loop: rl_step, evaluate, train, setup (run, at the file's end, calls setup, then train)
# ==========================================================================


@dataclass
class Trainer:
    """Everything a step touches, built once by `setup` (or by a test, with a stand-in engine)."""

    cfg: Config
    engine: Engine  # generate, first_turn, sleep, push
    tokenizer: object
    model: Qwen3
    ref_model: Qwen3 | BasePolicy | None  # LoRA's: the policy, adapters off
    optimizer: torch.optim.Optimizer
    task: Task
    ranks: Ranks
    writer: object = None  # TensorBoard SummaryWriter, on rank 0
    reward_fn: RewardFn = reward  # reward(completion, answer) -> float: ours or --reward's
    make_env: Callable[[], Env] | None = None  # --env's; None: one turn, scored by reward_fn
    inputs: dict = field(default_factory=dict)  # sha256 of the files the run read (INPUTS)
    mismatched_total: int = 0  # mismatched tokens since the run began (kept in checkpoints)


def rl_step(trainer: Trainer, step: int) -> tuple[dict[str, float], Parity]:
    """One step in five phases: rollout -> rewards and advantages -> update (with the parity
    check) -> weight push -> metrics."""
    cfg, device = trainer.cfg, trainer.ranks.device
    G = cfg.group_size
    # The step's prompt i is problem chosen[i]; this rank plays the prompts `mine` (i mod world
    # == rank), and its episode s is sample s % G of prompt mine[s // G].
    chosen = step_problems(len(trainer.task.problems), cfg.num_prompts, step, cfg.seed)
    mine = my_prompts(cfg.num_prompts, trainer.ranks)

    def sample_name(s: int) -> str:
        return f"sample {s % G} of training problem {chosen[mine[s // G]]}"

    t0 = time.perf_counter()
    # 1. Rollout: G episodes of each prompt, played to their ends. 2. Rewards and advantages,
    # per group (a prompt's G episodes are all on this rank). A reward's or an env's failure on
    # any rank stops every rank ("Ranks", after the story ends).
    with failing_together(trainer, sample_name):
        rollout, waited = roll_out(trainer, step, mine, chosen)
        rewards, adv = rewards_and_advantages(trainer, rollout)
    adv = adv.to(device)
    rollout_in_use, sleep_s = engine_to_sleep(trainer)  # the update gets the KV cache's memory
    t1 = time.perf_counter()

    # 3. Update. Its first forward is the trainer's side of the parity check.
    first_pass, n_tokens, parity = update_with_parity(trainer, rollout, adv, mine)
    memory = memory_metrics(device, rollout_in_use) if device.type == "cuda" else {}
    t2 = time.perf_counter()

    # 4. Push: the engine now holds exactly the weights the trainer will compute with.
    wake_s = push_policy(trainer)
    t3 = time.perf_counter()

    # 5. Metrics over every rank; TensorBoard on rank 0 (the "Logging" plumbing).
    trainer.mismatched_total += parity.n_mismatch  # a chart that, once off 0, stays off 0
    metrics = step_metrics(cfg, rollout, rewards, len(mine), first_pass.sums, n_tokens,
                           first_pass.grad_norm, parity, times=(t1 - t0, t2 - t1, t3 - t2))
    metrics.update(run_metrics(trainer, parity, sleep_s, wake_s, waited, memory))
    write_scalars(trainer.writer, metrics, step)
    return metrics, parity


def roll_out(trainer: Trainer, step: int, mine: list[int],
             chosen: list[int]) -> tuple[Rollout, float]:
    """G episodes of each of this rank's prompts (mine: their indices in the step; chosen[i]:
    prompt i's problem). The first turn samples G completions of each prompt, seeded by its
    index in the step (Engine.first_turn); `play` continues every live episode. Returns the
    rollout and the seconds its turns waited on the envs."""
    cfg, task = trainer.cfg, trainer.task
    G = cfg.group_size
    envs, prompts = new_episodes(trainer, [task.problems[chosen[i]] for i in mine],
                                 [task.prompt_ids[chosen[i]] for i in mine], G)
    outs = trainer.engine.first_turn(prompts, mine, step)
    episodes = start_episodes(envs, prompts, outs, cfg)
    waited = play(trainer.engine, trainer.tokenizer, cfg, episodes,
                  lambda i, turn: turn_seed(cfg, step, prompt=mine[i // G], g=i % G, turn=turn),
                  cfg.temperature)
    return episodes_rollout(episodes, trainer.engine.returns_routes), waited


def rewards_and_advantages(trainer: Trainer,
                           rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Each episode's reward, the env's (n G,) fp32, and its advantage within its group. The
    rewards come from the episodes' envs as they ended (for one turn, RewardEnv: --reward);
    RewardError on a group whose advantages overflow fp32."""
    episodes = rollout.episodes
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)  # (n G,)
    adv = finite_advantages(rewards, trainer.cfg, lambda i: decode(
        trainer.tokenizer, [episodes[i].turns[-1].out.ids])[0])
    return rewards, adv


def engine_to_sleep(trainer: Trainer) -> tuple[int, float]:
    """The engine frees its KV cache (and weights) for the update, until the push. Returns the
    GPU bytes in use before (the rollout's peak: weights and a full KV cache) and the seconds
    it took."""
    device = trainer.ranks.device
    rollout_in_use = device_in_use(device)  # the memory metrics are under "Logging"
    t0 = time.perf_counter()
    trainer.engine.sleep()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # memory_metrics reads the update's peaks
    return rollout_in_use, time.perf_counter() - t0


def update_with_parity(trainer: Trainer, rollout: Rollout, adv: torch.Tensor,
                       mine: list[int]) -> tuple[Pass, int, Parity]:
    """`update` on this rank's rollout, whose first forward is the trainer's side of the
    parity check: every generated token's logprob and, for an MoE, its experts. Returns
    (the update's first pass, generated tokens over all ranks, parity over all ranks)."""
    cfg, device, G = trainer.cfg, trainer.ranks.device, trainer.cfg.group_size
    # a sequence is an episode, or for Qwen3.5 a turn (pack_rollout); episode_of (B,):
    # each sequence's episode
    packed, episode_of = pack_rollout(rollout, by_turn=bool(gdn_layers(trainer.model.args)))
    n_micro, n_tokens = batch_over_ranks(packed, cfg, device)
    try:
        seq_adv = adv[episode_of.to(device)]  # (B,): each sequence its episode's advantage
        first_pass = update(trainer.model, trainer.ref_model, trainer.optimizer, packed,
                            rollout.logprobs.to(device), seq_adv, cfg, n_micro, n_tokens)
    except NonFiniteError as e:  # name the step's prompts, for the diagnostic
        # e.seqs: the rank's packed sequences it found; their episodes, their prompts
        e.episodes = sorted({int(episode_of[s]) for s in e.seqs})
        e.prompts = sorted({mine[i // G] for i in e.episodes})
        raise
    parity = parity_report(rollout.logprobs, first_pass.logprobs, packed.targets,
                           generated_lengths(rollout), cfg.parity_rows)
    if rollout.routed is not None:  # (none from a Qwen3-MoE under --no-prefix-caching)
        parity.routes_checked = True
        parity.routing_tokens, parity.routing_mismatch = routing_report(
            rollout.routed, first_pass.experts, generated_lengths(rollout),
            sparse_layers(trainer.model.args))
    return first_pass, n_tokens, parity_over_ranks(parity, device)


def push_policy(trainer: Trainer) -> float:
    """The push; returns the seconds within it spent waking the engine. Under LoRA,
    policy_weights' refresh of the adapter's casts writes the engine's slot: the push."""
    wake_s = trainer.engine.push(policy_weights(trainer.model))
    if trainer.ranks.device.type == "cuda":
        torch.cuda.synchronize()  # the push is asynchronous: time it whole
    return wake_s


def decode(tokenizer, completions: list[list[int]]) -> list[str]:
    """Completion texts; ids past the tokenizer's vocab (a model's vocab may be larger) skipped."""
    vocab = len(tokenizer)
    return tokenizer.batch_decode([[t for t in c if t < vocab] for c in completions],
                                  skip_special_tokens=True)


def generated_lengths(rollout: Rollout) -> list[int]:
    """Tokens the model generated, per episode (its tool tokens are not)."""
    return [sum(g) for g in rollout.generated]


def evaluate(trainer: Trainer, step: int) -> dict[str, float]:
    """Greedy episodes of the held-out problems, tools included, over every rank: their
    mean reward (for a 0/1 reward, the accuracy of the weights after `step` steps). Logged to
    TensorBoard at `step`, also in percent with its 95% interval (the dashboard's chart; normal
    approximation, for a 0/1 reward the binomial one): 100 (mean +- 1.96 sqrt((mean(r^2) -
    mean(r)^2) / N))."""
    task, cfg = trainer.task, trainer.cfg
    mine = my_prompts(len(task.eval_problems), trainer.ranks)
    t0 = time.perf_counter()
    with failing_together(trainer, lambda i: f"held-out problem {mine[i]}"):
        episodes = greedy_episodes(trainer, mine)
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    sums = torch.tensor([rewards.sum().item(), rewards.square().sum().item(),
                         sum(e.generated_tokens() for e in episodes),
                         sum(e.tool_calls > 0 for e in episodes)], dtype=torch.float64,
                        device=trainer.ranks.device)
    n = len(task.eval_problems)
    total, squares, length, calls = (all_reduce(sums) / n).tolist()
    half = 1.96 * math.sqrt(max(squares - total * total, 0.0) / n)
    metrics = {"eval/accuracy": total, "eval/accuracy_pct": 100 * total,
               "eval/accuracy_low_pct": 100 * (total - half),
               "eval/accuracy_high_pct": 100 * (total + half),
               "eval/completion_len_mean": length,
               **({"eval/tool_call_frac": calls} if cfg.env else {}),
               "time/eval_s": time.perf_counter() - t0}
    write_scalars(trainer.writer, metrics, step)
    return metrics


def greedy_episodes(trainer: Trainer, mine: list[int]) -> list[Episode]:
    """One greedy episode of each held-out problem in `mine`, played to its end."""
    task, cfg = trainer.task, trainer.cfg
    envs, prompts = new_episodes(trainer, [task.eval_problems[i] for i in mine],
                                 [task.eval_prompt_ids[i] for i in mine], 1)
    if not prompts:
        return []
    outs = trainer.engine.generate(prompts, 1, [None] * len(prompts),
                                   [turn_tokens(cfg, p) for p in prompts], 0.0)
    episodes = start_episodes(envs, prompts, outs, cfg)
    play(trainer.engine, trainer.tokenizer, cfg, episodes, lambda i, turn: None, 0.0)
    return episodes


def eval_due(cfg: Config, step: int) -> bool:
    """Evaluate before step `step` (after `step` RL steps): at 0, every --eval-every steps, and
    after the last step (in `finish`)."""
    if cfg.eval_size == 0:
        return False
    return step in (0, cfg.steps) or (cfg.eval_every > 0 and step % cfg.eval_every == 0)


def train(trainer: Trainer, start: int, run_dir: Path, model_dir: Path) -> str:
    """Steps start..steps-1 with periodic checkpoints; the final export (an HF checkpoint, or
    under LoRA a PEFT adapter unless --export merged) and its sha256.
    Its logs, stops and checkpoints are plumbing: "Logging", "Stops", "Checkpoints & resume".

    Ctrl-C or SIGTERM lets the current step (or the last eval, or the export) finish, saves a
    checkpoint and closes TensorBoard.
    A non-finite logprob, loss, gradient norm or weight stops the run before anything is saved
    or pushed, writes a diagnostic and keeps the last good checkpoint.
    """
    cfg = trainer.cfg
    with writing(run_dir / "metrics.jsonl"):  # a refused write: one sentence, exit 6
        metrics_log = (run_dir / "metrics.jsonl").open("a") if trainer.ranks.main else None
    began, done = time.perf_counter(), 0
    try:
        with StopRequest() as stop:
            for step in range(start, cfg.steps):
                with stops_at(trainer, step, run_dir, model_dir):  # a fault: its sentence and code
                    evals = evaluate(trainer, step) if eval_due(cfg, step) else {}
                    metrics, parity = rl_step(trainer, step)
                metrics.update(evals)
                done += 1
                report_step(trainer, step, step == start, metrics, parity, metrics_log,
                            (time.perf_counter() - began) / done)
                # --strict-parity, a Ctrl-C or SIGTERM, --save-every ("Stops")
                after_step(stop, trainer, run_dir, model_dir, step, parity)
            # the last held-out eval, then the export (a stop between them: no export)
            digest = finish(stop, trainer, metrics_log, run_dir, model_dir)
    finally:
        close_logs(trainer, metrics_log, run_dir)
    return digest


def setup(cfg: Config, passed: set[str] = frozenset(), engine_factory=None,
          device_type: str = "cuda"):
    """Build (or rebuild from a checkpoint) everything `train` needs; returns
    (trainer, first step, run dir, model dir), or None after --check.

    Every check that needs only the config, the checkpoint, the files and the reward runs
    before the run directory and the engine, and in one process before the GPU is touched.
    engine_factory(cfg, files, ranks) makes the engine (VLLMEngine; tests: a CPU stand-in).
    """
    # Phase 1. Ranks. The process group exists before vLLM starts: vLLM joins it. Under
    # torchrun NCCL starts with the group, so the environment vLLM needs is set (and the GPU
    # checked) first. --check asks no GPU question (it runs on a laptop): its ranks use gloo.
    gpu_first = engine_factory is None and "RANK" in os.environ and not cfg.check
    if gpu_first:
        prepare_environment(cfg)
    ranks = init_ranks("cpu" if cfg.check else device_type)

    # Phase 2. What to run: decided on rank 0 (resume config, run name), the same on every rank.
    cfg, ckpt, expect = on_rank0(lambda: resolve_run(cfg, passed))  # expect: a resume's hashes
    check_ranks(cfg, ranks.world)

    # Phase 3. Every check that needs no GPU, in seconds: the files a resume's run read, model
    # files, tokenizer, prompts, reward and env ("Model and data files", after the story ends).
    checked = check_inputs(cfg, ckpt, expect, passed)
    if checked is None:  # --check: nothing made, no engine; it said what was checked
        return None
    files, task, reward_fn, make_env, inputs = checked
    if engine_factory is None:  # the GPU, the environment parity needs and vLLM
        check_qwen35_engine(cfg, passed, files.args)  # what it cannot do yet, if a Qwen3.5
        if not gpu_first:
            prepare_environment(cfg)
        engine_factory = VLLMEngine
    prompt_lens = prompt_range(task, cfg)  # (shortest, longest) prompt, in tokens
    cfg = with_micro_batch(cfg, files.args, ranks, prompt_lens)  # the run's config keeps the choice
    estimate = check_memory(cfg, files.args, ranks, prompt_lens) if device_type == "cuda" else ""
    hf_state = read_weights(cfg, files, engine_lends=engine_factory is VLLMEngine)
    run_dir = Path(on_rank0(lambda: str(prepare_run_dir(cfg, ckpt))))

    # Phase 4. Engine, then the trainer's model (vLLM sizes itself from the memory free then).
    ops = bib.vllm_kernels() if cfg.kernels != "reference" and device_type == "cuda" \
        else bib.reference_kernels()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if device_type == "cuda":
        print0(f"starting vLLM on {ranks.world} GPU(s) (the first start on a machine compiles "
               "kernels: 1-2 minutes)")
    with starting(device_type, estimate):  # out of GPU memory here: one sentence, exit 5
        engine = engine_factory(cfg, files, ranks)
        model, ref_model = build_models(cfg, files.args, hf_state, ops, ranks, engine)
        del hf_state
        optimizer = make_optimizer(model, cfg)
        trainer = Trainer(cfg, engine, files.tokenizer, model, ref_model, optimizer, task,
                          ranks, reward_fn=reward_fn, make_env=make_env if cfg.env else None,
                          inputs=inputs)
        start = restore_checkpoint(trainer, ckpt) if ckpt else 0
        engine.push(policy_weights(model))  # from here on the engine holds the trainer's policy

    # Phase 5. Logging: TensorBoard on rank 0, and the run's first lines ("Logging").
    start_logs(trainer, run_dir, ckpt, start, files, estimate)
    return trainer, start, run_dir, files.path


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW on the fp32 masters (or their shards; under LoRA the adapters'); fused on CUDA
    (deterministic)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay, fused=fused)


# ==========================================================================
# The RL story ends here. What follows is plumbing a researcher need not read: config
# parsing and validation, model and data files, errors and exit codes, rank helpers, the vLLM
# patches, Qwen3.5 on vLLM, LoRA's engine slot and names, the tools' threads and text, the
# lookup task's table, checkpoints and resume, the run directory and export, logging, the
# memory estimate, console filtering, stops (signals, NaN, OOM), the parity debugger and, last,
# the entry point (main).
# ==========================================================================


# ==========================================================================
# Config: parsing and validation
# ==========================================================================


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
REWARD_SPEC = re.compile(r".+\.py:[A-Za-z_][A-Za-z0-9_]*")
FP32_TINY = 1.1754943508222875e-38  # fp32's smallest normal number
MAX_TURNS = 2**15  # a turn's seeds lie turn * 2^48 above the first's, within 64 bits
FP32_MAX = 3.4028234663852886e38  # fp32's largest finite number
MAX_SAMPLES = 2**16  # samples a step (prompts x group size): rollouts are held in host memory
MAX_LORA_SCALE = 1024.0  # alpha / r: usual values are 0.5-4; far above, one step swamps the base


EXAMPLES = """examples:
  VLLM_BATCH_INVARIANT=1 python simple_rl.py --model Qwen/Qwen3-1.7B --steps 20
  VLLM_BATCH_INVARIANT=1 torchrun --nproc-per-node 2 simple_rl.py --model Qwen/Qwen3-8B
  python simple_rl.py --model Qwen/Qwen3-1.7B --task gsm8k --data-files gsm8k/train.parquet
  python simple_rl.py --resume latest --run-name my-run --steps 40
"""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input
        self.exit(2, f"simple_rl: error: {message} (see --help).\n")


def parse_config(argv: list[str] | None = None) -> tuple[Config, set[str]]:
    """The CLI, generated from Config: its groups, help texts and choices.

    Returns the config and the names of the flags actually given (a resume warns about those
    it ignores).
    """
    p = Parser(usage="%(prog)s [options]   (several GPUs: torchrun --nproc-per-node N "
               "%(prog)s [options])", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter,
               argument_default=argparse.SUPPRESS)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Config):
        meta = f.metadata
        group = groups.setdefault(meta["group"], p.add_argument_group(meta["group"]))
        if f.type in ("bool", bool) and f.default:  # on by default: --no-X turns it off
            group.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               help=meta["help"] + " (default: on)")
        elif f.type in ("bool", bool):
            group.add_argument(flag(f.name), dest=f.name, action="store_true",
                               help=meta["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            shown = f" (default: {f.default})" if f.default != "" else ""
            group.add_argument(flag(f.name), dest=f.name, type=kind, choices=meta["choices"],
                               help=meta["help"] + shown)
    given = vars(p.parse_args(argv))
    return absolute_paths(Config(**given)), set(given)


def absolute_paths(cfg: Config) -> Config:
    """Every path of the config made absolute, once, at start: a reward or a library that
    changes the working directory mid-run cannot move the run or what it reads."""
    def absolute(path: str) -> str:
        return str(Path(path).expanduser().absolute()) if path else path

    def absolute_spec(spec: str) -> str:  # FILE.py:NAME (--reward, --env; not --env calc)
        if ":" not in spec:
            return spec
        file, name = spec.rsplit(":", 1)
        return f"{absolute(file)}:{name}"

    return dataclasses.replace(
        cfg, log_dir=absolute(cfg.log_dir), output_dir=absolute(cfg.output_dir),
        data_files=absolute(cfg.data_files), reward=absolute_spec(cfg.reward),
        env=absolute_spec(cfg.env),
        resume=cfg.resume if cfg.resume == "latest" else absolute(cfg.resume),
        model=absolute(cfg.model) if looks_like_path(cfg.model) else cfg.model)


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    """Every check on the config alone, in one place (the checkpoint's checks live in load):
    each field's type and range, then the numbers, the task and env, LoRA, the names."""
    validate_types(cfg)
    validate_numbers(cfg)
    validate_task(cfg)
    validate_lora(cfg)
    need(not cfg.run_name or RUN_NAME.fullmatch(cfg.run_name) is not None,
         f"--run-name {cfg.run_name!r} must be a plain name (letters, digits, '.', '_', '-'; "
         "no '/', not '.' or '..'): a run lives in LOG_DIR/RUN_NAME.")
    if looks_like_path(cfg.model) and not cfg.resume:
        need(Path(cfg.model).expanduser().is_dir(), f"--model {cfg.model!r} is not a directory.")


def validate_types(cfg: Config) -> None:
    """Each field's type (a run_config.json may hold anything), floats in fp32's range, and
    the choices of those that have them."""
    kinds = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)  # a crafted run_config.json's may be of any JSON type
        need(isinstance(value, kinds[f.type]) and (f.type == "bool") == (type(value) is
             bool), f"{flag(f.name)} must be a {f.type} (got {shown(value)}).")
        if f.type == "float":  # finite, and in fp32's range: the optimizer computes in it
            need(math.isfinite(value) and abs(value) < 3e38, f"{flag(f.name)} must be a finite "
                 f"number below 3e38 in magnitude, fp32's range (got {value:g}).")
            # a nonzero value below fp32's smallest normal number would become 0 or lose its bits
            need(value == 0 or abs(value) >= FP32_TINY, f"{flag(f.name)} {value} is too small "
                 f"for fp32 (0, or at least {FP32_TINY:.3g} in magnitude).")
        if f.metadata["choices"]:
            need(value in f.metadata["choices"], f"{flag(f.name)} must be one of "
                 f"{', '.join(f.metadata['choices'])} (got {value!r}).")


def validate_numbers(cfg: Config) -> None:
    """The rollout's, the loss's, the optimizer's and the logging's numbers."""
    need(cfg.group_size >= 2, f"--group-size must be at least 2 (got {cfg.group_size}): GRPO "
         "normalises rewards within a group.")
    need(cfg.num_prompts >= 1, f"--num-prompts must be at least 1 (got {cfg.num_prompts}).")
    need(cfg.num_prompts * cfg.group_size <= MAX_SAMPLES, f"--num-prompts x --group-size is "
         f"{cfg.num_prompts * cfg.group_size:,} samples a step; a step holds its samples in "
         f"memory, at most {MAX_SAMPLES:,}.")
    need(0 <= cfg.seed < 2**32, f"--seed must lie in [0, 2^32) (got {cfg.seed}).")
    need(cfg.max_new_tokens >= 1, f"--max-new-tokens must be at least 1 "
         f"(got {cfg.max_new_tokens}).")
    need(cfg.temperature > 0, f"--temperature must be > 0 (got {cfg.temperature}); greedy "
         "decoding has no policy gradient.")
    need(cfg.max_new_tokens < cfg.max_model_len, f"--max-new-tokens ({cfg.max_new_tokens}) "
         f"leaves no room for a prompt in --max-model-len ({cfg.max_model_len}).")
    need(cfg.clip_eps > 0, f"--clip-eps must be > 0 (got {cfg.clip_eps}).")
    need(cfg.kl_coef >= 0 and cfg.entropy_coef >= 0, "--kl-coef and --entropy-coef must be >= 0.")
    need(cfg.adv_eps > 0, f"--adv-eps must be > 0 (got {cfg.adv_eps}).")
    need(cfg.updates_per_batch >= 1, "--updates-per-batch must be at least 1.")
    need(cfg.steps >= 0, f"--steps must be >= 0 (got {cfg.steps}).")
    need(cfg.lr > 0, f"--lr must be > 0 (got {cfg.lr}).")
    need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0 (got {cfg.weight_decay}).")
    need(0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1, f"--beta1 and --beta2 must lie in [0, 1) "
         f"(got {cfg.beta1}, {cfg.beta2}).")
    need(cfg.grad_clip >= 0, f"--grad-clip must be >= 0 (got {cfg.grad_clip}).")
    need(cfg.kv_cache_gib >= 0, f"--kv-cache-gib must be >= 0 (got {cfg.kv_cache_gib}).")
    need(cfg.micro_batch_tokens == 0 or cfg.micro_batch_tokens >= cfg.max_model_len,
         f"--micro-batch-tokens ({cfg.micro_batch_tokens}) must hold one full sequence "
         f"(--max-model-len {cfg.max_model_len}), or be 0 (auto).")
    need(cfg.parity_rows >= 0 and cfg.parity_every >= 1, "--parity-rows must be >= 0 and "
         "--parity-every >= 1.")
    need(cfg.save_every >= 0 and cfg.keep_last >= 1, "--save-every must be >= 0 and "
         "--keep-last >= 1.")


def validate_task(cfg: Config) -> None:
    """The task, the env and the reward: what goes with what."""
    need(not cfg.data_files or cfg.task in ("gsm8k", "jsonl"), "--data-files goes with --task "
         "gsm8k or jsonl.")
    need(cfg.task != "jsonl" or bool(cfg.data_files), "--task jsonl reads your problems from "
         "--data-files FILE (jsonl or parquet rows with 'question' and 'answer').")
    need(cfg.eval_every >= 0, f"--eval-every must be >= 0 (got {cfg.eval_every}).")
    need(cfg.eval_size >= 0, f"--eval-size must be >= 0 (got {cfg.eval_size}; 0: no eval).")
    need(cfg.task != "arithmetic" or cfg.env == "lookup" or cfg.eval_size <= EVAL_CANDIDATES // 2,
         f"--eval-size {cfg.eval_size}: the arithmetic task holds out at most "
         f"{EVAL_CANDIDATES // 2} problems.")  # lookup asks its own questions (load_task)
    need(cfg.env in ("", *EMBEDDED_ENVS) or REWARD_SPEC.fullmatch(cfg.env) is not None,
         f"--env {cfg.env!r} must be calc, lookup or name a Python file and a class in it: "
         "FILE.py:NAME.")
    need(cfg.env != "lookup" or cfg.eval_size <= LOOKUP_PEOPLE // 2, f"--eval-size "
         f"{cfg.eval_size}: the lookup task holds out at most {LOOKUP_PEOPLE // 2} questions.")
    need(cfg.env != "lookup" or cfg.max_turns >= LOOKUP_HOPS + 2, f"--max-turns "
         f"{cfg.max_turns}: the lookup task's questions need up to {LOOKUP_HOPS + 1} searches "
         f"and an answer; give --max-turns {LOOKUP_HOPS + 2}.")
    need(min(cfg.tool_workers, cfg.tool_timeout, cfg.max_tool_tokens) >= 0, "--tool-workers, "
         "--tool-timeout and --max-tool-tokens must be >= 0 (0: one thread per episode; no "
         "time limit; no cut).")
    need(1 <= cfg.max_turns <= MAX_TURNS, f"--max-turns must lie in [1, {MAX_TURNS}] "
         f"(got {cfg.max_turns}).")
    need(not cfg.reward or REWARD_SPEC.fullmatch(cfg.reward) is not None, f"--reward "
         f"{cfg.reward!r} must name a Python file and a function in it: FILE.py:FUNCTION.")
    need(not cfg.reward or cfg.env in ("", *EMBEDDED_ENVS), f"--reward {cfg.reward} would not "
         f"be used: your --env {cfg.env} gives the rewards (its step returns them); drop "
         "--reward.")
    need(not (cfg.enable_thinking and cfg.chat_template == "off"), "--enable-thinking needs a "
         "chat template; drop --chat-template off.")


def validate_lora(cfg: Config) -> None:
    """--lora-*: a rank vLLM serves, alpha / r in range, known targets, no LoRA flag without it."""
    ranks = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRA ranks (max_lora_rank)
    need(cfg.lora_rank in ranks, f"--lora-rank {cfg.lora_rank}: vLLM serves LoRA ranks "
         f"{', '.join(map(str, ranks[1:]))} (0: full fine-tuning).")
    need(not cfg.lora_rank or cfg.lora_alpha > 0, f"--lora-alpha must be > 0 (got "
         f"{cfg.lora_alpha}): a layer adds (alpha / r) B A x.")
    need(not cfg.lora_rank or cfg.lora_alpha <= MAX_LORA_SCALE * cfg.lora_rank, f"--lora-alpha "
         f"{cfg.lora_alpha:g} with --lora-rank {cfg.lora_rank} scales B A by "
         f"{cfg.lora_alpha / max(cfg.lora_rank, 1):.3g}; alpha / r may be at most "
         f"{MAX_LORA_SCALE:g}.")
    targets = [t.strip() for t in cfg.lora_targets.split(",")]
    unknown = set(targets) - set(LORA_TARGETS) - {"all"}
    need(not unknown, f"--lora-targets names {', '.join(map(repr, sorted(unknown)))}: the "
         f"targets are all or a comma-separated list of {', '.join(LORA_TARGETS)}.")
    need("all" not in targets or targets == ["all"], f"--lora-targets {cfg.lora_targets}: all "
         "already names every target; give it alone, or list the targets.")
    lora_only = [flag(n) for n in ("lora_alpha", "lora_targets", "export")  # (a resume: its own)
                 if getattr(cfg, n) != Config.__dataclass_fields__[n].default]
    need(cfg.lora_rank or cfg.resume or not lora_only, f"{', '.join(lora_only)} set a LoRA "
         "run's adapters and export, and full fine-tuning has none: add --lora-rank r, or drop "
         "them.")
    need(not (cfg.lora_rank and cfg.kernels == "reference"), "--lora-rank with --kernels "
         "reference: the engine adds the adapters with vLLM's LoRA kernels, which only --kernels "
         "vllm computes as it does (drop --kernels reference).")


@contextlib.contextmanager
def hub_offline_unless_reachable(datasets, hub: dict, timeout_s: float = 3.0):
    """`datasets` in offline mode (the cache only, hub["offline"] set) when the hub's host does
    not answer within `timeout_s`: otherwise it retries 5 times over half a minute."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE
    if not offline:
        host = urlparse(constants.ENDPOINT)
        try:
            port = host.port or (80 if host.scheme == "http" else 443)  # HF_ENDPOINT may be http
            socket.create_connection((host.hostname, port), timeout_s).close()
        except OSError:  # no network, no DNS, a firewall
            offline = True
    hub["offline"] = offline
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = offline
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or \
        name.count("/") != 1


# ==========================================================================
# Model and data files: checked and read before anything slow starts
# ==========================================================================


def moe_from_hf(hf_state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Pop every sparse layer's router and experts from hf_state, as trainer tensors:
    router.gate.weight (E, dim); experts.w13 (E, 2I, dim) = [gate_proj_e; up_proj_e] per expert
    e (vLLM's w13_weight); experts.w2 (E, dim, I) = down_proj_e. HF holds them per expert
    (mlp.experts.e.{gate,up,down}_proj.weight: the hub's format) or fused as vLLM loads them
    (mlp.experts.gate_up_proj (E, 2I, dim), mlp.experts.down_proj (E, dim, I))."""
    out = {}
    for i in sparse_layers(args):
        hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.moe."
        out[ours + "router.gate.weight"] = hf_state.pop(hf + "gate.weight")
        if hf + "experts.gate_up_proj" in hf_state:
            out[ours + "experts.w13"] = hf_state.pop(hf + "experts.gate_up_proj")
            out[ours + "experts.w2"] = hf_state.pop(hf + "experts.down_proj")
            continue
        expert = [f"{hf}experts.{e}." for e in range(args.moe_args.num_experts)]
        out[ours + "experts.w13"] = torch.stack([
            torch.cat([hf_state.pop(x + "gate_proj.weight"), hf_state.pop(x + "up_proj.weight")])
            for x in expert])
        out[ours + "experts.w2"] = torch.stack([hf_state.pop(x + "down_proj.weight")
                                                for x in expert])
    return out


def moe_to_hf_items(name: str, tensor: torch.Tensor, args, fused_experts: bool):
    """A sparse layer's trainer tensor as [(HF name, tensor)]; experts fused as vLLM's loader
    takes them (`fused_experts`: one tensor per layer and kind, the push) or per expert (the hub's
    format, for files: views, which safetensors saves as they are)."""
    i = name.split(".")[1]
    hf = f"model.layers.{i}.mlp."
    if name.endswith("router.gate.weight"):
        return [(hf + "gate.weight", tensor)]
    if fused_experts:
        return [(hf + ("experts.gate_up_proj" if name.endswith("w13") else "experts.down_proj"),
                 tensor)]
    if name.endswith("w13"):
        return [(f"{hf}experts.{e}.{part}_proj.weight", w)
                for e, w13 in enumerate(tensor)
                for part, w in zip(("gate", "up"), w13.split(args.moe_inter_dim))]
    return [(f"{hf}experts.{e}.down_proj.weight", w) for e, w in enumerate(tensor)]


def resolve_checkpoint(name: str) -> Path:
    """A local directory as is; a hub id is fetched (weights, config, tokenizer) into the HF
    cache, by each host's first rank, then found in the cache by the others."""
    if looks_like_path(name):
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    local_first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    try:
        if not local_first:
            barrier()
        path = Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                           "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ConfigError(f"could not fetch {name!r} from the Hugging Face hub "
                          f"({type(e).__name__}); pass a local directory with --model.") from e
    if local_first:
        barrier()
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "qwen3_5": "Qwen3_5ForConditionalGeneration",  # with a vision tower
               "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
MIN_VOCAB = 256  # a real tokenizer: at least the 256 bytes of a byte-level BPE
MAX_POSITIONS = 2**20  # the rotary caches hold a row per position (256 MiB at head_dim 128)


def load_model_files(cfg: Config, path: Path | None = None) -> ModelFiles:
    """Path, model args, tokenizer and stop ids, after checking they fit together and the config
    (`path`: --model already resolved to a directory).

    Opens headers only; nothing here takes more than seconds.
    """
    path = path or resolve_checkpoint(cfg.model)
    hf_cfg = read_qwen3_config(path)
    args = model_args_from_hf(hf_cfg)
    need(cfg.max_model_len <= args.max_seq_len, f"--max-model-len {cfg.max_model_len} exceeds "
         f"the model's max_position_embeddings ({args.max_seq_len}).")
    check_weight_headers(path, args)
    check_lora(cfg, args)
    need(not (cfg.lora_rank and vision_note(path)), f"--lora-rank: {path} is a vision-language "
         "checkpoint, whose adapter names simple_rl does not write yet; train its text model in "
         "full, or save the text model (Qwen3_5ForCausalLM) and adapt that.")
    tokenizer = load_tokenizer(path, args)
    eos_ids = stop_token_ids(path, tokenizer, hf_cfg)
    need(bool(eos_ids) and max(eos_ids) < args.vocab_size, f"the tokenizer's eos ids {eos_ids} "
         f"do not fit the model's vocab of {args.vocab_size}.")
    return ModelFiles(path, args, tokenizer, eos_ids)


def check_lora(cfg: Config, args) -> None:
    """What --lora-* asks of this model: experts take no adapter (vLLM's MoE LoRA kernels are
    not the trainer's), and r fits within every adapted layer's input and output slices."""
    lora = lora_spec(cfg, args)
    if lora is None:
        return
    c = qwen35(args)
    gdn = [t for t in lora.targets if t in LORA_TARGETS[7:]]
    need(c or not gdn, f"--lora-targets {','.join(gdn)}: these are Qwen3.5's linear "
         f"attention's layers, which a Qwen3 has not; target {', '.join(LORA_TARGETS[:7])}.")
    mlp = set(lora.targets) & {"gate_proj", "up_proj", "down_proj"}
    need(not (sparse_layers(args) and mlp), f"--lora-targets {','.join(sorted(mlp))}: an "
         "MoE model's MLPs are its experts, which take no adapter here (vLLM's fused-MoE LoRA "
         "kernels are not the trainer's); target its attention: q_proj, k_proj, v_proj, o_proj"
         f"{', in_proj_qkv, in_proj_z, out_proj' if c else ''}.")
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    widths = dict(q_proj=(args.dim, fused_sizes(args)["attention.wqkv.weight"][0]),
                  k_proj=(args.dim, kv), v_proj=(args.dim, kv),
                  o_proj=(q, args.dim), gate_proj=(args.dim, args.hidden_dim),
                  up_proj=(args.dim, args.hidden_dim), down_proj=(args.hidden_dim, args.dim))
    if c:  # a slice's rows (in_proj_qkv: q, k, v)
        k, v = c.k_heads * c.k_dim, c.v_heads * c.v_dim
        widths |= dict(in_proj_qkv=(args.dim, min(k, v)), in_proj_z=(args.dim, v),
                       in_proj_b=(args.dim, c.v_heads), in_proj_a=(args.dim, c.v_heads),
                       out_proj=(v, args.dim))
    narrow = {t: min(widths[t]) for t in lora.targets if min(widths[t]) < lora.rank}
    need(not narrow, f"--lora-rank {lora.rank} exceeds the width of "
         f"{', '.join(f'{t} ({w})' for t, w in narrow.items())}: a rank above a layer's width "
         "adds nothing full fine-tuning would not.")


def check_weight_headers(path: Path, args) -> None:
    """Open every safetensors header and check names, shapes and dtypes against config.json.

    Reads headers only (seconds even at 8B); a truncated or garbage file fails here, before any
    slow start.
    """
    from safetensors import safe_open

    found: dict[str, tuple[tuple[int, ...], str]] = {}
    keys: dict[str, str] = {}  # text name -> the key that gave it
    twice = []  # model.x beside model.language_model.x, or a key in two files
    for name in weight_files(path):
        file = path / name
        need(file.is_file(), f"{file} is listed in the index but missing.")
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    text = text_weight_name(key)
                    if text is None:
                        continue
                    if text in keys:
                        twice.append((text, keys[text], key))
                    piece = f.get_slice(key)
                    keys[text] = key
                    found[text] = (tuple(piece.get_shape()), piece.get_dtype())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ConfigError(f"{file} is not a readable safetensors file ({e}); re-download "
                              "or re-save the checkpoint.") from e
    if twice:
        name, first, second = twice[0]
        raise ConfigError(f"{path} holds the text model's {name} twice ({first}, {second}): "
                          "which one is trained would be chance; keep one.")
    found = {k: v for k, v in found.items() if not k.endswith(ROPE_BUFFER)}
    want = expected_hf_shapes(args, fused_layers(found, args))
    if args.enable_weight_tying:
        found.pop("lm_head.weight", None)
    missing = sorted(set(want) - set(found))
    extra = sorted(set(found) - set(want))
    need(not missing, f"{path}: weights missing for config.json's model: {', '.join(missing[:4])}"
         f"{' ...' if len(missing) > 4 else ''}.")
    need(not extra, f"{path}: weights config.json's model does not have: {', '.join(extra[:4])}"
         f"{' ...' if len(extra) > 4 else ''}.")
    for key, shape in want.items():
        need(found[key][0] == shape, f"{path}: {key} has shape {list(found[key][0])}, "
             f"config.json implies {list(shape)}.")
        need(found[key][1] in ("BF16", "F16", "F32"), f"{path}: {key} is {found[key][1]}; "
             "simple_rl reads bf16, fp16 or fp32 weights.")


def weight_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index ({e}).") from e
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    need(bool(files), f"{path} has no *.safetensors weights (.bin checkpoints are not supported; "
         "re-save with safe_serialization=True).")
    return files


def fused_layers(found, args) -> set[int]:
    """The sparse layers whose experts the files hold fused (transformers 5's own format)."""
    return {i for i in sparse_layers(args) if f"model.layers.{i}.mlp.experts.gate_up_proj" in found}


def trainer_to_hf(state: dict[str, torch.Tensor], args,
                  fused: frozenset[int] = frozenset()) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_trainer: split the fused projections, then map the names (hf_key_map);
    the experts of the sparse layers in `fused` stay fused (as a checkpoint may write them),
    the others per expert (the hub's)."""
    keys = hf_key_map(args)
    return dict(item for name, t in state.items() for item in to_hf_items(
        name, t, args, keys, ".moe." in name and int(name.split(".")[1]) in fused))


def expected_hf_shapes(args, fused: set[int] = frozenset()) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight a checkpoint for `args` holds (built on the meta device);
    the sparse layers in `fused` with their experts fused, the others per expert (the hub's)."""
    with torch.device("meta"):
        model = Qwen3(args, bib.reference_kernels(), torch.float32)
    return {k: tuple(v.shape) for k, v in trainer_to_hf(model.state_dict(), args, fused).items()}


def fused_in_layer(fused: str, i: int, args) -> bool:
    """Whether layer i holds the fused projection `fused` (a FUSED key): its token mixer's
    (softmax or linear attention) and its MLP's (dense, or a sparse layer's shared expert)."""
    gdn, sparse = i in gdn_layers(args), i in sparse_layers(args)
    shared = sparse and getattr(qwen35(args), "shared_expert_dim", 0) > 0
    return {"attention.wqkv.weight": not gdn, "attention.in_proj_qkvz.weight": gdn,
            "attention.in_proj_ba.weight": gdn, "feed_forward.w13.weight": not sparse,
            "moe.shared_expert.w13.weight": shared}[fused]


def qwen35_fused_sizes(args) -> dict[str, list[int]]:
    """Row counts of the parts of Qwen3.5's fused projections (fused_sizes), {} for Qwen3."""
    c = qwen35(args)
    if c is None:
        return {}
    v = c.v_heads * c.v_dim
    return {"attention.in_proj_qkvz.weight": [2 * c.k_heads * c.k_dim + v, v],
            "attention.in_proj_ba.weight": [c.v_heads, c.v_heads],
            "moe.shared_expert.w13.weight": [c.shared_expert_dim] * 2}


# Qwen3.5's names beyond Qwen3's, for TorchTitan's key map (hf_key_map): HF -> the trainer's
# parts, which FUSED then joins. Its linear attention keeps vLLM's names, under the block's
# `attention`.
QWEN35_NAMES = {
    **{f"model.layers.{{}}.linear_attn.{n}": f"layers.{{}}.attention.{n}" for n in (
        "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
        "A_log", "dt_bias", "norm.weight", "out_proj.weight")},
    "model.layers.{}.linear_attn.conv1d.weight": "layers.{}.attention.conv1d",
    **{f"model.layers.{{}}.mlp.shared_expert.{hf}_proj.weight":
       f"layers.{{}}.moe.shared_expert.{ours}.weight"
       for hf, ours in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
    "model.layers.{}.mlp.shared_expert_gate.weight": "layers.{}.moe.shared_expert_gate.weight",
}


def text_weight_name(name: str) -> str | None:
    """A checkpoint's weight name as its text model's, or None for a weight simple_rl does not
    read. A Qwen3.5 with a vision tower (Qwen3_5ForConditionalGeneration) is trained as its
    text model, on text: model.language_model.x is read as model.x, the tower (model.visual.)
    is left out, and so is the multi-token-prediction head (mtp.), which drafts tokens for
    speculative decoding and takes no part in a token's logprob."""
    if name.startswith(("model.visual.", "mtp.")):
        return None
    prefix = "model.language_model."
    return "model." + name[len(prefix):] if name.startswith(prefix) else name


def vision_note(path: Path) -> str:
    """The sentence a vision-language checkpoint gets where its weights are read ("" else)."""
    kind = MODEL_TYPES.get(json.loads((path / "config.json").read_text()).get("model_type"), "")
    return ("; it is a vision-language model, trained (and exported) as its text model, on text: "
            "its vision tower and multi-token-prediction head are left out"
            if kind.endswith("ConditionalGeneration") else "")


LAYER_TYPES = ("linear_attention", "full_attention")  # the kinds of Qwen3.5 layer simple_rl runs


def check_qwen35_config(raw: dict, file: Path) -> None:
    """Refuse the Qwen3.5 settings the trainer does not compute as vLLM does (raw JSON of the
    text model), an unknown layer type first."""
    kinds = raw.get("layer_types")
    if kinds is not None:
        need(isinstance(kinds, list), f"{file}: layer_types {kinds!r} must be a list.")
        unknown = sorted({str(k) for k in kinds} - set(LAYER_TYPES))
        need(not unknown, f"{file}: layer_types names {', '.join(map(repr, unknown))}: simple_rl "
             f"runs Qwen3.5's {' and '.join(map(repr, LAYER_TYPES))} layers only.")
        need(len(kinds) == raw.get("num_hidden_layers"), f"{file}: layer_types has {len(kinds)} "
             f"entries for {raw.get('num_hidden_layers')!r} layers.")
    need(raw.get("attn_output_gate", True) is True and not raw.get("layer_scale")
         and raw.get("output_gate_type", "silu") in ("silu", "swish"), f"{file}: simple_rl runs "
         "Qwen3.5's gated attention, silu-gated linear attention and no layer_scale only.")
    k = raw.get("linear_num_key_heads", 16)  # transformers' defaults
    v = raw.get("linear_num_value_heads", 32)
    need(whole(k) and whole(v) and v % k == 0, f"{file}: linear_num_key_heads ({k!r}) must be "
         f"a whole number >= 1 and linear_num_value_heads ({v!r}) a multiple of it.")
    width = raw.get("linear_conv_kernel_dim", 4)
    need(whole(width, 2, 7), f"{file}: linear_conv_kernel_dim {width!r} must be a whole number "
         "from 2 to 7 (the widths vLLM's causal conv kernels run).")


def read_qwen3_config(path: Path):
    """The HF config of the text model, after checking it describes a Qwen3, Qwen3-MoE,
    Qwen3.5 or Qwen3.5-MoE this script supports (a Qwen3.5 with a vision tower: its
    text_config, see text_weight_name)."""
    from transformers import AutoConfig

    file = path / "config.json"
    need(file.is_file(), f"{path} has no config.json; --model must be a Hugging Face "
         "checkpoint directory.")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON ({e}).") from e
    need(isinstance(raw, dict), f"{file} does not hold a JSON object.")
    archs = raw.get("architectures") or []
    kind = MODEL_TYPES.get(raw.get("model_type"))
    need(kind is not None and (not archs or kind in archs),
         f"{path} holds a {raw.get('model_type')!r} model ({', '.join(archs) or 'no archs'}); "
         "simple_rl trains Qwen3, Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE (Qwen3ForCausalLM, "
         "Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, or the last two "
         "ForConditionalGeneration) only.")
    # transformers' get_text_config returns a text model's text_config too, as a plain dict
    need(kind.endswith("ConditionalGeneration") or "text_config" not in raw, f"{file}: a "
         f"{raw['model_type']!r} model has no text_config (a Qwen3.5 with a vision tower says "
         "model_type 'qwen3_5' or 'qwen3_5_moe'); remove one or the other.")
    if kind.endswith("ConditionalGeneration"):
        raw = raw.get("text_config")
        need(isinstance(raw, dict), f"{file}: a Qwen3.5 with a vision tower needs its "
             "text_config (a JSON object).")
    check_sizes(raw, file)
    if "Moe" in kind:
        check_moe_config(raw, file, shared="3_5" in kind)
    if "3_5" in kind:
        check_qwen35_config(raw, file)
    positions = raw.get("max_position_embeddings", 1)  # the model's rotary cache has this size
    need(whole(positions, 1, MAX_POSITIONS), f"{file}: "
         f"max_position_embeddings {positions!r} must be a whole number in [1, "
         f"{MAX_POSITIONS:,}] (the rotary cache holds a row per position).")
    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:
        text = " ".join(str(e).split())[:300]  # one line, however the library words it
        raise ConfigError(f"{file} is not a usable model config ({type(e).__name__}: "
                          f"{text}).") from e
    hf = hf.get_text_config()
    # Qwen3.5's multimodal rope gives text tokens one position in all its sections: 1-D rope
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default"}
    need(hf.hidden_act == "silu" and not getattr(hf, "attention_bias", False)
         and rope.get("rope_type", "default") == "default",
         f"{path}: only silu MLPs, bias-free attention and default RoPE are supported.")
    check_config_numbers(hf, file)
    return hf


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "linear_key_head_dim",
         "linear_value_head_dim")  # the experts' sizes: check_moe_config


def check_sizes(raw: dict, file: Path) -> None:
    """Every size config.json gives is a whole number >= 1 (a negative one made a traceback in
    the shape checks; transformers takes any number)."""
    for key in SIZES:
        n = raw.get(key)
        need(n is None or whole(n), f"{file}: {key} {n!r} must be a whole number >= 1.")


def finite_number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def whole(x, low: int = 1, high: float = math.inf) -> bool:
    """x is an int (not a bool, nor a float such as 2.0) in [low, high]."""
    return type(x) is int and low <= x <= high


def check_config_numbers(hf, file: Path) -> None:
    """The numbers transformers takes as given that would fail, or give NaN, only at the
    first forward, after the engine's start: RoPE's base, the norms' eps and, in a Qwen3.5,
    partial_rotary_factor, which must turn an even number of a head's dims (vLLM rotates
    int(head_dim x factor) dims, in pairs)."""
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 1e6))  # as model_args_from_hf
    need(finite_number(theta) and theta > 0, f"{file}: rope_theta {theta!r} must be a finite "
         "number > 0.")
    need(finite_number(hf.rms_norm_eps) and hf.rms_norm_eps > 0, f"{file}: rms_norm_eps "
         f"{hf.rms_norm_eps!r} must be a finite number > 0.")
    if not hf.model_type.startswith("qwen3_5"):
        return  # Qwen3 turns every dim
    f = rope.get("partial_rotary_factor", 1.0)
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    dims = int(head * f) if finite_number(f) and 0 < f <= 1 else 0
    need(dims >= 2 and dims % 2 == 0, f"{file}: partial_rotary_factor {f!r} must lie in (0, 1] "
         f"and turn an even number of a head's {head} dims (vLLM turns int(head_dim x factor) "
         "dims, in pairs).")


def check_moe_config(raw: dict, file: Path, shared: bool = False) -> None:
    """Refuse the Qwen3-MoE settings the trainer does not compute as vLLM does (raw JSON);
    Qwen3.5-MoE (`shared`) has a shared expert in every layer."""
    n = raw.get("num_experts", raw.get("num_local_experts"))
    k = raw.get("num_experts_per_tok")
    step = raw.get("decoder_sparse_step", 1)
    only = raw.get("mlp_only_layers") or []
    both = {raw[key] for key in ("num_experts", "num_local_experts") if key in raw}
    need(len(both) <= 1, f"{file}: num_experts and num_local_experts disagree ({sorted(both)}); "
         "keep one.")  # transformers reads num_local_experts, vLLM num_experts
    need(whole(n) and whole(k, 1, n), f"{file}: num_experts {n!r} and num_experts_per_tok "
         f"{k!r} must be whole numbers, 1 <= top-k <= experts.")
    need(whole(step), f"{file}: decoder_sparse_step {step!r} must be a whole number >= 1.")
    need(isinstance(only, list) and all(type(i) is int for i in only),
         f"{file}: mlp_only_layers {only!r} must be a list of layer indices.")
    inter = raw.get("moe_intermediate_size")
    need(whole(inter), f"{file}: moe_intermediate_size {inter!r} must be a whole number >= 1.")
    size = raw.get("shared_expert_intermediate_size")
    need(shared or not size, f"{file}: shared experts (shared_expert_intermediate_size) are "
         "not supported: Qwen3-MoE has none.")
    need(not shared or whole(size), f"{file}: Qwen3.5-MoE's shared_expert_intermediate_size "
         f"{size!r} must be a whole number >= 1.")
    need(type(raw.get("norm_topk_prob", False)) is bool, f"{file}: norm_topk_prob must be "
         "true or false.")


def model_args_from_hf(hf):
    """TorchTitan's Qwen3ModelArgs from an HF Qwen3Config, Qwen3MoeConfig or Qwen3.5 text
    config (Qwen3_5TextConfig, Qwen3_5MoeTextConfig).

    For Qwen3-MoE, moe_enabled / moe_inter_dim / moe_args (softmax scores, top-k, route_norm =
    norm_topk_prob, no shared expert) carry the experts, and `sparse_layers` (an attribute
    TorchTitan does not have) the layers whose MLP is sparse: TorchTitan makes every layer
    sparse, Qwen3-MoE skips mlp_only_layers and honours decoder_sparse_step; Qwen3.5-MoE's
    layers are all sparse, its top-k weights always renormalised. For Qwen3.5, `qwen35` (an
    attribute too) carries what Qwen3.5 adds (Qwen35Args).
    """
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    rope = getattr(hf, "rope_parameters", None) or {}
    moe = {}
    sparse: tuple[int, ...] = ()
    if hf.model_type in ("qwen3_moe", "qwen3_5_moe_text"):
        n = hf.num_experts
        only = set(getattr(hf, "mlp_only_layers", None) or [])
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        sparse = tuple(i for i in range(hf.num_hidden_layers) if hf.model_type != "qwen3_moe"
                       or i not in only and n > 0 and (i + 1) % step == 0)
        moe = dict(moe_enabled=bool(sparse), moe_inter_dim=hf.moe_intermediate_size,
                   moe_args=MoEArgs(num_experts=n, num_shared_experts=0,
                                    top_k=hf.num_experts_per_tok, score_func="softmax",
                                    route_norm=bool(getattr(hf, "norm_topk_prob", True)),
                                    route_scale=1.0, score_before_experts=False,
                                    load_balance_coeff=None))
    args = Qwen3ModelArgs(
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads,
        vocab_size=hf.vocab_size,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        hidden_dim=getattr(hf, "intermediate_size", 0),  # Qwen3.5-MoE: no dense MLP
        norm_eps=hf.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(hf, "rope_theta", 1e6)),
        max_seq_len=hf.max_position_embeddings,
        enable_weight_tying=bool(hf.tie_word_embeddings),
        **moe,
    )
    if sparse:
        args.sparse_layers = sparse
    if hf.model_type.startswith("qwen3_5"):
        args.qwen35 = Qwen35Args(
            layer_types=tuple(hf.layer_types), k_heads=hf.linear_num_key_heads,
            v_heads=hf.linear_num_value_heads, k_dim=hf.linear_key_head_dim,
            v_dim=hf.linear_value_head_dim, conv_kernel=hf.linear_conv_kernel_dim,
            rotary_dim=int(args.head_dim * rope.get("partial_rotary_factor", 1.0)),
            shared_expert_dim=getattr(hf, "shared_expert_intermediate_size", 0))
    return args
    # output_router_logits / router_aux_loss_coef only add a load-balancing loss in
    # transformers' training; the forward (and vLLM's) is the same, and GRPO adds no aux loss.


def load_tokenizer(path: Path, args):
    """The checkpoint's tokenizer, after checking it is a real one that fits the model."""
    from transformers import AutoTokenizer

    has_files = (path / "tokenizer.json").is_file() or \
        ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())
    need(has_files, f"{path} has no tokenizer (tokenizer.json, or vocab.json + merges.txt); copy "
         "the tokenizer files of the base model into it.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"{path} has no loadable tokenizer ({type(e).__name__}: {e}).") from e
    n = len(tokenizer)
    need(n >= MIN_VOCAB, f"the tokenizer in {path} has only {n} tokens: it is not a real "
         "tokenizer (copy the base model's tokenizer files).")
    need(n <= args.vocab_size, f"the tokenizer ({n} tokens) does not fit the model's vocab of "
         f"{args.vocab_size}.")
    need(len(tokenizer.encode("What is 2 + 3?", add_special_tokens=False)) > 0,
         f"the tokenizer in {path} encodes text to nothing.")
    return tokenizer


def stop_token_ids(path: Path, tokenizer, hf_cfg) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos and config.json's and
    generation_config.json's eos ids (Qwen3 lists both <|im_end|> and <|endoftext|>)."""
    found = [tokenizer.eos_token_id, hf_cfg.eos_token_id]
    gen = path / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            found.append(json.loads(gen.read_text()).get("eos_token_id"))
    flat = [i for x in found for i in (x if isinstance(x, list) else [x]) if isinstance(i, int)]
    return sorted(set(flat))


def tool_stop_ids(tokenizer, stops: str) -> list[int]:
    """The token id of each comma-separated --tool-stop string. vLLM runs without a tokenizer,
    so a turn ends at a token id (kept as the turn's last generated token), not at a string."""
    ids = []
    for stop in filter(None, stops.split(",")):
        got = tokenizer.encode(stop, add_special_tokens=False)
        need(len(got) == 1, f"--tool-stop {stop!r} is {len(got)} tokens of the tokenizer, not one "
             "(a turn ends at a token id: add the string to the tokenizer as one token).")
        ids += got
    return ids


A_LOG_MAX = math.log(torch.finfo(torch.float32).max)  # 88.72: exp above it overflows fp32


def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, on CPU, checked finite (A_log
    below the value whose exp overflows)."""
    from safetensors.torch import load_file

    state = {}
    for f in weight_files(path):
        try:
            state.update((text_weight_name(k), v) for k, v in load_file(path / f).items()
                         if text_weight_name(k) is not None)
        except Exception as e:
            raise ConfigError(f"{path / f} could not be read ({e}).") from e
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    need(not bad, f"{path}: {', '.join(bad[:3])} hold NaN or Inf values; training from them "
         "would be meaningless.")
    bad = [k for k, v in state.items() if k.endswith("A_log") and v.float().max() > A_LOG_MAX]
    need(not bad, f"{path}: {', '.join(bad[:3])} hold values above {A_LOG_MAX:.2f}, where "
         "exp(A_log), the decay's rate, overflows fp32 (NaN at the first step).")
    return state


def uses_chat_template(cfg: Config, tokenizer) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    need(has or cfg.chat_template != "on", "--chat-template on, but the tokenizer has no chat "
         "template.")
    return has and cfg.chat_template != "off"


def format_prompts(problems: list[Problem], tokenizer, cfg: Config) -> list[list[int]]:
    """Token ids of each prompt: the chat template's user turn, or a plain 'Q: ...\\nA:'."""
    if not problems:
        return []
    if uses_chat_template(cfg, tokenizer):
        texts = chat_texts(tokenizer, [[{"role": "user", "content": p.question}]
                                       for p in problems], cfg)
    else:
        texts = [f"Q: {p.question}\nA:" for p in problems]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def chat_texts(tokenizer, conversations: list[list[dict]], cfg: Config) -> list[str]:
    """Each conversation through the chat template, with the assistant's generation prompt."""
    try:  # a template is code: it may raise, or do what the sandbox refuses
        return tokenizer.apply_chat_template(  # one call renders every conversation
            conversations, tokenize=False, add_generation_prompt=True,
            enable_thinking=cfg.enable_thinking)
    except Exception as e:
        raise ConfigError(f"the tokenizer's chat template fails ({type(e).__name__}: "
                          f"{str(e)[:200]}); fix it, or pass --chat-template off.") from e


def heldout_arithmetic_questions() -> set[str]:
    """Every question the arithmetic task may hold out (a warm start must not train on them)."""
    return {p.question for p in arithmetic_problems(EVAL_CANDIDATES, EVAL_SEED)}


def load_task(cfg: Config, tokenizer) -> Task:
    """The problems of the whole run and the held-out ones, tokenized once; lengths checked."""
    if cfg.env == "lookup":  # its own questions (the lookup task, after the story ends)
        problems, heldout = lookup_split(cfg)
    elif cfg.task == "arithmetic":
        problems, heldout = arithmetic_split(cfg)
    else:
        source = cfg.data_files or "GSM8K"
        read = gsm8k_problems if cfg.task == "gsm8k" else jsonl_problems
        problems, heldout = split_heldout(read(cfg.data_files), cfg.eval_size, source)
    prompt_ids = format_prompts(problems, tokenizer, cfg)
    eval_ids = format_prompts(heldout, tokenizer, cfg)
    lengths = [len(p) for p in prompt_ids + eval_ids]
    need(max(lengths) + cfg.max_new_tokens <= cfg.max_model_len, f"the longest prompt has "
         f"{max(lengths)} tokens; with --max-new-tokens {cfg.max_new_tokens} it exceeds "
         f"--max-model-len {cfg.max_model_len}.")
    need(min(lengths) > 0, "a prompt encodes to no tokens.")
    return Task(problems, prompt_ids, heldout, eval_ids)


def read_rows(data_files: str, task: str) -> dict[str, list]:
    """The question and answer columns of a local jsonl or parquet file, or of GSM8K on the hub
    (data_files ''). A jsonl number is read as the text written in the file."""
    file = Path(data_files).expanduser()
    if data_files:
        need(file.is_file(), f"--data-files {data_files!r} is not a file.")
        need(file.stat().st_size > 0, f"--data-files {data_files!r} is empty.")
    if data_files and not data_files.endswith(".parquet"):
        rows = read_jsonl(file)
    else:
        rows = read_with_datasets(data_files, task)
    source = data_files or "GSM8K"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    need({"question", "answer"} <= set(columns), f"{source} has columns {columns}; "
         f"{'GSM8K rows' if task == 'gsm8k' else 'rows'} need 'question' and 'answer'.")
    need(len(rows) > 0, f"{source} has no rows.")
    out = {k: [row.get(k) for row in rows] for k in ("question", "answer")}
    bad = next(((i, q) for i, q in enumerate(out["question"])
                if not isinstance(q, str) or q.strip() == ""), None)
    if bad is not None:  # null or blank: it would be trained on as the text "None" or ""
        raise ConfigError(f"{source}: row {bad[0]} has a question that is not text "
                          f"({str(bad[1])[:60]!r}).")
    return out


def read_jsonl(file: Path) -> list[dict]:
    """The rows of a JSON-lines file (or of one JSON list of rows), every number kept as the
    text written in the file: 12345678901234567891 stays that, 4 stays "4"."""
    as_text = dict(parse_int=str, parse_float=str, parse_constant=str)  # NaN: its text too
    n = 0  # the line being read (0: the whole file)
    try:
        text = file.read_text()
        if text.lstrip().startswith("["):
            rows = json.loads(text, **as_text)
        else:
            rows = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    rows.append(json.loads(line, **as_text))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" line {n}" if n else ""
        raise ConfigError(f"--data-files {str(file)!r}{where} is not valid JSON "
                          f"({type(e).__name__}: {str(e)[:200]}).") from e
    need(isinstance(rows, list) and all(isinstance(r, dict) for r in rows),
         f"--data-files {str(file)!r}: every row must be a JSON object with 'question' and "
         "'answer'.")
    return rows


def read_with_datasets(data_files: str, task: str) -> list[dict]:
    """The rows of a local parquet file (its own column types) or of GSM8K from the hub."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(f"--task {task} needs the `datasets` package: pip install "
                          "datasets.") from e
    hub = {"offline": False}  # set when the hub's host did not answer: the cache only
    try:
        if data_files:
            rows = datasets.load_dataset("parquet", data_files=data_files, split="train")
        else:
            with hub_offline_unless_reachable(datasets, hub):  # no retries for half a minute
                rows = datasets.load_dataset("openai/gsm8k", "main", split="train")
    except Exception as e:
        if data_files:  # a local file: its content, not the network, is the problem
            cause = e
            while cause.__cause__ is not None:  # datasets wraps the parser's own error
                cause = cause.__cause__
            text = " ".join(str(cause).split())[:200]
            raise ConfigError(f"--data-files {data_files!r} is not readable as parquet "
                              f"({type(cause).__name__}: {text}).") from e
        why = ("the hub cannot be reached and it is not in the cache" if hub["offline"] else
               f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
        raise ConfigError(f"could not load GSM8K (openai/gsm8k): {why}; download it and pass "
                          "--data-files.") from e
    return rows.to_list()


def gsm8k_problems(data_files: str) -> list[Problem]:
    """GSM8K's train split: from local parquet/jsonl files, else from the hub through `datasets`.

    Each row has `question` and `answer`; the final answer follows '####'.
    """
    rows = read_rows(data_files, "gsm8k")
    source = data_files or "GSM8K"
    out = []
    for q, a in zip(rows["question"], rows["answer"]):
        need(isinstance(a, str) and "####" in a, f"{source}: an answer without "
             f"'#### <number>': {str(a)[:60]!r}.")
        out.append(Problem(f"{q} {ANSWER_FORMAT}", a.split("####")[-1].strip()))
    return out


def jsonl_problems(data_files: str) -> list[Problem]:
    """Your rows: `question` is the prompt as written, `answer` what the reward compares with
    (a number is read as the text written in the file)."""
    rows = read_rows(data_files, "jsonl")
    out = []
    for i, (q, a) in enumerate(zip(rows["question"], rows["answer"])):
        need(isinstance(a, (str, int, float)) and not isinstance(a, bool), f"{data_files}: row "
             f"{i} has no answer text or number (got {a!r}).")
        out.append(Problem(q, str(a)))
    return out


def split_heldout(problems: list[Problem], size: int, source: str):
    """(training pool, held-out problems) of a file: `size` problems chosen by a fixed shuffle
    (the same for every --seed), and every other problem whose question they do not repeat."""
    need(size < len(problems), f"{source} has {len(problems)} problems; --eval-size {size} "
         "leaves none to train on (lower it; 0: no eval).")
    g = torch.Generator().manual_seed(EVAL_SEED)
    chosen = set(torch.randperm(len(problems), generator=g)[:size].tolist())
    heldout = [p for i, p in enumerate(problems) if i in chosen]
    questions = {p.question for p in heldout}
    pool = [p for i, p in enumerate(problems) if i not in chosen and p.question not in questions]
    need(bool(pool), f"{source}: every problem repeats a held-out question; lower --eval-size.")
    return pool, heldout


def user_object(spec: str, option: str):
    """FILE.py:NAME -> (the module's NAME or None, the file's path, NAME), once the file imports."""
    import importlib.util

    file, name = spec.rsplit(":", 1)
    path = Path(file).expanduser()
    need(path.is_file(), f"{option}: {path} is not a file.")
    module_spec = importlib.util.spec_from_file_location(f"simple_rl_user_{path.stem}", path)
    need(module_spec is not None and module_spec.loader is not None, f"{option}: {path} cannot "
         "be imported as a Python module.")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # SyntaxError, ImportError, SystemExit: the user's file, not ours
        raise ConfigError(f"{option}: importing {path} failed ({type(e).__name__}: {e}).") from e
    return getattr(module, name, None), path, name


def load_reward(spec: str) -> RewardFn:
    """--reward FILE.py:FUNCTION: the user's reward(completion, answer) -> float; '' is ours.

    Checked here, before anything slow: the file imports, the function exists and takes
    (completion, answer).
    """
    if not spec:
        return reward
    import inspect

    fn, path, name = user_object(spec, "--reward")
    need(callable(fn), f"--reward: {path} has no function {name!r}.")
    try:
        inspect.signature(fn).bind("completion", "answer")
    except TypeError:
        raise ConfigError(f"--reward: {name}{inspect.signature(fn)} in {path} must take "
                          "(completion, answer).") from None
    except ValueError:  # no signature to inspect (a builtin): the first call will tell
        pass
    return fn


def check_reward(reward_fn: RewardFn, spec: str, task: Task) -> float:
    """A first call, before anything slow: an empty completion (a model may stop at once) must
    get a finite number (returned)."""
    try:
        return score(reward_fn, [""], [task.problems[0].answer]).item()
    except RewardError as e:
        raise ConfigError(f"--reward {spec}: on an empty completion it {e}.") from e


def score(reward_fn: RewardFn, texts: list[str], answers: list[str]) -> torch.Tensor:
    """reward_fn(text, answer) of every sample, (B,) fp32, outside any episode: check_reward's
    first call and the benchmarks. A training step's rewards are its episodes' (RewardEnv.step
    through env_step, with the same checks). RewardError names the first sample whose reward
    raised (SystemExit included: the reward's, not the run's end; Ctrl-C stays Ctrl-C) or is
    not a number finite in fp32."""
    out = []
    for i, (text, answer) in enumerate(zip(texts, answers)):
        with user_errors(i, text):
            value = reward_fn(text, answer)
        out.append(finite_reward(value, i, text))
    return torch.tensor(out, dtype=torch.float32)


EMBEDDED_ENVS = ("calc", "lookup")  # --env names of the envs simple_rl holds


def load_env(spec: str, reward_fn: RewardFn) -> Callable[[], Env]:
    """--env: '' (one turn, scored by reward_fn), calc, or FILE.py:NAME: a class (any callable
    of no arguments) whose objects have reset(problem) and step(completion), as Env's."""
    if not spec:
        return lambda: RewardEnv(reward_fn)
    if spec in EMBEDDED_ENVS:
        return lambda: (CalcEnv if spec == "calc" else LookupEnv)(reward_fn)
    make, path, name = user_object(spec, "--env")
    need(callable(make), f"--env: {path} has no class {name!r}.")
    return make


def check_env(make_env: Callable[[], Env], cfg: Config, task: Task,
              tokenizer) -> tuple[Env, str]:
    """Before anything slow: an env is made, has reset(problem) and step(completion), gives
    the first problem a text that fits --max-model-len and an empty completion (a model may
    stop at once) a reward or a tool message. Returns that env (its tool_stop is the default
    --tool-stop) and --check's line on it."""
    import inspect

    label = f"--env {cfg.env}" if cfg.env else f"--reward {cfg.reward}"
    try:
        env = make_env()
    except Exception as e:
        raise ConfigError(f"{label}: making an env raised {type(e).__name__}: {e}.") from e
    for method, arg in (("reset", "problem"), ("step", "completion")):
        fn = getattr(env, method, None)
        need(callable(fn), f"{label}: its env has no method {method}({arg}).")
        try:
            inspect.signature(fn).bind(arg)
        except TypeError:
            raise ConfigError(f"{label}: {method}{inspect.signature(fn)} must take "
                              f"({arg}).") from None
        except ValueError:  # no signature to inspect: the first call will tell
            pass
    try:
        first = call_once(lambda: env_reset(env, task.problems[0], 0), cfg)
        first_prompt_ids([first], tokenizer, cfg, [0])
    except (RewardError, ToolTimeout) as e:  # "reset returned 5, not text", "raised ..."
        what = str(e) if str(e).startswith("reset") else f"reset {e}"
        raise ConfigError(f"{label}: on the first training problem its {what}.") from e
    try:
        said = f"returned {shown(call_once(lambda: env_step(env, '', 0), cfg))}"
    except (RewardError, ToolTimeout) as e:
        raise ConfigError(f"{label}: on an empty completion it {e}.") from e
    except ToolError as e:
        said = f"raised ToolError ({shown(str(e))})"
    stop = getattr(env, "tool_stop", "")
    need(isinstance(stop, str), f"{label}: its tool_stop {shown(stop)} must be text: "
         "comma-separated strings, each one token.")
    return env, f"env {cfg.env}: made, reset; on an empty completion its step {said}"


def check_inputs(cfg: Config, ckpt: Path | None, expect: dict | None,
                 passed: set[str] = frozenset()):
    """Every check that needs no GPU (headers and text, seconds; the weights hashed, one read):
    a resume reads only the files its run read; then model files, tokenizer, the run's
    prompts, the reward and the env.
    Returns (files, task, reward_fn, make_env, the sha256 of the files read by name), or None
    after --check has said what it checked (a line as each check passes: check_progress)."""
    say = check_progress(cfg, ckpt) if cfg.check else lambda found: None
    model_dir = resolve_checkpoint(cfg.model)
    inputs = {name: input_files(name, getattr(cfg, name), model_dir) for name in INPUTS}
    hashed = on_rank0(lambda: check_unchanged(cfg, inputs, expect)) \
        if expect is not None or not cfg.check else {}  # --check alone records nothing
    say(None)  # config, run directory, checkpoint
    files = load_model_files(cfg, model_dir)
    if cfg.check:  # what the run refuses before vLLM starts, --check refuses too
        check_qwen35_engine(cfg, passed, files.args)
    if ckpt:  # a resume onto another model (--allow-changed-files) ends here, not after vLLM
        check_saved_shapes(ckpt, cfg, trained_shapes(cfg, files.args))
    say(files)  # model, tokenizer
    task = load_task(cfg, files.tokenizer)
    say(task)  # data
    reward_fn = load_reward(cfg.reward)
    empty = check_reward(reward_fn, cfg.reward, task)
    say(empty)  # reward
    make_env = load_env(cfg.env, reward_fn)
    env, checked = check_env(make_env, cfg, task, files.tokenizer) if cfg.env else (None, "")
    stops = cfg.tool_stop or getattr(env, "tool_stop", "")
    files = dataclasses.replace(files, tool_ids=tool_stop_ids(files.tokenizer, stops))
    if files.tool_ids:
        tool_message_ids(files.tokenizer, ["0"], cfg)  # the chat template renders a tool turn
    if cfg.check:
        say(checked)  # env, LoRA, GPU
        return None
    return files, task, reward_fn, make_env, hashed


def read_weights(cfg: Config, files: ModelFiles, engine_lends: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, checked finite, on rank 0 (it later hands out the shards; {}
    elsewhere), or on every rank for a LoRA run (each holds the whole base); none for a LoRA
    run whose engine lends its weights (vLLM's: the trainer adopts them, one copy)."""
    lora = lora_spec(cfg, files.args)
    loaded: dict = {}
    if not (lora and engine_lends):
        note = vision_note(files.path)
        print0(f"reading the weights of {files.path} (each checked finite){note}")
        read = lambda: loaded.update(state=load_hf_state_dict(files.path))  # noqa: E731
        read() if lora else on_rank0(read)
    return loaded.get("state", {})


# ==========================================================================
# Errors and exit codes
# ==========================================================================


class ConfigError(ValueError):
    """Bad user input: one sentence, exit code 2, nothing touched."""


class RunStopped(RuntimeError):
    """The run stopped on purpose or on a fault it can name: a message and an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class NonFiniteError(RuntimeError):
    """A logprob, the loss, the gradient norm or an updated weight is NaN/Inf."""

    def __init__(self, quantity: str, seqs: list[int], optimizer_step: int,
                 optimizer_steps: int):
        super().__init__(f"non-finite {quantity}")
        self.quantity = quantity
        self.seqs = seqs
        self.optimizer_step = optimizer_step  # k of --updates-per-batch (optimizer_steps)
        self.optimizer_steps = optimizer_steps
        # seqs: the packed sequences (a Qwen3.5's turns) in this rank's batch; update_with_parity
        # adds their episodes (in this rank's rollout) and those episodes' prompts (in the step)
        self.episodes: list[int] = []
        self.prompts: list[int] = []

    def applied(self) -> str:
        """What the in-memory weights already took, in words."""
        if self.quantity == "weights after the optimizer step":
            return (f"optimizer step {self.optimizer_step + 1} of {self.optimizer_steps} "
                    "produced them; nothing was saved")
        if self.optimizer_step == 0:
            return "nothing was applied"
        return (f"{self.optimizer_step} of {self.optimizer_steps} optimizer steps of this "
                "step were applied in memory, none saved")


class RewardError(RuntimeError):
    """The reward raised or returned something that is not a finite number."""

    def __init__(self, what: str, sample: int, completion: str):
        super().__init__(what)
        self.sample = sample  # index among this rank's episodes (of the step, or of the eval)
        self.completion = completion
        self.played: int | None = None  # turns played when the env failed (1: the first)
        self.where = f"sample {sample}"  # failing_together names it by its problem

    def __reduce__(self):  # sent between ranks by all_gather_objects, with its fields
        return (RewardError, (str(self), self.sample, self.completion), self.__dict__)


# Exit codes (README "Safety"): 0 done, 2 bad input, and these stops.
EXIT_NONFINITE = 3  # a NaN or Inf: nothing saved or pushed
EXIT_PARITY = 4  # --strict-parity found a differing token, or one routed elsewhere
EXIT_OOM = 5  # out of GPU memory
EXIT_DISK = 6  # the file system refused a write
EXIT_REWARD = 7  # the reward raised or returned a non-finite number
EXIT_INTERRUPTED = 130  # Ctrl-C, after saving a checkpoint
EXIT_TERMINATED = 143  # SIGTERM, after saving a checkpoint


# ==========================================================================
# Ranks: one process per GPU under torchrun, or a single process
# ==========================================================================


COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a dead or stuck rank ends the job, never hangs it


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_ranks(device_type: str) -> Ranks:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or one process without a process group.

    The process group is made before vLLM starts: vLLM's external launcher reuses it, and with
    `device_id` NCCL builds the trainer's communicator now, before vLLM's batch-invariant mode
    writes NCCL_MAX_NCHANNELS=1 (and friends) into the environment, which would throttle FSDP.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Ranks(0, 1, torch.device(device_type))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


def check_ranks(cfg: Config, world: int) -> None:
    need(world <= cfg.num_prompts, f"{world} ranks but --num-prompts {cfg.num_prompts}: every "
         "rank needs at least one prompt per step.")
    need(not (cfg.debug_parity and world > 1), "--debug-parity runs in one process; start it "
         "with python, not torchrun.")


def end_process_groups() -> None:
    """Destroy the process groups, vLLM's first. vLLM 0.34's engine destroys its own groups when
    it is collected at exit and raises (a traceback after the run's last line) if they are gone:
    its cleanup now leaves it nothing to destroy, then ours ends what remains."""
    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None:
        vllm_groups.destroy_model_parallel()
        vllm_groups.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def tell_torchrun(message: str) -> None:
    """Under torchrun, the sentence a rank ended with, in its error file: torchrun's summary
    gives it as the failure's cause (torchrun itself then exits 1, whatever the rank's code)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": message,
                                              "timestamp": int(time.time())}))


def world_size() -> int:
    """Ranks in the job: 1 without a process group."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", 0)) == 0  # torchrun sets RANK before the group exists


def print0(*args, **kw) -> None:
    """print on rank 0 only: one console for the whole job."""
    if is_main():
        print(*args, **kw, flush=True)


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place over every rank (identity in a single process)."""
    if world_size() > 1:
        dist.all_reduce(t, op=op)
    return t


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (small Python objects only)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def on_rank0(fn: Callable):
    """fn() on rank 0 only; every rank gets its result, or raises its ConfigError.

    Decisions read from disk (the config to resume, the checkpoint to use, the run directory)
    are made once, so no two ranks can disagree on them.
    """
    if world_size() == 1:
        return fn()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except ConfigError as e:
            box = [("error", str(e))]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ConfigError(value)
    return value


@contextlib.contextmanager
def failing_together(trainer: Trainer, name: Callable[[int], str]):
    """Within: if a reward or env fails on any rank (or a stop comes while its tools run, or
    they get stuck), every rank raises that RewardError (ToolsStopped, ToolsStuck) on leaving,
    so none waits in a collective. The one place a RewardError is named: name(sample), and its
    turn. Every rank must leave it (no collective inside may be skipped by a failure)."""
    failure = None
    try:
        yield
    except RewardError as e:
        e.where = name(e.sample) + (f", turn {e.played}" if e.played else "")
        failure = e
    except (ToolsStopped, ToolsStuck) as e:
        failure = e
    if world_size() > 1:  # every rank learns of a failure anywhere (one process: no sync)
        flag = torch.tensor([failure is not None], device=trainer.ranks.device).int()
        if int(all_reduce(flag, dist.ReduceOp.MAX)):
            failure = next(f for f in all_gather_objects(failure) if f is not None)
    if failure is not None:
        raise failure


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def shard_model(model: Qwen3, dtype) -> None:
    """FSDP2: every block, then the root (embeddings, final norm, head), sharded over the ranks.

    The forward sees the bf16 cast of the fp32 master (param_dtype); gradients are reduced in
    fp32, averaged over the ranks (`update` scales the loss by the world size to undo that).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    frozen = {p for p in model.parameters() if not p.requires_grad}  # a LoRA run's base
    # the adapters' forward computes with casts of its own (LoRA.refresh): gather them in fp32
    mp = MixedPrecisionPolicy(param_dtype=None if frozen else dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    # Gated DeltaNet's A_log is used in fp32, as vLLM keeps it: that layer gathers its masters
    # in fp32, and its linear layers, conv and norms cast their own, to the same bits (its
    # projections so travel at twice the bytes; a unit of A_log alone would rename it)
    fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.layers:
        if isinstance(block.attention, GatedDeltaNet):
            fully_shard(block.attention, mp_policy=fp32, ignored_params=frozen)
        fully_shard(block, mp_policy=mp, ignored_params=frozen)
    fully_shard(model, mp_policy=mp, ignored_params=frozen)


# ==========================================================================
# vLLM patches: the engine's ops routed through the trainer's kernels
# ==========================================================================


def engine_setup(cfg: Config, args, ranks: Ranks,
                 lora: LoRASpec | None) -> tuple[dict, int]:
    """What VLLMEngine takes from the plumbing, before vLLM starts: two vLLM ops routed through
    the trainer's kernels (below), a Qwen3.5's settings ("Qwen3.5 on vLLM"), the engine's sizes
    ("Memory estimate") and LoRA's slot (engine_lora_args). Returns LLM's arguments for all of
    it and the bytes a sleeping engine maps again for a push."""
    route_vllm_add_rms_norm_through_padded_rows()
    route_vllm_linear_through_cublaslt()
    qwen = qwen35(args) is not None
    if qwen:
        prepare_qwen35_engine()
    sizes, wake_bytes = engine_memory(cfg, args, ranks, lora is not None)
    parts = [sizes, engine_lora_args(lora) if lora else {},
             qwen35_engine_args(cfg, args) if qwen else {}]
    assert sum(map(len, parts)) == len(set().union(*parts)), "two parts set one argument"
    return {k: v for part in parts for k, v in part.items()}, wake_bytes



@contextlib.contextmanager
def waking():
    """An engine waking up: only young garbage collected (young_collections_only), and memory
    it cannot map back an out-of-memory error. vLLM's sleep-mode allocator maps memory with
    CUDA's driver API and raises a plain RuntimeError ("CUDA Error: out of memory") when the
    GPU has no room, e.g. another process took what the sleeping engine released; as PyTorch's
    OutOfMemoryError it stops the run with exit code 5 and names the last good checkpoint."""
    with young_collections_only():
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, torch.OutOfMemoryError) or not out_of_memory(e):
                raise
            raise torch.OutOfMemoryError(f"waking vLLM's engine: {e}") from e


def out_of_memory(e: Exception) -> bool:
    """The error says the GPU had no room, in PyTorch's, CUDA's or vLLM's words (vLLM refuses
    to start with less memory free than it asks for)."""
    said = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in said \
        or said.startswith("Free memory on device")


@contextlib.contextmanager
def young_collections_only():
    """gc.collect() collects only the young generations for the duration.

    vLLM's sleep calls gc.collect(): a full pass over every Python object the process holds
    (the trainer's, the task's), measured at 0.8 s of a 0.83 s sleep on an H200 host. The
    garbage it is there for, the rollout's, is young: collection was paused while it was made.
    vLLM 0.34's wake-up calls it too, twice a push (weights, then KV cache): a push took
    0.28-0.42 s at 1.7B against 0.05 s on vLLM 0.26, whose wake-up did not; the garbage there
    is the update's, young too.
    """
    collect = gc.collect
    gc.collect = lambda generation=2: collect(min(generation, 1))
    try:
        yield
    finally:
        gc.collect = collect


@contextlib.contextmanager
def gc_paused():
    """No garbage-collection pauses while the engine decodes.

    A rollout makes Python objects for every sample at every decode step (vLLM's scheduler and
    request outputs), so Python's collector keeps running in the middle of it, and its full
    passes walk every object made since vLLM froze its heap at engine start (the trainer's
    among them). Automatic collection resumes when the rollout ends.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def map_kv_cache(awake: bool) -> None:
    """Unmap the engine's KV cache (awake=False) or map it again, its weights untouched: vLLM's
    sleep levels offload or drop the weights too, which a LoRA run's trainer computes with.
    Its contents are forgotten (the push resets the prefix cache). The engine must have been
    started with enable_sleep_mode (its allocations then come from vLLM's CuMemAllocator)."""
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.device_allocator.cumem import create_and_map, unmap_and_release

    for data in get_mem_allocator_instance().pointer_to_data.values():
        if data.tag == "kv_cache" and data.is_asleep == awake:
            (create_and_map if awake else unmap_and_release)(data.handle)
            data.is_asleep = not awake
    if not awake:
        torch.cuda.empty_cache()


# vLLM's Qwen3 names (model.layers.3.self_attn.qkv_proj.base_layer.weight, under LoRA) ->
# the trainer's (layers.3.attention.wqkv.weight): one rule per part of the name; then Qwen3.5's
# (a vision-language engine's text model is its language_model).
VLLM_TO_TRAINER = (("language_model.", ""),
                   ("model.embed_tokens.", "tok_embeddings."), ("model.norm.", "norm."),
                   ("lm_head.", "output."), ("model.layers.", "layers."), (".base_layer", ""),
                   ("self_attn.qkv_proj", "attention.wqkv"), ("self_attn.o_proj", "attention.wo"),
                   ("self_attn.q_norm", "attention.q_norm"),
                   ("self_attn.k_norm", "attention.k_norm"),
                   ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm"),
                   ("mlp.gate_up_proj", "feed_forward.w13"), ("mlp.down_proj", "feed_forward.w2"),
                   ("mlp.gate.", "moe.router.gate."), ("experts.routed_experts.", "experts."),
                   ("mlp.experts.w13_weight", "moe.experts.w13"),
                   ("mlp.experts.w2_weight", "moe.experts.w2"),
                   ("linear_attn.conv1d.weight", "attention.conv1d"),
                   ("linear_attn.", "attention."),
                   ("mlp.shared_expert.gate_up_proj", "moe.shared_expert.w13"),
                   ("mlp.shared_expert.down_proj", "moe.shared_expert.w2"),
                   ("mlp.shared_expert_gate", "moe.shared_expert_gate"))


def trainer_name(name: str) -> str:
    for theirs, ours in VLLM_TO_TRAINER:
        name = name.replace(theirs, ours)
    return name


def route_vllm_add_rms_norm_through_padded_rows() -> None:
    """Make the engine's fused add+RMSNorm calls row-count invariant, exactly as the trainer's.

    vLLM 0.26's batch-invariant RMSNorm handed a residual add to a CUDA kernel whose reduction
    order changed at 256 rows (bib.ADD_RMS_NORM_MIN_ROWS; 0.34 launches it alike at any row
    count, so the padding now only keeps the trainer's and the engine's calls one). The engine
    runs in this process, so replacing the function its RMSNorm layers call is enough: a
    decode step of fewer than 256 sequences is padded to 256 rows.
    """
    from vllm.model_executor.layers import layernorm

    plain = layernorm.rms_norm_batch_invariant
    if getattr(plain, "padded_rows", False):
        return

    def rms_norm_rows(x, weight, eps=1e-6, residual=None):
        if residual is None or weight is None:
            return plain(x, weight, eps, residual=residual)
        bib.fused_add_rms_norm_rows(x, residual, weight, eps)
        return x, residual

    rms_norm_rows.padded_rows = True
    layernorm.rms_norm_batch_invariant = rms_norm_rows


def route_vllm_linear_through_cublaslt() -> None:
    """Run the engine's linear layers and LM head on cuBLASLt, the GEMM the trainer calls.

    In batch-invariant mode vLLM 0.34 sends every unquantized linear layer to its Triton
    persistent matmul, whose 128 x 128 tiles leave most of an H200's SMs idle at a decode
    step's few hundred rows. On Hopper that mode also turns cuBLASLt's split-K off (no
    workspace), and cuBLASLt then gives the Triton kernel's bits: tests/test_gemm_gpu.py checks
    every row count M = 1..1024 and fifteen prefill and micro-batch sizes at the shapes of the
    dense Qwen3s, Qwen3-30B-A3B and the Qwen3.5s. Elsewhere (Ampere, Blackwell, ROCm: not
    measured), for a layer with a bias (cuBLASLt would add it before rounding) and for a
    narrow one (bib.NARROW_LINEAR: a one-column GEMM's rows on cuBLASLt differed at some row
    counts; the trainer keeps it there too) vLLM's own path stays.
    """
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers import vocab_parallel_embedding as vocab
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda() and torch.cuda.get_device_capability()[0] == 9):
        return
    for method in (linear.UnquantizedLinearMethod, vocab.UnquantizedEmbeddingMethod):
        plain = method.apply
        if getattr(plain, "cublaslt", False):
            continue

        def apply(self, layer, x, bias=None, _plain=plain):
            # narrow by the whole layer's width, as the trainer sees it (a TP rank holds a shard)
            narrow = getattr(layer, "output_size", len(layer.weight)) < bib.NARROW_LINEAR
            if bias is not None or not x.is_cuda or narrow:
                return _plain(self, layer, x, bias)
            return nn.functional.linear(x, layer.weight)

        apply.cublaslt = True
        method.apply = apply


# ==========================================================================
# Qwen3.5 on vLLM: a schedule the trainer replays
# ==========================================================================
# vLLM runs a Gated DeltaNet layer's prompt tokens through fla's chunked rule (its prefill) and
# each generated token through a recurrent kernel (a decode step): two forms of one rule that
# round differently. The trainer replays that split, sample by sample (bib's gated delta rule:
# the prompt chunked from a zero state, then the completion token by token from the prompt's
# fp32 state), which is exactly what vLLM computed when each prompt was prefilled in one pass
# and each generated token decoded once. These settings make it so; a preemption (a request
# prefilled again, prompt and generated tokens together) is refused after each generate. In an
# episode of several turns vLLM prefills each turn's whole request again, so the trainer takes
# each turn as a sequence of its own (pack_rollout, in the story's "Episodes").
# Measured on an H200 (results/h200_qwen35_parity/): 0 of 131,072 generated tokens differ at
# Qwen3.5-0.8B's layer shapes, eager and with CUDA graphs, across a push.
QWEN35_ENGINE_ARGS = dict(
    gdn_prefill_backend="triton",  # fla's chunked rule (on Hopper the default is FlashInfer's)
    mamba_ssm_cache_dtype="float32",  # the state between decode steps: fp32, stored exactly
    mamba_cache_dtype="auto",  # the conv state: the raw bf16 inputs, exact
    enable_chunked_prefill=False,  # a prompt is prefilled whole (the budget fits the longest;
    # a Qwen3.5-MoE's chunked prefill splits none either: qwen35_engine_args)
    language_model_only=True,  # a checkpoint with a vision tower: its text model alone
)
# (No prefix caching either: a cached prefix would resume from a saved state, another split;
# VLLMEngine turns it off, and an explicit --prefix-caching is refused. A Qwen3.5-MoE's is on
# and never read: qwen35_engine_args.)
PACKED_DECODE = "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE"  # "1": a second decode kernel
# fla's gated RMSNorm (the linear attention's output norm) blocks 1 to 4 rows together as a
# call grows; pinned to one row, every row count reduces alike (engine and trainer, one process)
GDN_NORM_ROWS_PER_BLOCK = 1


def qwen35_engine_args(cfg: Config, args) -> dict:
    """QWEN35_ENGINE_ARGS, and for a Qwen3.5-MoE a prefix cache kept on and never read
    (VLLMEngine.sampling_params): vLLM 0.34 returns a token's experts only with it
    (config/vllm.py:1116). That cache needs chunked prefill (models/config.py:1105) and ends a
    prefill chunk where a block ends, to save the linear attention's state there
    (v1/core/sched/scheduler.py:563-678). A block of --max-model-len tokens or more
    (`hybrid_block_tokens`), and a step that holds one (batched_tokens), keep every prompt
    prefilled whole and a sequence in one block, which never fills: nothing is ever cached."""
    if not sparse_layers(args):
        return QWEN35_ENGINE_ARGS
    return dict(QWEN35_ENGINE_ARGS, enable_chunked_prefill=True,
                block_size=hybrid_block_tokens(args, cfg.max_model_len))


def prepare_qwen35_engine() -> None:
    """In the engine's process, before its Qwen3.5 is built: let vLLM run Gated DeltaNet in
    batch-invariant mode (its backend declines by default: the two forms above), send every
    decode token through the one recurrent kernel the trainer replays, pin the gated norm's
    rows per block and the prefill's launch configs (bib.pin_vllm_prefill: no machine's Triton
    cache picks another) (the engine reads no prefix cache: VLLMEngine)."""
    from vllm.models.qwen3_5.nvidia.ops import fused_gdn_gated_norm
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    need(os.environ.get(PACKED_DECODE, "0") == "0", f"{PACKED_DECODE}="
         f"{os.environ.get(PACKED_DECODE)} gives a Qwen3.5's decode steps a kernel the trainer "
         f"does not replay; unset it or set {PACKED_DECODE}=0.")
    os.environ[PACKED_DECODE] = "0"
    GDNAttentionBackend.supports_batch_invariance = classmethod(lambda cls: True)
    fused_gdn_gated_norm.calc_rows_per_block = lambda n_rows, device: GDN_NORM_ROWS_PER_BLOCK
    bib.pin_vllm_prefill()


def check_qwen35_engine(cfg: Config, passed: set[str], args) -> None:
    """What a Qwen3.5 on vLLM cannot do yet, refused before vLLM starts (nothing for others);
    its fla kernels pinned (bib.pin_fla)."""
    import importlib.util

    if qwen35(args) is None:
        return
    need(not (cfg.prefix_caching and "prefix_caching" in passed), "--prefix-caching: a "
         "Qwen3.5 reads no prefix cache (a cached prefix resumes its linear "
         "attention from a saved state, a split the trainer does not replay); drop the flag.")
    need(not cfg.debug_parity, "--debug-parity: the op-by-op debugger does not follow a "
         "Qwen3.5's schedule (a prompt prefilled whole, then a step a token) yet; drop the flag "
         "(every step's parity check still compares every token).")
    if not cfg.check and cfg.kernels != "reference":  # fla: --check asks no GPU question
        need(importlib.util.find_spec("fla") is not None, "a Qwen3.5's linear attention takes "
             "its backward from flash-linear-attention's kernels: pip install "
             "flash-linear-attention==0.6.0")
        bib.pin_fla()  # fla's switches are read at its import: set before vLLM starts


def preemption_counter(llm) -> Callable[[], int]:
    """A function that says how many requests vLLM's scheduler (in this process) preempted
    since it was last called: its preemption method, wrapped once to count."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempt = scheduler._preempt_request
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return preempt(*args, **kwargs)

    def since_last() -> int:
        n, count[0] = count[0], 0
        return n

    scheduler._preempt_request = counted
    return since_last


def check_no_preemption(n: int) -> None:
    if n:
        raise RuntimeError(f"vLLM preempted {n} request(s) of this generate (its KV cache ran "
                           "out) and prefilled them again, which a Qwen3.5's trainer does not "
                           "replay bit for bit: give it more KV cache (--kv-cache-gib) or fewer "
                           "samples a step.")


def engine_names(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]):
    """The push's HF names as the engine's model loads them: vLLM's Qwen3.5 with a vision tower
    (Qwen3_5ForConditionalGeneration) holds its text model as the hub does, under
    model.language_model. (its lm_head keeps its name); any other model takes them as they are."""
    if not hasattr(model, "language_model"):
        return weights
    prefix = "model.language_model."
    return ((prefix + n[len("model."):] if n.startswith("model.") else n, t) for n, t in weights)


# ==========================================================================
# LoRA plumbing: the engine's adapter slot, names, the initial adapter
# ==========================================================================


class BasePolicy:
    """The KL reference of a LoRA run: the policy with its adapters off, i.e. the frozen base
    (no second model). Called like a Qwen3, under no_grad."""

    def __init__(self, model: Qwen3):
        self.model = model

    def __call__(self, batch: Packed, temperature: float):
        adapters = lora_modules(self.model)
        for m in adapters:
            m.enabled = False
        try:
            return self.model(batch, temperature)
        finally:
            for m in adapters:
                m.enabled = True


def lora_models(cfg: Config, args, hf_state: dict, ops: bib.Kernels, ranks: Ranks,
                engine: Engine | None, lora: LoRASpec) -> tuple[Qwen3, BasePolicy | None]:
    """build_models under LoRA. The base is the engine's own weights where it lends them
    (Engine.base_weights: one copy on the GPU), else hf_state's (every rank's); the adapters
    start as PEFT's (lora_init: A random, B = 0) and their casts are bound to the engine's
    adapter slot (bind_lora); the KL reference is the policy with its adapters off."""
    lent = engine.base_weights(args) if engine else None
    state = lent if lent is not None else hf_to_trainer(hf_state, args) if hf_state else {}
    state = {**state, **lora_init(args, lora, cfg.seed)}  # the adapters' fp32 masters
    model = build_model(args, state, ops, DTYPES[cfg.dtype], ranks.device, ranks.world, lora)
    if engine and engine.lora_tensors is not None:  # bind_lora names a missing slot
        bind_lora(model, engine.lora_tensors)
    return model, BasePolicy(model) if cfg.kl_coef else None


def start_adapter(engine: VLLMEngine, files: ModelFiles):
    """Load an all-zero adapter into the engine's one slot (a 1-token request activates it)
    and collect the slot's tensors by layer (`lora_tensors`); the trainer then binds its
    casts to them and writes its adapter there, and no later request reloads the file."""
    import tempfile

    from vllm import TokensPrompt
    from vllm.lora.request import LoRARequest

    engine.adapter_dir = tempfile.TemporaryDirectory(prefix="simple_rl_adapter_")
    dtype = DTYPES[engine.cfg.dtype]
    with torch.device("meta"):
        shapes = Qwen3(files.args, bib.reference_kernels(), dtype)
        add_lora(shapes, engine.lora)
    zeros = {f"{name}.lora_{ab}.weight": torch.zeros(shape, dtype=dtype)
             for name, m, slices in adapter_slices(shapes) for ab, shape in (
                 ("A", m.slice_a()[slices[0]].shape),
                 ("B", (sum(m.b[s].shape[0] for s in slices), m.b[slices[0]].shape[1])))}
    save_peft_adapter(Path(engine.adapter_dir.name), zeros, engine.lora, files.path)
    request = LoRARequest("simple_rl", 1, engine.adapter_dir.name)
    engine.llm.generate([TokensPrompt(prompt_token_ids=[0])],
                        engine.sampling_params(0, n=1, max_tokens=1), lora_request=request,
                        use_tqdm=False)
    engine.lora_tensors = engine.llm.apply_model(lambda m: {
        name: (mod.lora_a_stacked, mod.lora_b_stacked) for name, mod in m.named_modules()
        if hasattr(mod, "lora_a_stacked")})[0]
    engine.adapter_ptrs = frozenset(t.data_ptr() for a, b in engine.lora_tensors.values()
                                    for t in a + b)
    return request


def engine_weights(llm, args, dtype) -> dict[str, torch.Tensor]:
    """The engine's own weights (no copy) under the trainer's names, checked finite."""
    params = llm.apply_model(lambda m: dict(m.named_parameters()))[0]
    with torch.device("meta"):
        want = Qwen3(args, bib.reference_kernels(), dtype).state_dict()
    out = {k: v for k, v in ((trainer_name(k), v) for k, v in params.items()) if k in want}
    for k in ("tok_embeddings.weight", "output.weight"):  # vLLM pads its vocab rows
        if k in out:
            out[k] = out[k][:args.vocab_size]
    bad = [k for k, v in out.items() if not torch.isfinite(v).all()]
    need(not bad, f"{', '.join(bad[:3])} hold NaN or Inf values; training from them would "
         "be meaningless.")
    return out


def adapter_weights(model: Qwen3) -> list[tuple[str, torch.Tensor]]:
    """Refresh the casts (the engine's slot: `bind_lora`), then (PEFT name, cast) of every
    targeted slice: A_s (1, 1, r, K) as `...q_proj.lora_A.weight`, B'_s = scale B_s
    (1, 1, n_s, r) as `...lora_B.weight`."""
    for m in lora_modules(model):
        m.refresh()
    out = []
    for name, m, slices in adapter_slices(model):
        out.append((f"{name}.lora_A.weight", m.casts[0][slices[0]]))  # a shared A: one a slice
        b = [m.casts[1][s] for s in slices]
        out.append((f"{name}.lora_B.weight", b[0] if len(b) == 1 else torch.cat(b, dim=-2)))
    return out


def lora_slice_sizes(args) -> dict[str, list[int]]:
    """Rows of each output slice of vLLM's LoRA layer, by the trainer's layer (LORA_LAYERS)."""
    fused = fused_sizes(args)
    sizes = {"attention.wqkv": fused["attention.wqkv.weight"], "attention.wo": [args.dim],
             "feed_forward.w13": fused["feed_forward.w13.weight"], "feed_forward.w2": [args.dim]}
    c = qwen35(args)
    if c:
        k, v = c.k_heads * c.k_dim, c.v_heads * c.v_dim
        sizes |= {"attention.in_proj_qkvz": [k, k, v, v], "attention.in_proj_ba": [c.v_heads] * 2,
                  "attention.out_proj": [args.dim]}
    return sizes


def lora_spec(cfg: Config, args) -> LoRASpec | None:
    """--lora-*: None for full fine-tuning. `all`: attention's, the MLP's but in an MoE (its
    experts take none), and Qwen3.5's linear attention's but in_proj_b and in_proj_a (one gate
    a head: narrower than most ranks; name them to adapt them)."""
    if not cfg.lora_rank:
        return None
    every = (LORA_TARGETS[:4] + (() if sparse_layers(args) else LORA_TARGETS[4:7])
             + (LORA_TARGETS[7:10] if qwen35(args) else ()))
    targets = every if cfg.lora_targets.strip() == "all" else named_targets(cfg.lora_targets)
    return LoRASpec(cfg.lora_rank, cfg.lora_alpha, targets)


def named_targets(text: str) -> tuple[str, ...]:
    """--lora-targets as the set it names, in LORA_TARGETS' order ('v_proj, q_proj,q_proj' is
    q_proj,v_proj; `all`, which validate takes only alone, is Qwen3's seven here: a resume
    compares with it, and lora_spec reads `all` by the model)."""
    names = {t.strip() for t in text.split(",")}
    return tuple(t for t in LORA_TARGETS if t in names or "all" in names and t in
                 LORA_TARGETS[:7])


def engine_lora_args(lora: LoRASpec) -> dict:
    """vLLM's LoRA arguments: one adapter slot (max_loras 1) on the layers of --lora-targets."""
    layers = {LORA_LAYERS[p][0].split(".")[1] for p, (_, names) in LORA_LAYERS.items()
              if set(names) & set(lora.targets)}
    return dict(enable_lora=True, max_lora_rank=lora.rank, max_loras=1,
                lora_target_modules=sorted(layers))


def vllm_lora_layer(name: str) -> str:
    """The trainer's LoRA module `layers.3.attention.wqkv.lora` -> vLLM's LoRA layer
    `model.layers.3.self_attn.qkv_proj`."""
    i, path = name.removeprefix("layers.").split(".", 1)
    return f"model.layers.{i}.{LORA_LAYERS[path.removesuffix('.lora')][0]}"


def bind_lora(model: Qwen3, slots: dict[str, tuple]) -> None:
    """Make every adapter's casts the engine's own slot tensors of the same layer (vLLM's
    lora_a_stacked, lora_b_stacked): a refresh then writes the engine's adapter in place (the
    push moves no byte), and the trainer's forward reads what the engine reads."""
    layers = {vllm_lora_layer(n): m for n, m in model.named_modules() if isinstance(m, LoRA)}
    missing = sorted(set(layers) - set(slots))
    need(not missing, f"vLLM's model has no LoRA layer {missing[0] if missing else ''} (nor "
         f"{len(missing) - 1} more the trainer binds): this vLLM lays the model's projections "
         "out otherwise; use the vLLM of requirements.txt.")
    for name, m in layers.items():
        a, b = slots[name]
        want = [(1, 1, *p.shape) for p in (*m.slice_a(), *m.b)]
        assert [tuple(t.shape) for t in (*a, *b)] == want, f"{name}: vLLM's LoRA slot"
        m.casts = (tuple(a), tuple(b))


def lora_init(args, lora: LoRASpec, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's initial adapters of a model of `args` under `lora`: A_s ~ U(-1/sqrt(K),
    1/sqrt(K)) (kaiming_uniform with a = sqrt(5)), B_s = 0, so the policy starts as the base;
    untargeted slices all 0. Drawn on the CPU from `seed`, the same on every rank."""
    with torch.device("meta"):  # only the adapters' shapes
        model = Qwen3(args, bib.reference_kernels(), torch.float32)
        add_lora(model, lora)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRA):
            for i, a in enumerate(m.a):  # a group's A: its first slice's name says if targeted
                u = (torch.rand(a.shape, generator=g) * 2 - 1) / math.sqrt(a.shape[1])
                out[f"{name}.a.{i}"] = u if m.names[m.groups.index(i)] else torch.zeros(a.shape)
            out |= {f"{name}.b.{s}": torch.zeros(b.shape) for s, b in enumerate(m.b)}
    return out


def check_in_slot(engine, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """A LoRA push's tensors are the engine's adapter slot. bind_lora binds a layer's A and B
    casts at once, so an A that is the engine's tensor says its B are too (a B of several
    slices, PEFT's in_proj_qkv, is their concatenation)."""
    for name, t in weights:
        assert "lora_B" in name or t.data_ptr() in engine.adapter_ptrs, \
            f"{name} is not the engine's tensor"


def lora_modules(model: nn.Module) -> list[LoRA]:
    return [m for m in model.modules() if isinstance(m, LoRA)]


def adapter_slices(model: Qwen3) -> Iterator[tuple[str, LoRA, list[int]]]:
    """(PEFT module name, its LoRA, its slices) of every targeted module:
    `model.layers.3.self_attn.q_proj`, the wqkv adapter, [0]; Qwen3.5's
    `model.layers.0.linear_attn.in_proj_qkv`, the in_proj_qkvz adapter, [0, 1, 2]."""
    for name, m in model.named_modules():
        if isinstance(m, LoRA):
            prefix = vllm_lora_layer(name).rsplit(".", 1)[0]  # model.layers.3.self_attn
            for peft in dict.fromkeys(n for n in m.names if n):
                yield f"{prefix}.{peft}", m, [s for s, n in enumerate(m.names) if n == peft]


# ==========================================================================
# Tools: one turn's env calls in parallel, under a timeout; their text checked
# ==========================================================================
# A turn's env calls run on daemon threads (a call that never returns cannot keep the process
# alive) and come back in call order, so no bit depends on which call finished first. A call
# past --tool-timeout is abandoned: its episode ends as tool_timeout, and ToolAbandoned is
# raised in its thread, which ends a call running Python at once (a loop, say) and one blocked
# in C (a sleep, a socket) when it returns. A call that catches it keeps its thread: while
# some do, the step line counts them (they share the interpreter with the run, so steps slow
# down), and at MAX_ABANDONED_THREADS the run stops, exit 7 (ToolsStuck). A Ctrl-C or SIGTERM
# abandons the calls at once: the step is dropped and the steps done are saved (ToolsStopped),
# so a hung tool never holds a stop back. Without --env, --reward's calls run in the main
# thread as ever (a reward may time itself with signal.alarm, which works there only); there a
# Ctrl-C, SIGTERM or --tool-timeout (a timer's TIMER_SIGNAL) raises CallInterrupted into it.

MAX_ABANDONED_THREADS = 32  # tool threads still alive past --tool-timeout that a run tolerates
TIMER_SIGNAL = signal.SIGUSR2  # --tool-timeout's alarm for a --reward call in the main thread
ABANDONED: list[threading.Thread] = []  # the threads of the calls abandoned so far


class ToolTimeout(Exception):
    """An env's step or reset (or a --reward call) ran past --tool-timeout."""


class ToolsStopped(Exception):
    """A Ctrl-C or SIGTERM came while the env's calls ran: the step is dropped."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class ToolsStuck(Exception):
    """MAX_ABANDONED_THREADS calls past --tool-timeout still run (or no thread can start)."""


class ToolAbandoned(BaseException):
    """Raised in the thread of a call past --tool-timeout (a BaseException: `except Exception`
    in an env lets it through)."""


class CallInterrupted(BaseException):
    """Raised into a --reward call running in the main thread by a signal: SIGINT or SIGTERM
    (StopRequest), or TIMER_SIGNAL at --tool-timeout."""

    running = False  # a --reward call runs in the main thread now: a signal may interrupt it

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @staticmethod
    def raise_in_call(signum: int, frame=None) -> None:
        """A signal handler's part: raise into the running --reward call, if one runs."""
        if CallInterrupted.running:
            CallInterrupted.running = False
            raise CallInterrupted(signum)


def call_tools(calls: list[Callable], cfg: Config) -> list[Called]:
    """Each call's Called (its result, or the exception it raised, or a ToolTimeout), in call
    order, run on --tool-workers threads (0: one per call). ToolsStopped on a stop request,
    ToolsStuck once MAX_ABANDONED_THREADS abandoned calls still run. Without --env the calls
    are --reward's, made in this thread (inline_calls)."""
    if not cfg.env:
        return inline_calls(calls, cfg.tool_timeout)
    stuck = abandoned_threads()
    if stuck >= MAX_ABANDONED_THREADS:
        raise ToolsStuck(f"has {stuck} calls still running past --tool-timeout "
                         f"{cfg.tool_timeout:g}s, abandoned but not ended (the run stops at "
                         f"{MAX_ABANDONED_THREADS})")
    n = len(calls)
    results: list[Called | None] = [None] * n  # written by this thread only
    started: list[float] = [0.0] * n
    running: list[threading.Thread | None] = [None] * n  # the thread in call i
    todo, done = queue.SimpleQueue(), queue.SimpleQueue()  # C queues: no Python frame inside
    for i in range(n):
        todo.put(i)
    gate = threading.Lock()  # held while a call is abandoned, and while one hands over
    pid = os.getpid()

    def worker() -> None:
        me = threading.current_thread()
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                started[i], running[i] = time.perf_counter(), me
                value = error = None
                try:
                    value = calls[i]()
                except BaseException as e:  # the caller raises it in the main thread, in order
                    error = e
                forked_off(pid, error)
                with gate:  # after this, no ToolAbandoned is sent for call i
                    running[i] = None
                    abandoned = results[i] is not None  # (only abandon_late has written it)
                done.put((i, Called(value, error, time.perf_counter() - started[i])))
                if abandoned:  # another thread took this one's place
                    return
        except ToolAbandoned:  # sent while the call ran: it lands by the gate's end at latest
            return

    for _ in range(min(cfg.tool_workers or n, n)):
        spawn(worker, cfg)
    left = n
    while left:
        if StopRequest.asked():
            raise ToolsStopped(StopRequest.asked())
        for i, called in finished(done, next_late(running, started, cfg.tool_timeout)):
            if results[i] is None:
                results[i], left = called, left - 1
        for _ in range(abandon_late(running, started, results, cfg.tool_timeout, gate)):
            left -= 1
            spawn(worker, cfg)  # its thread is stuck in the call: another takes the calls left
    return results


def forked_off(pid: int, error: BaseException | None) -> None:
    """In a child that a tool forked and that came back from the call (instead of exiting): exit
    now, as its call ended (0, or 1 if it raised). Left to go on, a child forked on a tool's
    thread would end that thread, its only one, and CPython aborts such a child with a "Fatal
    Python error" dump on the run's stderr; forked by a --reward call, it would go on training."""
    if os.getpid() != pid:
        os._exit(0 if error is None else 1)


def spawn(worker: Callable, cfg: Config) -> None:
    try:
        threading.Thread(target=worker, daemon=True, name="simple_rl-tool").start()
    except RuntimeError as e:  # "can't start new thread": the OS refused one
        raise ToolsStuck(f"could get no thread for its calls ({e}), with "
                         f"{abandoned_threads()} abandoned ones still running past "
                         f"--tool-timeout {cfg.tool_timeout:g}s") from None


def next_late(running: list, started: list, timeout: float) -> float:
    """Seconds until a running call runs past `timeout` (0: never), at most STOP_POLL_S."""
    now = time.perf_counter()
    due = [started[i] + timeout - now for i, thread in enumerate(running) if thread is not None]
    return min([STOP_POLL_S, *due] if timeout else [STOP_POLL_S])


def finished(done: queue.SimpleQueue, wait: float) -> list[tuple[int, Called]]:
    """The calls that came back: those waiting, or the first within `wait` seconds."""
    try:
        got = [done.get(timeout=max(wait, 0.001))]
    except queue.Empty:
        return []
    while not done.empty():
        got.append(done.get_nowait())
    return got


def abandon_late(running: list, started: list, results: list, timeout: float,
                 gate: threading.Lock) -> int:
    """How many calls were abandoned now, having run `timeout` seconds (0: none ever is):
    each gets its ToolTimeout result, and ToolAbandoned raised in its thread, which ABANDONED
    counts while it lives."""
    import ctypes

    now, late = time.perf_counter(), 0
    with gate:
        for i, thread in enumerate(running):
            if timeout and thread is not None and results[i] is None and \
                    now - started[i] >= timeout:
                results[i] = Called(None, ToolTimeout(f"ran past --tool-timeout {timeout:g}s"),
                                    now - started[i])
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(ToolAbandoned))
                ABANDONED.append(thread)
                late += 1
    return late


def abandoned_threads() -> int:
    """The abandoned calls' threads still alive (those that ended are forgotten)."""
    ABANDONED[:] = [t for t in ABANDONED if t.is_alive()]
    return len(ABANDONED)


def call_once(fn: Callable, cfg: Config):
    """fn() as call_tools runs it, under --tool-timeout: its result, or what it raised."""
    [called] = call_tools([fn], cfg)
    if called.error is not None:
        raise called.error
    return called.value


def inline_calls(calls: list[Callable], timeout: float) -> list[Called]:
    """--reward's calls in this thread, as call_tools reports them. In the main thread a
    Ctrl-C or SIGTERM (StopRequest) ends the call it lands in (ToolsStopped: the step is
    dropped; one landing between calls lets the step finish, as before), and past `timeout`
    seconds (0: never) TIMER_SIGNAL does, as a ToolTimeout; a reward's own signal.alarm works
    as before. Elsewhere (a benchmark's thread) the calls just run."""
    if threading.current_thread() is not threading.main_thread():
        return [inline(call) for call in calls]
    previous = signal.signal(TIMER_SIGNAL, CallInterrupted.raise_in_call)
    try:
        return [inline(call, timeout) for call in calls]
    finally:
        signal.signal(TIMER_SIGNAL, previous)


def inline(call: Callable, timeout: float = 0.0) -> Called:
    """call() in this thread, as call_tools reports it (its result or exception, seconds);
    with a timeout, a timer sends TIMER_SIGNAL to the main thread at `timeout` seconds."""
    timer = threading.Timer(timeout, signal.pthread_kill,
                            (threading.main_thread().ident, TIMER_SIGNAL)) if timeout else None
    t0, pid = time.perf_counter(), os.getpid()
    value = error = None
    try:
        if timer:
            timer.start()
        CallInterrupted.running = True
        value = call()
        CallInterrupted.running = False
    except CallInterrupted as e:
        CallInterrupted.running = False
        if e.signum != TIMER_SIGNAL:
            raise ToolsStopped(e.signum) from None
        error = ToolTimeout(f"ran past --tool-timeout {timeout:g}s")
    except Exception as e:  # RewardError, ToolError: raised again in episode order
        error = e
    finally:
        if timer:
            timer.cancel()
            timer.join()  # its signal, if it was sent, is handled while the handler is ours
    forked_off(pid, error)
    return Called(value, error, time.perf_counter() - t0)


STOP_POLL_S = 0.05  # how often a wait on the tools looks for a stop request or a late call


def reset_all(envs: list[Env], problems: list[Problem], m: int,
              cfg: Config) -> tuple[list[str], set[int]]:
    """Every env reset (m per problem, in parallel): each episode's first message, and the
    episodes whose reset ran past --tool-timeout (they get their group's message, or the
    problem's question, and end at once). RewardError names the first bad episode."""
    called = call_tools([lambda i=i, env=env: env_reset(env, problems[i // m], i)
                         for i, env in enumerate(envs)], cfg)
    late = {i for i, c in enumerate(called) if isinstance(c.error, ToolTimeout)}
    messages = []
    for i, c in enumerate(called):
        if c.error is not None and i not in late:
            raise c.error
        group = [g.value for g in called[i - i % m:i - i % m + m] if g.error is None]
        messages.append(c.value if i not in late else group[0] if group else
                        problems[i // m].question)
        if group and messages[-1] != group[0]:  # a prompt's m samples share its prefill
            raise RewardError("reset gave the episodes of one problem different first "
                              "messages", i, messages[-1])
    return messages, late


TURN_MARK = "SIMPLE_RL_TURN_MARK"
TOOL_MARK = "SIMPLE_RL_TOOL_MARK"
CHARS_PER_TOKEN = 64  # a message is cut at this many characters per token of its bound


def tool_message_ids(tokenizer, messages: list[str], cfg: Config) -> list[list[int]]:
    """The ids appended after a turn for each tool message. With a chat template: what it
    renders after an assistant turn's content (that turn's end, the tool's turn, the next
    assistant turn's generation prompt), found after a marker, so only the new part; without
    one, the message's text as is.

    A tool's text is text, never control: a message holding a special token's string, or
    longer than its bound (--max-tool-tokens, else --max-model-len), is encoded apart from
    the template around it, with special-token strings split into plain tokens, and cut at
    the bound (its characters first, so a 10 MB message is never tokenized whole). Any other
    message is encoded with its template, as it always was."""
    if not messages:
        return []
    before, after = tool_turn_parts(tokenizer, cfg)
    bound = cfg.max_tool_tokens or cfg.max_model_len
    specials = special_strings(tokenizer)
    plain = [k for k, m in enumerate(messages)
             if len(m) <= CHARS_PER_TOKEN * bound and not any(s in m for s in specials)]
    texts = [messages[k] for k in plain]
    if uses_chat_template(cfg, tokenizer) and texts:  # the template's rendering of each one
        turns = [[{"role": "user", "content": ""}, {"role": "assistant", "content": TURN_MARK},
                  {"role": "tool", "content": m}] for m in texts]
        texts = [t.split(TURN_MARK, 1)[1] for t in chat_texts(tokenizer, turns, cfg)]
    ids: list = [None] * len(messages)
    for k, got in zip(plain, tokenizer(texts, add_special_tokens=False)["input_ids"]
                      if texts else []):
        ids[k] = got
    around = [tokenizer(part, add_special_tokens=False)["input_ids"] for part in (before, after)]
    for k, m in enumerate(messages):
        if ids[k] is None or len(ids[k]) > bound + len(around[0]) + len(around[1]):
            text = m[:CHARS_PER_TOKEN * bound]
            own = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
            ids[k] = around[0] + own["input_ids"][:bound] + around[1]
    return ids


def special_strings(tokenizer) -> list[str]:
    """The text of every special token (<|im_end|>, <|endoftext|>): what an env's text must not
    turn into."""
    return [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if t.special]


def tool_turn_parts(tokenizer, cfg: Config) -> tuple[str, str]:
    """The text the chat template renders after an assistant turn's content and before a tool
    message's (its turn's end, the tool turn's start), and after that message (the tool
    turn's end, the next generation prompt); ('', '') without a template."""
    if not uses_chat_template(cfg, tokenizer):
        return "", ""
    turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": TURN_MARK},
            {"role": "tool", "content": TOOL_MARK}]
    text = chat_texts(tokenizer, [turn], cfg)[0]
    need(text.count(TURN_MARK) == 1 and text.count(TOOL_MARK) == 1, "the chat template does "
         "not render an assistant turn's content and a tool message as they are, so a tool "
         "message cannot be appended to an episode's ids; pass --chat-template off.")
    before, after = text.split(TURN_MARK, 1)[1].split(TOOL_MARK)
    return before, after


def first_prompt_ids(messages: list[str], tokenizer, cfg: Config,
                     samples: list[int]) -> list[list[int]]:
    """Each reset's own first message as the task's prompts are (format_prompts), its text
    kept text: special-token strings in it are split into plain tokens. RewardError on a
    message with no room left in --max-model-len (message k is episode samples[k]'s)."""
    specials = special_strings(tokenizer)
    before, after = "Q: ", "\nA:"
    if uses_chat_template(cfg, tokenizer) and messages:
        text = chat_texts(tokenizer, [[{"role": "user", "content": TOOL_MARK}]], cfg)[0]
        need(text.count(TOOL_MARK) == 1, "the chat template does not render a user message as "
             "it is; pass --chat-template off.")
        before, after = text.split(TOOL_MARK)
    out = []
    for k, m in enumerate(messages):
        if len(m) > CHARS_PER_TOKEN * cfg.max_model_len:
            ids = [0] * cfg.max_model_len  # too long for any prompt: never tokenized
        elif any(s in m for s in specials):
            ids = [t for part, own in ((before, False), (m, True), (after, False)) for t in
                   tokenizer(part, add_special_tokens=False, split_special_tokens=own)
                   ["input_ids"]]
        else:
            ids = format_prompts([Problem(m, "")], tokenizer, cfg)[0]
        if len(ids) + 1 > cfg.max_model_len:
            raise RewardError(f"gave a first message of {len(m):,} characters, which leaves "
                              f"no room in --max-model-len {cfg.max_model_len}", samples[k], "")
        out.append(ids)
    return out


def shown(value, limit: int = 80) -> str:
    """repr(value), cut; never raises (an int of more than 4300 digits has no repr)."""
    try:
        return repr(value)[:limit]
    except Exception:
        return f"an object of type {type(value).__name__}"


def check_text(message, lead: str, sample: int, completion: str) -> None:
    """An env's message is text a tokenizer can read: a str, with no lone surrogate. `lead`
    starts the sentence that says otherwise ("reset returned", "returned the tool message")."""
    if not isinstance(message, str):
        raise RewardError(f"{lead} {shown(message)}, not text", sample, completion)
    try:
        message.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RewardError(f"{lead} with a lone surrogate ({message[e.start]!r} at "
                          f"character {e.start}), not text", sample, completion) from None


def env_reset(env: Env, problem: Problem, sample: int) -> str:
    try:
        with user_errors(sample, ""):
            message = env.reset(problem)
    except ToolError as e:  # no tool was called yet: the env's fault, not the model's
        raise RewardError(f"raised ToolError in reset: {e}", sample, "") from e
    check_text(message, "reset returned", sample, "")
    return message


def env_step(env: Env, text: str, sample: int) -> tuple[str | None, float | None]:
    """env.step(text), checked: a tool message is text; without one, the reward is a finite
    number. RewardError otherwise (a ToolError passes)."""
    with user_errors(sample, text):
        out = env.step(text)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise RewardError(f"returned {shown(out)}, not (tool message, reward)", sample, text)
    message, value = out
    if message is not None:
        check_text(message, "returned the tool message", sample, text)
    if message is None or value is not None:
        value = finite_reward(value, sample, text)
    return message, value


@contextlib.contextmanager
def user_errors(sample: int, completion: str):
    """A reward's or an env's exception as a RewardError naming the sample: SystemExit,
    GeneratorExit and a KeyboardInterrupt on a tool's thread (no Ctrl-C lands there) too, all
    the user's. What passes: ToolError, simple_rl's interruptions, and in the main thread a
    KeyboardInterrupt (the second Ctrl-C, or a first before the run's handlers are set)."""
    try:
        yield
    except (ToolError, ToolAbandoned, CallInterrupted):
        raise
    except BaseException as e:
        main = threading.current_thread() is threading.main_thread()
        if isinstance(e, KeyboardInterrupt) and main and \
                (StopRequest.active is None or StopRequest.asked() == signal.SIGINT):
            raise
        said = f"raised {type(e).__name__}" + (f": {e}" if str(e) else "")
        if isinstance(e, ValueError) and not main and "main thread" in str(e):
            said += (" (an env's reset and step run on worker threads, where signal handlers "
                     "cannot be set: bound a call with --tool-timeout instead)")
        raise RewardError(said, sample, completion) from e


def finite_reward(value, sample: int, completion: str) -> float:
    """value as a float, if it is a number finite in fp32; RewardError otherwise."""
    try:
        number = float(value) if isinstance(value, numbers.Real) else math.nan
    except (OverflowError, ValueError, TypeError):  # 10**400, or a Real that is not
        number = math.nan
    if not (math.isfinite(number) and abs(number) <= FP32_MAX):
        try:
            shown = repr(value)[:80]
        except Exception:  # an int of more than 4300 digits, or a repr that raises
            shown = f"a {type(value).__name__}"
        raise RewardError(f"returned {shown}, not a finite number in fp32", sample, completion)
    return number


def calculate(expr: str) -> int:
    """The value of an integer expression of + - * and parentheses; ToolError if it is none."""
    import ast

    ops = {"Add": "+", "Sub": "-", "Mult": "*"}

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op).__name__ in ops:
            return ARITH[ops[type(node.op).__name__]](value(node.left), value(node.right))
        raise ToolError(f"{expr[:40]!r} is not an integer expression of + - * and parentheses")

    try:
        return value(ast.parse(expr.strip(), mode="eval").body if len(expr) <= 100 else None)
    except (SyntaxError, ValueError) as e:
        raise ToolError(f"{expr[:40]!r} does not parse") from e


# ==========================================================================
# The lookup task (--env lookup): questions that need two to five dependent tool calls
# ==========================================================================
# A generated table of made-up people, each with a mentor and an age, and questions about the
# age of someone's mentor, or the mentor's mentor, and so on up to LOOKUP_HOPS links: search the
# person, read the mentor's name, search it, ... The answer of one call is the query of the
# next, and the question alone says how many calls it needs. Nothing is downloaded: the table
# and the questions are the same on every machine and for every --seed (which orders the steps).

LOOKUP_SEED = 40
LOOKUP_PEOPLE = 4096
LOOKUP_HOPS = 4  # mentor links a question chains at most: 2 to LOOKUP_HOPS + 1 calls
SYLLABLES = ("ka", "lo", "mi", "ra", "ve", "tu", "ne", "so", "di", "pa", "zo", "be", "ri",
             "fa", "gu", "ye")
LOOKUP_FORMAT = "Look a person up with <search>name</search>."


@functools.cache  # built once, then read (never written) by every episode's env
def lookup_table(n: int = LOOKUP_PEOPLE, seed: int = LOOKUP_SEED) -> dict[str, tuple[str, int]]:
    """name -> (mentor, age): n made-up people of four syllables, each mentored by another."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(4)).capitalize())
    people = sorted(names)  # a set's order differs between processes
    picks = [rng.randrange(n - 1) for _ in range(n)]
    mentors = [people[j + (j >= i)] for i, j in enumerate(picks)]  # anyone but themselves
    return {p: (m, rng.randint(20, 89)) for p, m in zip(people, mentors)}


def lookup_chain(table: dict[str, tuple[str, int]], name: str, hops: int) -> list[str]:
    """The people searched to answer a question of `hops` links about name: name, its mentor,
    the mentor's mentor, ... (hops + 1 names)."""
    chain = [name]
    for _ in range(hops):
        chain.append(table[chain[-1]][0])
    return chain


def lookup_problems(table: dict[str, tuple[str, int]]) -> list[Problem]:
    """Every question of the table, in a fixed shuffled order: for each person and each hops
    in 1..LOOKUP_HOPS, the age of the person `hops` mentor links away (hops + 1 calls)."""
    out = [Problem("How old is " + "the mentor of " * hops + f"{person}? {LOOKUP_FORMAT} "
                   f"{ANSWER_FORMAT}", str(table[lookup_chain(table, person, hops)[-1]][1]))
           for person in table for hops in range(1, LOOKUP_HOPS + 1)]
    random.Random(LOOKUP_SEED).shuffle(out)
    return out


def lookup_split(cfg: Config) -> tuple[list[Problem], list[Problem]]:
    """(training pool, held-out problems): the first --eval-size questions are held out."""
    problems = lookup_problems(lookup_table())
    return problems[cfg.eval_size:], problems[:cfg.eval_size]


def search(table: dict[str, tuple[str, int]], query: str) -> str:
    """The tool: a person's entry, or a sentence saying there is none."""
    name = query.strip()
    if name not in table:
        return f"no one is called {name[:40]!r}"
    mentor, age = table[name]
    return f"{name}: mentor {mentor}, age {age}"


class LookupEnv(RewardEnv):
    """--env lookup: a turn that ends in <search>NAME</search> gets NAME's entry as the tool's
    message; a turn without one is scored by reward_fn."""

    tool_stop = "</search>"

    def step(self, completion: str) -> tuple[str | None, float | None]:
        if not completion.endswith("</search>"):
            return None, self.reward_fn(completion, self.answer)
        query = completion[: -len("</search>")].rsplit("<search>", 1)[-1]
        return search(lookup_table(), query), None


# ==========================================================================
# Checkpoints & resume
# ==========================================================================
# checkpoints/step_NNNNNN/ (NNNNNN: the step to run next) holds
#   model/           the weights in HF format (bf16): loadable by transformers and vLLM
#   trainer/         fp32 masters + AdamW state: torch.distributed.checkpoint, a shard per rank
#   rng_rank{r}.pt   each rank's RNG states (tensors and ints: read with weights_only=True)
#   state.json       next step, world size, the masters' shapes, the next step's sampler seeds,
#                    and the list of every other file of the checkpoint (written last)
#   run_config.json  the run's config
# It is written to a temp dir and renamed; it counts only once every file state.json lists
# (DCP's shards among them) is there.
# A run directory is LOG_DIR/RUN_NAME with simple_rl.lock in it: the file marks it as
# simple_rl's, and the process running it holds an OS lock on that file.
CHECKPOINT = re.compile(r"step_(\d{6})")
COMPLETE = ("state.json", "run_config.json", "trainer/.metadata")
EXPORTS = ("model/model.safetensors", "model/adapter_model.safetensors")  # full, or LoRA's


def is_complete(ckpt: Path) -> bool:
    """Every file there: the fixed ones, and each one state.json lists (a kill while files were
    removed leaves the checkpoint incomplete, whichever went first)."""
    if CHECKPOINT.fullmatch(ckpt.name) is None or \
            not all((ckpt / f).is_file() for f in COMPLETE) or \
            not any((ckpt / f).is_file() for f in EXPORTS):
        return False
    try:
        files = json.loads((ckpt / "state.json").read_text()).get("files", [])
        return all(isinstance(name, str) and not Path(name).is_absolute()
                   and ".." not in Path(name).parts and (ckpt / name).is_file() for name in files)
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest step first."""
    found = [c for c in (run_dir / "checkpoints").glob("step_*") if is_complete(c)]
    return sorted(found, key=lambda c: int(CHECKPOINT.fullmatch(c.name).group(1)))


def files_under(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]


def rank_failures(e: BaseException) -> list[BaseException]:
    """The per-rank errors a DCP CheckpointException wraps ([] for any other error)."""
    return [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]


# What the libraries raise when the file system refuses a write, without an OSError: PyTorch's
# zip writer (torch.save, DCP's shards) stops short on a full disk ("unexpected pos 576 vs 534")
# or names the C error ("open file failed with strerror: Read-only file system"); safetensors
# says "I/O error: No space left on device (os error 28)".
SHORT_WRITE = re.compile(r"inline_container\.cc.*(unexpected pos|file write failed)")
OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def library_disk_error(e: BaseException) -> OSError | None:
    """The OSError a library's own error stands for, if its text names a file-system fault."""
    text = str(e)
    if isinstance(e, RuntimeError) and SHORT_WRITE.search(text):
        return OSError(errno.ENOSPC, "the write stopped short")
    code = OS_ERROR_CODE.search(text)
    if code and int(code.group(1)) in DISK_ERRNOS:
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
    if "inline_container.cc" in text or "SafetensorError" in type(e).__name__:
        for n in DISK_ERRNOS:
            if os.strerror(n) in text:
                return OSError(n, os.strerror(n))
    return None


def os_error_in(e: BaseException) -> OSError | None:
    """The file-system error behind e, if any: an OSError, or a library error that stands for
    one, in e's chain or in a DCP CheckpointException's per-rank failures."""
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        for inner in [e, *rank_failures(e)]:
            if isinstance(inner, OSError):
                return inner
            found = library_disk_error(inner)
            if found is not None:
                return found
        e = e.__cause__ or e.__context__
    return None


def root_cause(e: BaseException) -> str:
    """'Type: first line' of the error behind e (DCP wraps each rank's own)."""
    e = next(iter(rank_failures(e)), e)
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}"


def disk_error(path: Path, e: OSError, place: str = "--log-dir") -> RunStopped:
    """One sentence for a file-system error: which path, and what to free or change (`place`:
    the flag that chose the path)."""
    where = Path(e.filename) if e.filename else path
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        near = next((p for p in [path, *path.parents] if p.exists()), Path("."))
        free = shutil.disk_usage(near).free / 2**30
        full = "no space left" if e.errno == errno.ENOSPC else "disk quota exceeded"
        other = "lower --keep-last, or point --log-dir at a larger disk" \
            if place == "--log-dir" else f"or point {place} at a larger disk"
        what = f"{full} on the device holding {where} ({free:.1f} GiB free): free space there, "
        what += other
    elif e.errno == errno.EROFS:
        what = f"{where} is on a read-only file system: choose another --log-dir/--output-dir"
    elif e.errno in (errno.EACCES, errno.EPERM):
        what = f"no permission to write {where}: fix its permissions or choose another {place}"
    else:
        what = f"could not write {where} ({e.strerror or e})"
    return RunStopped(what + ".", EXIT_DISK)


@contextlib.contextmanager
def writing(path: Path, cleanup: Path | None = None, place: str = "--log-dir"):
    """The one guarded path for writes: a file-system error under `path` becomes one sentence
    (exit 6; `place` the flag that chose it), and `cleanup` is removed on any failure."""
    try:
        yield
    except (ConfigError, RunStopped):  # already one sentence (a held lock: ConfigError)
        if cleanup is not None and is_main():
            shutil.rmtree(cleanup, ignore_errors=True)
        raise
    except (Exception, CheckpointException) as e:
        if cleanup is not None and is_main():
            shutil.rmtree(cleanup, ignore_errors=True)
        cause = os_error_in(e)
        if cause is None:
            raise
        raise disk_error(path, cause, place) from e


def replace_dir(new: Path, old: Path) -> None:
    """Put directory `new` in place of `old` by renames alone: a kill at any moment leaves each
    of them whole (the old one under .old_NAME until it is removed)."""
    trash = old.parent / f".old_{old.name}"
    if old.exists():
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(old, trash)
    os.replace(new, old)
    shutil.rmtree(trash, ignore_errors=True)


def remove_dir(old: Path) -> None:
    """Rename, then delete: a kill mid-way never leaves a half-deleted step_N behind."""
    trash = old.parent / f".old_{old.name}"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(old, trash)
    shutil.rmtree(trash)


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """The trained parameters' shapes (under LoRA the adapters')."""
    return {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def _trained_only(strict: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # a LoRA run saves no base weight; restoring, DCP's load has already required every
    # trained one, and the frozen base is the model's own (strict would ask for it)
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


TRAINED_ONLY, RESTORE_TRAINED = _trained_only(True), _trained_only(False)


def save_checkpoint(run_dir: Path, trainer: Trainer, next_step: int, model_dir: Path) -> Path:
    """checkpoints/step_XXXXXX, written to a temp dir and renamed, so a crash or a full disk
    mid-write leaves the previous checkpoint whole; then all but the newest `keep_last` go.

    Every rank writes its shard of the masters and optimizer state (DCP) and gathers the HF
    export; rank 0 writes the rest, lists every file in state.json, and renames.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    cfg = trainer.cfg
    root = run_dir / "checkpoints"
    final = root / f"step_{next_step:06d}"
    tmp = root / f".tmp_step_{next_step:06d}"
    with writing(tmp, cleanup=tmp):
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer,
                                                  options=TRAINED_ONLY)
        dcp.save({"model": model_state, "optimizer": optim_state["state"]},
                 storage_writer=dcp.FileSystemWriter(str(tmp / "trainer")))
        hf_state = gathered_hf_state(trainer.model)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        torch.save(rng, tmp / f"rng_rank{trainer.ranks.rank}.pt")
        if is_main():
            save_export(tmp / "model", hf_state, trainer, model_dir)
            (tmp / "run_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        barrier()  # every rank's files are written: state.json lists them
        if is_main():
            state = dict(next_step=next_step, world_size=trainer.ranks.world,
                         shapes=model_shapes(trainer.model),
                         mismatched_total=trainer.mismatched_total, inputs=trainer.inputs,
                         lora={n: getattr(cfg, n) for n in LORA_FIELDS},
                         stack=stack_versions(),  # a resume on another stack says so
                         # prompts and sampler seeds are pure functions of (seed, step)
                         data=dict(task=cfg.task, seed=cfg.seed, next_step=next_step),
                         sampler_seeds=sampler_seeds(cfg, next_step),
                         files=files_under(tmp))
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            replace_dir(tmp, final)  # a resume re-saving step_N replaces it by renames only
            for old in complete_checkpoints(run_dir)[: -cfg.keep_last]:
                remove_dir(old)
            for leftover in [*root.glob(".tmp_step_*"), *root.glob(".old_step_*")]:
                shutil.rmtree(leftover, ignore_errors=True)  # from a save killed mid-way
    barrier()
    return final


DCP_METADATA = "torch.distributed.checkpoint.metadata"


class CheckpointUnpickler(pickle.Unpickler):
    """Reads DCP's `.metadata` (a pickle) building only DCP's own metadata types: a checkpoint
    is data, so a crafted one cannot run code through this reader.

    How DCP's metadata is pickled differs by Python version (3.10-3.13): some 3.11 releases
    (3.11.2, Debian 12's Python, but not 3.11.7) pickle an enum member as
    builtins.getattr(EnumClass, 'NAME'), so getattr is allowed, only to fetch a member of an
    allowed enum; 3.13 pickles paths as pathlib._local.PosixPath, pathlib.PosixPath's new home.
    """

    ALLOWED = {(DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}
    ENUMS = {(DCP_METADATA, "_MEM_FORMAT_ENCODING")}
    MOVED = {"pathlib._local": "pathlib"}  # 3.13's home of pathlib's classes

    def find_class(self, module: str, name: str):
        module = self.MOVED.get(module, module)
        if (module, name) == ("builtins", "getattr"):
            return self.enum_member
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in self.ALLOWED and not dtype:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint")
        return super().find_class(module, name)

    def enum_member(self, cls, name):
        """getattr(cls, name) for a member of an allowed enum, and for nothing else."""
        allowed = [super(CheckpointUnpickler, self).find_class(*e) for e in self.ENUMS]
        if cls not in allowed or not isinstance(name, str) or name not in cls.__members__:
            raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', '?')}, "
                                         f"{name!r}) is not allowed in a checkpoint")
        return cls.__members__[name]


@contextlib.contextmanager
def data_only_loading():
    """Within: DCP's metadata goes through CheckpointUnpickler, and every torch.load (DCP's
    tensor and byte items, the RNG files) is forced to weights_only=True."""
    from torch.distributed.checkpoint import filesystem

    class Restricted:
        @staticmethod
        def load(file):
            return CheckpointUnpickler(file).load()

    saved = {k: os.environ.pop(k, None)  # put back as the user had them
             for k in ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    real_pickle = filesystem.pickle
    filesystem.pickle = Restricted
    try:
        yield
    finally:
        filesystem.pickle = real_pickle
        os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def read_checkpoint_state(ckpt: Path) -> dict:
    """state.json of a checkpoint, checked for the fields restore needs."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        ok = isinstance(state["next_step"], int) and state["next_step"] >= 0 and \
            isinstance(state["world_size"], int) and isinstance(state["shapes"], dict)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{ckpt / 'state.json'} is damaged ({type(e).__name__}); resume from "
                          "an earlier checkpoint.") from e
    need(ok, f"{ckpt / 'state.json'} is damaged (wrong field types); resume from an earlier "
         "checkpoint.")
    return state


def sampler_seeds(cfg: Config, step: int) -> list[int]:
    """The seeds of a step's requests (request_seed), which a checkpoint records."""
    return [request_seed(cfg, step, i) for i in range(cfg.num_prompts)]


def stack_versions() -> dict[str, str]:
    """The versions whose kernels decide a sample's bits: torch's, and vLLM's where it runs."""
    vllm = sys.modules.get("vllm")
    return dict(torch=torch.__version__, **({"vllm": vllm.__version__} if vllm else {}))


def stack_change(saved: dict | None) -> str | None:
    """'vLLM 0.26 / torch 2.11 (now ...)' when a checkpoint's stack is not this process's, else
    None. Checkpoints record it from vLLM 0.34 on; one without a record was made on 0.26."""
    now = stack_versions()
    if saved == now:
        return None

    def name(versions: dict) -> str:  # vLLM first
        return " / ".join(f"{'vLLM' if k == 'vllm' else k} {versions[k]}"
                          for k in sorted(versions, reverse=True))

    then = name(saved) if isinstance(saved, dict) else "vLLM 0.26 / torch 2.11"
    return f"{then} (now {name(now)})"


def samples_change(state: dict, cfg: Config) -> str | None:
    """Why a checkpoint's samples would not continue bit for bit in this process, or None:
    another stack (stack_change), or sampler seeds that request_seed no longer gives (one
    written before it stayed a multiple of G at any seed)."""
    other = stack_change(state.get("stack"))
    if other:
        return f"was made with {other}"
    now = sampler_seeds(cfg, state["next_step"])
    if state.get("sampler_seeds", now) != now:  # none recorded: nothing to compare
        return "seeded its samples otherwise (an earlier simple_rl's request_seed)"
    return None


def unrestorable(ckpt: Path, e: BaseException) -> ConfigError:
    return ConfigError(f"{ckpt} cannot be restored ({root_cause(e)}); resume from an earlier "
                       "checkpoint.")


def read_dcp_metadata(ckpt: Path):
    """trainer/.metadata through CheckpointUnpickler, checked to be DCP's Metadata.

    Read before DCP's own load, which on a bad file falls back to per-rank files and logs
    each failure's traceback to the root logger.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with (ckpt / "trainer" / ".metadata").open("rb") as f:
            meta = CheckpointUnpickler(f).load()
    except Exception as e:  # truncated, crafted or foreign: pickle raises many types
        raise unrestorable(ckpt, e) from e
    need(isinstance(meta, Metadata) and isinstance(meta.state_dict_metadata, dict)
         and isinstance(meta.storage_data, dict), f"{ckpt} cannot be restored (trainer/.metadata "
         "is not DCP's metadata); resume from an earlier checkpoint.")
    root = (ckpt / "trainer").resolve()  # its shards: inside it, after '..' and links
    paths = [getattr(info, "relative_path", None) for info in meta.storage_data.values()]
    outside = [p for p in paths if not isinstance(p, str) or not p or "\0" in p
               or not (root / p).resolve().is_relative_to(root)]
    need(not outside, f"{ckpt} cannot be restored (trainer/.metadata names "
         f"{str(outside[:1])[1:-1][:80]}, not a file of trainer/); resume from an earlier "
         "checkpoint.")
    return meta


def read_rng(ckpt: Path, rank: int) -> dict | None:
    """rng_rank{rank}.pt, checked to hold the states restore sets (None: not saved for this
    rank, as after a change of world size)."""
    file = ckpt / f"rng_rank{rank}.pt"
    if not file.is_file():
        return None
    try:
        with data_only_loading():
            rng = torch.load(file, weights_only=True)
        torch.Generator().set_state(rng["torch"])  # each state tried on a throwaway generator
        random.Random().setstate(rng["python"])
        if not isinstance(rng["cuda"], list) or not all(
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in rng["cuda"]):
            raise TypeError("the CUDA states are not a list of byte tensors")
    except Exception as e:  # a crafted file, another format, wrong sizes: many error types
        raise ConfigError(f"{ckpt} cannot be restored ({file.name} is damaged: "
                          f"{type(e).__name__}); resume from an earlier checkpoint.") from e
    return rng


def check_saved_shapes(ckpt: Path, cfg: Config, want: dict[str, list[int]]) -> None:
    """The checkpoint holds the trained tensors of the model built (`want`: model_shapes)."""
    saved = read_checkpoint_state(ckpt)["shapes"]
    other = next((n for n in sorted({*saved, *want}) if saved.get(n) != want.get(n)), None)
    need(other is None, f"{ckpt} holds other weights than --model {cfg.model} under "
         f"its run_config.json makes ({other}: saved {saved.get(other)}, here "
         f"{want.get(other)}): it was saved from another model, or its files were edited.")


def trained_shapes(cfg: Config, args) -> dict[str, list[int]]:
    """model_shapes of the model the run will build (on the meta device: nothing allocated),
    for a resume's check before the engine starts."""
    lora = lora_spec(cfg, args)
    with torch.device("meta"):
        model = Qwen3(args, bib.reference_kernels(), torch.float32)
        if lora:
            add_lora(model, lora)
    return {n: list(p.shape) for n, p in model.named_parameters() if not lora or ".lora." in n}


def check_checkpoint_files(ckpt: Path) -> None:
    """What a restore reads before the model exists (state, DCP metadata, rank 0's RNG): a bad
    file ends here, in one sentence, before the run directory or the engine."""
    read_checkpoint_state(ckpt)
    read_dcp_metadata(ckpt)
    read_rng(ckpt, 0)


def restore_checkpoint(trainer: Trainer, ckpt: Path) -> int:
    """Load masters, optimizer state and RNG from `ckpt` into `trainer` (resharded by DCP if the
    world size changed); returns the step to run next."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = read_checkpoint_state(ckpt)
    check_saved_shapes(ckpt, trainer.cfg, model_shapes(trainer.model))
    read_dcp_metadata(ckpt)
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer,
                                              options=TRAINED_ONLY)
    loaded = {"model": model_state, "optimizer": optim_state["state"]}
    try:
        with data_only_loading():
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(ckpt / "trainer")))
    except (Exception, CheckpointException) as e:  # truncated, crafted or foreign files
        raise unrestorable(ckpt, e) from e
    same_world = state["world_size"] == trainer.ranks.world
    rng = read_rng(ckpt, trainer.ranks.rank) if same_world else None
    trainer.mismatched_total = int(state.get("mismatched_total", 0))  # older checkpoints: 0
    changed = samples_change(state, trainer.cfg)
    if changed:
        print0(f"{ckpt.name} {changed}: its weights and optimizer state go on exactly, its "
               "samples will not continue bit for bit.")
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=loaded["model"],
                   optim_state_dict={"state": loaded["optimizer"],
                                     "param_groups": optim_state["param_groups"]},
                   options=RESTORE_TRAINED)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state["next_step"]


def find_checkpoint(cfg: Config) -> Path:
    """--resume PATH (a complete checkpoint dir) or 'latest': the highest complete step of
    --run-name (or of the only run in --log-dir that has checkpoints)."""
    if cfg.resume != "latest":
        ckpt = Path(cfg.resume).expanduser()
        need(ckpt.is_dir() and is_complete(ckpt), f"--resume {cfg.resume!r} is not a complete "
             "checkpoint directory (checkpoints/step_NNNNNN with state.json, trainer/, model/).")
        return ckpt
    log_dir = Path(cfg.log_dir).expanduser()
    if cfg.run_name:
        runs = [log_dir / cfg.run_name]
    else:
        runs = sorted(r for r in log_dir.glob("*") if r.is_dir() and complete_checkpoints(r))
        need(len(runs) <= 1, f"--resume latest: {log_dir} holds several runs "
             f"({', '.join(r.name for r in runs[:5])}); say which with --run-name.")
    found = complete_checkpoints(runs[0]) if runs else []
    need(bool(found), f"--resume latest: no complete checkpoint under "
         f"{runs[0] if runs else log_dir}.")
    return found[-1]


# Flags a resumed run takes from the command line; every other one comes from the checkpoint.
RESUMABLE = {"steps", "save_every", "keep_last", "parity_rows", "parity_every", "strict_parity",
             "verbose", "output_dir", "log_param_deltas", "resume", "log_dir", "run_name",
             "eval_every"}


# The flags a resume takes from the command line only: where it writes, what it may delete and
# which changes it accepts are never chosen by a checkpoint's files.
PATH_FLAGS = {"log_dir", "run_name", "output_dir", "overwrite", "resume", "allow_changed_files",
              "check"}


# The flags that name what a run reads: the reward's code, the model's config, tokenizer and
# weights, the data. Each checkpoint records the sha256 of their files (state.json "inputs"). A
# resume imports only the command line's --reward and --env files; --model and --data-files it
# takes from the command line, or from the checkpoint when their files still have the recorded
# sha256. The weights are read again on a resume (a LoRA run's base, full fine-tuning's KL
# reference), so every byte of them is hashed at each start: a size-and-mtime shortcut would
# miss a tensor rewritten in place. It costs one read of the weights (the engine then loads them
# from the page cache) at about 1 GB/s per core, the files hashed in parallel.
INPUTS = ("reward", "env", "model", "data_files")


def input_files(name: str, value: str, model_dir: Path) -> dict[str, Path]:
    """The files behind one of INPUTS, by key: the reward's or env's file (keyed by NAME), the
    data file, the model's config.json, tokenizer files, safetensors index and weights."""
    if name == "model":
        names = ["config.json", *TOKENIZER_FILES, "model.safetensors.index.json"]
        with contextlib.suppress(ConfigError):  # none, or a bad index: load_model_files says so
            names += weight_files(model_dir)
        return {f: model_dir / f for f in names if (model_dir / f).is_file()}
    if not value or (name == "env" and value in EMBEDDED_ENVS):
        return {}
    if name in ("reward", "env"):
        file, function = value.rsplit(":", 1)
        return {function: Path(file)}
    return {"data": Path(value)}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**23), b""):
            h.update(block)  # releases the GIL: files hash in parallel
    return h.hexdigest()


def digests(files: dict[str, Path]) -> dict[str, str]:
    """sha256 of each regular file (a FIFO or a device is left to the loader to refuse), up to
    8 files at once."""
    from concurrent.futures import ThreadPoolExecutor

    keys = [key for key, p in files.items() if p.is_file()]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(keys, pool.map(lambda key: sha256_file(files[key]), keys)))


def check_unchanged(cfg: Config, inputs: dict[str, dict[str, Path]],
                    expect: dict | None) -> dict[str, dict[str, str]]:
    """The sha256 of the files of `inputs`, by name. On a resume, before any of them is read:
    each must be what the checkpoint's run read. A path taken from the checkpoint must match;
    one given on the command line may differ only with --allow-changed-files, which says so in
    a warning."""
    hashed = {name: digests(files) for name, files in inputs.items()}
    if expect is None:
        return hashed
    recorded = expect["recorded"] if isinstance(expect["recorded"], dict) else {}
    for name, files in inputs.items():
        want = recorded.get(name, {})  # none recorded: it must read no file
        found = hashed[name]
        if found == want:
            continue
        want = want if isinstance(want, dict) else {}
        differs = [files[k] for k in sorted(files) if found.get(k) != want.get(k)]
        what = str(differs[0]) if differs else f"{flag(name)} {getattr(cfg, name)}"
        need(name in expect["given"], f"{what} is not what the run read when {cfg.resume} was "
             f"saved (sha256 differs, or the checkpoint records none); pass {flag(name)} to "
             "name the files to use (changed ones also need --allow-changed-files).")
        need(cfg.allow_changed_files, f"{what} is not what the run read when {cfg.resume} was "
             "saved (sha256 differs, or the checkpoint records none); pass "
             "--allow-changed-files to resume with it.")
        print0(f"warning: {what} differs from what the run read when {cfg.resume} was saved; "
               "resuming with it (--allow-changed-files).")
    return hashed


def is_run_dir(path: Path) -> bool:
    """A directory simple_rl made for a run: a plain name, not a link, with its lock file."""
    return RUN_NAME.fullmatch(path.name) is not None and path.is_dir() and \
        not path.is_symlink() and (path / LOCK_FILE).is_file() and \
        not (path / LOCK_FILE).is_symlink()


def resume_location(cfg: Config, passed: set[str], ckpt: Path) -> tuple[str, str]:
    """(log dir, run name) of a resumed run: --log-dir and --run-name as given; those not given
    are those of the checkpoint's run when it lies in RUN/checkpoints/ of a run directory
    simple_rl made, else the defaults (a new run, named by the time)."""
    home = ckpt.resolve().parent.parent
    if cfg.resume == "latest":  # found in LOG_DIR/RUN_NAME, or the one run in LOG_DIR
        return cfg.log_dir, cfg.run_name or home.name
    in_run = ckpt.resolve().parent.name == "checkpoints" and is_run_dir(home)
    log_dir = cfg.log_dir if "log_dir" in passed or not in_run else str(home.parent)
    run_name = cfg.run_name if "run_name" in passed or not in_run else home.name
    return log_dir, run_name


# The flags that give the trained adapters their meaning: state.json records them, and a resume
# keeps them (the seven targets spelled out are `all`).
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")


def lora_meaning(value):
    return named_targets(value) if isinstance(value, str) else value


def resume_config(cfg: Config, passed: set[str], ckpt: Path) -> Config:
    """The checkpoint's config, with the flags a resume may change; warns about the others.

    Where the run writes and what it may delete come from the command line alone
    (PATH_FLAGS; see resume_location), and so does the reward's code: never from the
    checkpoint's run_config.json.
    """
    file = ckpt / "run_config.json"
    try:
        saved = json.loads(file.read_text())
        resumed = Config(**saved)  # a non-dict or an unknown field: TypeError
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{file} is damaged or from another version ({type(e).__name__}).") from e
    try:
        validate(dataclasses.replace(resumed, resume=""))
    except ConfigError as e:
        raise ConfigError(f"{file} holds an invalid config: {e}") from e
    for name in ("reward", "env"):  # FILE.py:NAME is code: never imported from a checkpoint
        spec = getattr(resumed, name)
        need(":" not in spec or name in passed, f"{ckpt}'s run used {flag(name)} {spec}; a "
             f"resume imports no code its checkpoint names: pass {flag(name)} FILE.py:NAME "
             "again.")
    trained = read_checkpoint_state(ckpt).get("lora")
    if not isinstance(trained, dict):  # an older checkpoint records none
        trained = {name: getattr(resumed, name) for name in LORA_FIELDS}
    for name in LORA_FIELDS:  # the trained tensors' meaning
        value = lora_meaning(getattr(resumed, name))
        need(lora_meaning(trained.get(name)) == value,
             f"{file} says {flag(name)} {getattr(resumed, name)}, but the checkpoint's weights "
             f"were trained with {shown(trained.get(name))} (state.json): restore the file.")
        need(name not in passed or lora_meaning(getattr(cfg, name)) == value,
             f"{ckpt}'s run trained with {flag(name)} {getattr(resumed, name)}; a resume "
             f"continues those weights and cannot change it to {getattr(cfg, name)}.")
    ignored = sorted(n for n in passed - RESUMABLE - PATH_FLAGS - set(INPUTS) - set(LORA_FIELDS)
                     if getattr(cfg, n) != saved.get(n))
    if ignored:
        flags = ", ".join(flag(n) for n in ignored)
        print0(f"warning: --resume takes these from the checkpoint and ignores the command "
               f"line's: {flags}.")
    keep = {n: getattr(cfg, n) for n in RESUMABLE | set(INPUTS) if n in passed}
    keep.update({n: getattr(cfg, n) for n in PATH_FLAGS}, reward=cfg.reward)
    log_dir, run_name = resume_location(cfg, passed, ckpt)
    keep.update(log_dir=log_dir, run_name=run_name, resume=str(ckpt))
    return dataclasses.replace(resumed, **keep)


def resolve_run(cfg: Config, passed: set[str]) -> tuple[Config, Path | None, dict | None]:
    """The config to run (a resume's comes from its checkpoint), the checkpoint, if any, and
    what check_unchanged compares the run's input files with (None: not a resume).

    A resume that continues a run directory locks it first, then chooses and reads its
    checkpoint: no other process can replace the run in between.
    """
    ckpt, expect = None, None
    if cfg.resume:
        ckpt = find_checkpoint(cfg)
        log_dir, run_name = resume_location(cfg, passed, ckpt)
        run_dir = Path(log_dir) / run_name
        if continues(ckpt, run_dir):
            with writing(run_dir):
                lock_run_dir(run_dir)
            ckpt = find_checkpoint(cfg)  # chosen again, under the lock
            need(continues(ckpt, run_dir), f"--resume {cfg.resume}: the runs in {log_dir} "
                 "changed while it started; try again.")
        check_checkpoint_files(ckpt)
        cfg = absolute_paths(resume_config(cfg, passed, ckpt))  # an older one's may be relative
        expect = dict(recorded=read_checkpoint_state(ckpt).get("inputs"),
                      given=passed & set(INPUTS))
    validate(cfg)
    if not cfg.run_name:
        cfg = dataclasses.replace(cfg, run_name=time.strftime("%Y%m%d-%H%M%S"))
    check_run_paths(cfg, ckpt)  # before the weights are read, and again under the run's lock
    return cfg, ckpt, expect


def purge_after(metrics_log: Path, start: int) -> None:
    """Drop what an interrupted run logged after its checkpoint (and a half-written line)."""
    if not metrics_log.is_file():
        return
    kept = []
    for line in metrics_log.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError, TypeError, KeyError):
            if json.loads(line)["step"] < start:
                kept.append(line)
    with writing(metrics_log):
        metrics_log.write_text("".join(line + "\n" for line in kept))


# ==========================================================================
# Run directory: paths, lock, export
# ==========================================================================


LOCK_FILE = "simple_rl.lock"


def overlaps(a: Path, b: Path) -> bool:
    """One of the two paths is the other or lies inside it (after links and '..')."""
    a, b = a.expanduser().resolve(), b.expanduser().resolve()
    return a.is_relative_to(b) or b.is_relative_to(a)


def is_earlier_export(out: Path) -> bool:
    """A directory holding only files a final export writes (so replacing it loses nothing)."""
    return out.is_dir() and not out.is_symlink() and all(
        p.name in EXPORT_FILES and p.is_file() and not p.is_symlink() for p in out.iterdir())


def export_dir(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.output_dir).expanduser() if cfg.output_dir else run_dir / "final"


def export_flag(cfg: Config) -> str:
    """The flag that chose where the export goes (a disk error's advice names it)."""
    return "--output-dir" if cfg.output_dir else "--log-dir"


def export_tmp(out: Path, run_dir: Path) -> Path:
    """Where the run writes its export before renaming it to `out`: next to it, named after
    the run directory, so a later start of the same run finds what a killed export left."""
    tag = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return out.parent / f".tmp_{out.name}.{tag}"


def clear_export_tmp(cfg: Config, run_dir: Path) -> Path:
    """Remove a half-written export of this run (killed mid-way: SIGKILL, a second Ctrl-C),
    then check, by making it, that the export's place can be written: a read-only or missing
    --output-dir is found before the first step, not after the last."""
    out = export_dir(cfg, run_dir)
    tmp = export_tmp(out, run_dir)
    with writing(out, place=export_flag(cfg)):
        for old in [tmp, *run_dir.glob(".tmp_final.*")]:  # (older versions: random names)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # with the umask's mode, as the checkpoints (mkdtemp's would be 0700)
    return tmp


def continues(ckpt: Path | None, run_dir: Path) -> bool:
    """The checkpoint is one of this run directory's own: the run goes on in place."""
    return ckpt is not None and ckpt.resolve().parent == (run_dir / "checkpoints").resolve()


def holds_run(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


def check_run_paths(cfg: Config, ckpt: Path | None) -> Path:
    """Every check on where the run writes, before anything is written; returns the run dir.

    The run directory is LOG_DIR/RUN_NAME. The final export and --output-dir never overlap it
    (but for its own final/), the checkpoint being resumed, or a non-empty directory.
    """
    log_dir = Path(cfg.log_dir).expanduser()
    run_dir = log_dir / cfg.run_name
    need(RUN_NAME.fullmatch(cfg.run_name) is not None,
         f"run name {cfg.run_name!r} is not a plain name.")
    need(not run_dir.is_symlink(), f"{run_dir} is a symbolic link; a run directory must be a "
         "real directory inside --log-dir.")
    need(not run_dir.exists() or run_dir.is_dir(), f"{run_dir} exists and is not a directory.")
    out = export_dir(cfg, run_dir)
    own = out.resolve() == (run_dir / "final").resolve()  # the default place, however spelled
    need(own or not overlaps(out, run_dir), f"--output-dir {out} overlaps the run directory "
         f"{run_dir}; pick one outside it (the default export is {run_dir / 'final'}).")
    need(ckpt is None or not overlaps(out, ckpt), f"--output-dir {out} overlaps the checkpoint "
         f"{ckpt}; pick another.")
    need(own or not out.exists() or (out.is_dir() and not any(out.iterdir())),
         f"--output-dir {out} is not empty; pick another (simple_rl never deletes outside the "
         "run directory).")
    need(not own or not out.exists() or is_earlier_export(out), f"{out} holds files a final "
         "export does not write; move them out of it, or pass --output-dir.")
    if holds_run(run_dir) and not continues(ckpt, run_dir):
        need(cfg.overwrite, f"{run_dir} already holds a run; pass --resume latest --run-name "
             f"{cfg.run_name} to continue it, or --overwrite to replace it.")
        need(run_dir.resolve().parent == log_dir.resolve(), f"{run_dir} is not inside "
             f"{log_dir}; nothing was removed.")
        need(ckpt is None or not overlaps(ckpt, run_dir), f"--overwrite would remove {run_dir}, "
             f"which holds the checkpoint {ckpt}; resume it under another --run-name.")
    return run_dir


RUN_LOCKS: dict[Path, int] = {}  # run dir -> the descriptor of its held lock file


def drop_run_locks_in_child() -> None:
    """A process forked from the run (an env's step may fork) shares its lock file's open
    description, and so its lock, until it closes it: it closes it at once, so a child that
    outlives the run never holds its run directory."""
    for fd in RUN_LOCKS.values():
        os.close(fd)
    RUN_LOCKS.clear()


os.register_at_fork(after_in_child=drop_run_locks_in_child)


def lock_run_dir(run_dir: Path) -> None:
    """An exclusive OS lock (flock) on RUN/simple_rl.lock, held until release_run_dir or the
    process ends (a crash releases it), so no second process can share or replace the run."""
    import fcntl

    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ConfigError(f"{run_dir} is in use by another simple_rl process"
                          f"{f' (pid {holder})' if holder.isdigit() else ''}; wait for it to "
                          "end, or pick another --run-name.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    RUN_LOCKS[run_dir] = fd


def release_run_dir(run_dir: Path) -> None:
    """Closing a lock file's descriptor releases its lock (the file stays: it marks the run)."""
    os.close(RUN_LOCKS.pop(run_dir))


def prepare_run_dir(cfg: Config, ckpt: Path | None) -> Path:
    """LOG_DIR/RUN_NAME, made and locked; an old run there is replaced only with --overwrite,
    which removes what that one directory holds and nothing else."""
    run_dir = check_run_paths(cfg, ckpt)
    if not continues(ckpt, run_dir):  # a resume in place locked it before reading (resolve_run)
        with writing(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            lock_run_dir(run_dir)
        try:  # again under the lock: a run may have started there since the checks
            check_run_paths(cfg, ckpt)
        except ConfigError:
            release_run_dir(run_dir)
            raise
    if holds_run(run_dir) and not continues(ckpt, run_dir):
        with writing(run_dir):
            for p in run_dir.iterdir():  # everything but the lock this process holds
                if p.name == LOCK_FILE:
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
    clear_export_tmp(cfg, run_dir).rmdir()
    return run_dir


EXPORT_FILES = {"model.safetensors", "config.json", *TOKENIZER_FILES,  # what an export holds
                "adapter_model.safetensors", "adapter_config.json"}  # (LoRA: a PEFT adapter)


def gathered_hf_state(model: Qwen3) -> dict[str, torch.Tensor]:
    """Every weight in the compute dtype, on CPU, under HF (hub) names, or under LoRA the
    adapter (PEFT names, (rows, cols); B scaled by alpha / r, exported with lora_alpha = r);
    on rank 0 ({} elsewhere)."""
    keep = is_main()
    items = adapter_weights(model) if lora_modules(model) else hf_weights(model, False)
    return {k: v.reshape(v.shape[-2:]).cpu() if "lora_" in k else v.cpu() for k, v in items if keep}


def export_final(trainer: Trainer, run_dir: Path, model_dir: Path) -> str:
    """The final export (an HF checkpoint; under LoRA by default a PEFT adapter), written to a
    fresh temp dir and renamed into place; it replaces only this run's own earlier export.
    Returns the weights' sha256."""
    out = export_dir(trainer.cfg, run_dir)
    merged = trainer.cfg.lora_rank and trainer.cfg.export == "merged"
    hf_state = {k: v.cpu() for k, v in merged_weights(trainer.model)} if merged \
        else gathered_hf_state(trainer.model)
    digest = ""
    if is_main():
        tmp = clear_export_tmp(trainer.cfg, run_dir)
        with writing(out, cleanup=tmp, place=export_flag(trainer.cfg)):
            save_export(tmp, hf_state, trainer, model_dir)
            if out.resolve() == (run_dir / "final").resolve() and is_earlier_export(out):
                replace_dir(tmp, out)
            else:  # absent or empty (checked at the start); anything else fails, untouched
                os.replace(tmp, out)
        digest = weights_sha256(hf_state)
        print0(f"saved {out} | weights sha256 {digest}")
    barrier()
    return digest


def save_export(out: Path, state: dict[str, torch.Tensor], trainer: Trainer,
                model_dir: Path) -> None:
    """A PEFT adapter (LoRA: `state` holds lora_A/lora_B names) or a Hugging Face checkpoint."""
    if any("lora_" in k for k in state):  # its base: the hub id, where --model names one
        model = trainer.cfg.model
        base = model_dir if looks_like_path(model) else model
        save_peft_adapter(out, state, lora_spec(trainer.cfg, trainer.model.args), base)
    else:
        save_hf_checkpoint(out, state, model_dir)


def merged_weights(model: Qwen3) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of a LoRA run, HF names, with its adapter merged: W + (alpha / r) B A, summed
    in fp32 and rounded once to the compute dtype (so not bit for bit the two-rounding layers the
    run trained: serve the adapter for that). Rank 0's items ({} elsewhere); every rank runs it."""
    keys = hf_key_map(model.args)
    adapters = {n.removesuffix(".lora"): m for n, m in model.named_modules()
                if isinstance(m, LoRA)}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        w = p.detach()
        m = adapters.get(name.removesuffix(".weight"))
        if m is not None:
            delta = torch.cat([m.scale * full_tensor(b.detach()) @ full_tensor(a.detach())
                               for a, b in zip(m.slice_a(), m.b)])  # (sum n_s, K) fp32
            w = (w.float() + delta).to(model.dtype)
        items = to_hf_items(name, w, model.args, keys, False)
        yield from items if is_main() else ()


def save_hf_checkpoint(out: Path, hf_state: dict[str, torch.Tensor], model_dir: Path) -> None:
    """config + model.safetensors + tokenizer files: loadable by transformers and vLLM."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in hf_state.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    if "text_config" in config:  # a vision-language model trained as its text model: export that
        kind = config["model_type"] + "_text"
        config = {**config["text_config"], "model_type": kind, "architectures": [MODEL_TYPES[kind]]}
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")  # as saved
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)


def save_peft_adapter(out: Path, adapter: dict[str, torch.Tensor], lora: LoRASpec,
                      base: Path | str) -> None:
    """adapter_config.json + adapter_model.safetensors, as PEFT saves a LoRA: loadable by peft
    and by vLLM's LoRARequest. B is saved with the scale folded in (B' = alpha / r B) and
    lora_alpha = r, so a server computes with the very bf16 B' the run trained and checked."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{k}": v.detach().reshape(v.shape[-2:]).contiguous().cpu()
               for k, v in adapter.items()}
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.rank,
                  target_modules=sorted({k.split(".")[-3] for k in adapter}), lora_dropout=0.0,
                  bias="none", fan_in_fan_out=False, inference_mode=True,
                  base_model_name_or_path=str(base))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def weights_sha256(hf_state: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(hf_state):
        t = hf_state[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ==========================================================================
# Logging: metrics.jsonl, TensorBoard, the console's lines
# ==========================================================================


def parity_table(a: torch.Tensor, b: torch.Tensor, bad: torch.Tensor, tokens: torch.Tensor,
                 gen_counts: list[int], rows: int) -> str:
    """parity_report's table of vLLM's (a) and the trainer's (b) logprobs (N,), bad (N,) where
    their bits differ: where each of the first `rows` differing samples first differs (its
    later tokens follow from there) and how many of its tokens differ; or, with none, the
    first tokens."""
    n, bits_a, bits_b = len(a), a.view(torch.int32), b.view(torch.int32)
    length = torch.tensor(gen_counts, dtype=torch.long)  # (B,)
    sample = torch.repeat_interleave(length)  # (N,)
    start = length.cumsum(0) - length  # (B,) each sample's first token
    differ = torch.zeros(len(length), dtype=torch.long).index_add_(0, sample, bad.long())  # (B,)
    first = torch.full((len(length),), n).scatter_reduce(  # (B,) first differing token, or N
        0, sample, torch.where(bad, torch.arange(n), n), "amin")
    lines = [f"{'sample':>7} {'pos/len':>9} {'differ':>6} {'token':>8} {'vllm':>14} "
             f"{'trainer':>14} {'vllm bits':>10} {'trainer bits':>12} {'delta':>10}"]
    for i in first[first < n][:rows].tolist() if bad.any() else range(min(rows, n)):
        s = int(sample[i])
        lines.append(f"{s:>7} {f'{i - int(start[s])}/{gen_counts[s]}':>9} "
                     f"{int(differ[s]):>6} {int(tokens[i]):>8} {a[i].item():>14.8f} "
                     f"{b[i].item():>14.8f} {bits_a[i].item() & 0xFFFFFFFF:>10x} "
                     f"{bits_b[i].item() & 0xFFFFFFFF:>12x} {abs(a[i] - b[i]).item():>10.3g}")
    return "\n".join(lines)


def start_logs(trainer: Trainer, run_dir: Path, ckpt: Path | None, start: int,
               files: ModelFiles, memory: str) -> None:
    """TensorBoard on rank 0 (after a resume, without what followed the checkpoint), then the
    run's first lines: the resume, the banner and, with reference kernels, why tokens differ."""
    kernels = trainer.model.ops.name
    if trainer.ranks.main:
        open_logs(trainer, run_dir, start if ckpt else None)
    if ckpt:
        where = "" if continues(ckpt, run_dir) else f", as the new run {run_dir}"
        print0(f"resuming {ckpt}: {start} steps done, next {step_label(start, trainer.cfg.steps)}"
               f" (config from the checkpoint{where})")
    print0(run_banner(trainer.cfg, files, trainer.ranks.world, kernels, memory, run_dir))
    if kernels == "reference":
        print0("reference kernels are plain PyTorch, not vLLM's: differing tokens in the parity "
               "line are expected (only --kernels vllm on a GPU is bitwise)")


def open_logs(trainer: Trainer, run_dir: Path, resumed_at: int | None) -> None:
    """TensorBoard with the config and the dashboard's layout; after a resume, without what
    was logged after the checkpoint."""
    from torch.utils.tensorboard import SummaryWriter

    quiet_writer_thread()
    with writing(run_dir):
        trainer.writer = SummaryWriter(str(run_dir), purge_step=resumed_at)
        trainer.writer.add_text("config", json.dumps(dataclasses.asdict(trainer.cfg), indent=2))
        trainer.writer.add_custom_scalars(tensorboard_layout(trainer.engine.returns_routes,
                                                             bool(trainer.cfg.env)))
    if resumed_at is not None:
        purge_after(run_dir / "metrics.jsonl", resumed_at)


def run_banner(cfg: Config, files: ModelFiles, world: int, kernels: str, memory: str,
               run_dir: Path) -> str:
    n = count_params(files.args)
    size = f"{n / 1e9:.2f}B params" if n >= 1e9 else f"{n / 1e6:.1f}M params"
    memory = f" | {memory} (estimate)" if memory else ""
    lora = lora_spec(cfg, files.args)
    if lora:
        size += (f", LoRA rank {lora.rank} on {','.join(lora.targets)} "
                 f"({lora_params(cfg, files.args) / 1e6:.1f}M trained)")
    return (f"simple_rl | {files.path} | {size} | {world} rank(s) | kernels {kernels} | "
            f"micro-batch {cfg.micro_batch_tokens} tokens{memory} | run {run_dir}")


def check_progress(cfg: Config, ckpt: Path | None) -> Callable:
    """--check's answer, a line per thing checked as it passes (one can take seconds: the
    tokenizer's import, the data): check_inputs calls the function returned with what each
    check found (check_lines, each call printing the lines of what passed before it)."""
    lines = check_lines(cfg, ckpt)
    next(lines)
    return lines.send


def check_lines(cfg: Config, ckpt: Path | None) -> Iterator[None]:
    def say(*lines: str) -> None:
        for line in lines:
            print0(f"check: {line}")

    run_dir = Path(cfg.log_dir) / cfg.run_name
    where = (f"continues {ckpt.name}" if continues(ckpt, run_dir) else "holds a run that "
             "--overwrite replaces" if holds_run(run_dir) else "is made when the run starts")
    yield
    say(f"config: valid ({cfg.steps} steps of {cfg.num_prompts} prompts x {cfg.group_size})",
        f"run directory {run_dir}: {where}",
        *([f"checkpoint {ckpt}: state, DCP metadata and RNG readable; the files read are its "
           "run's (sha256)"] if ckpt else []))
    files = yield
    prompts = "the chat template" if uses_chat_template(cfg, files.tokenizer) else "Q:/A: text"
    say(f"model {files.path}: {count_params(files.args) / 1e6:.1f}M params; config.json and "
        f"every safetensors header agree{vision_note(files.path)}",
        f"tokenizer: {len(files.tokenizer)} tokens, eos ids {files.eos_ids}, prompts in {prompts}")
    task = yield
    lengths = [len(p) for p in task.prompt_ids + task.eval_prompt_ids]
    say(f"data ({'lookup' if cfg.env == 'lookup' else cfg.task}): {len(task.problems)} "
        f"training problems, {len(task.eval_problems)} held out; the longest prompt "
        f"({max(lengths)} tokens) fits --max-model-len")
    empty = yield
    if cfg.env in ("", *EMBEDDED_ENVS):  # your own env gives the rewards: no --reward
        say(f"reward {cfg.reward or 'simple_rl.reward'}: takes (completion, answer), gives "
            f"{empty:g} on an empty completion")
    env = yield
    gpu = "found" if torch.cuda.is_available() else "none here (the run needs one)"
    say(*([env] if env else []), lora_line(cfg, files.args),
        f"GPU: {gpu}; the weights' values, the memory estimate and vLLM are checked at the start")
    yield


def lora_line(cfg: Config, args) -> str:
    """--check's line on what trains: the adapters (rank, scale, targets, size) or every
    weight."""
    lora = lora_spec(cfg, args)
    if lora is None:
        return f"LoRA: off (full fine-tuning: {count_params(args) / 1e6:.1f}M params trained)"
    return (f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} (scale alpha / r = "
            f"{lora.alpha / lora.rank:g}) on {', '.join(lora.targets)}: "
            f"{lora_params(cfg, args) / 1e6:.2f}M params trained, the base frozen")


def tensorboard_layout(routes: bool = False, tools: bool = False) -> dict:
    """The Custom Scalars dashboard: the signals to act on first, one series per chart
    (TensorBoard draws a chart's series in one colour, with no legend), then the details; where
    vLLM returns experts (routes) also the tokens whose experts differ from vLLM's.

    TensorBoard reads a Multiline chart's tag as a regular expression matched at the start of
    each tag, so each is anchored: `determinism/mismatched_tokens` alone, not `..._total` too.
    The held-out accuracy is a Margin chart (value, lower, upper: exact tags), which TensorBoard
    never smooths: its few points keep their values (a smoothed line of 6 evals starts at its
    first, then lags), and the axis, which leaves out the outer 5% of the values it draws,
    keeps the first and the last of a few evals in view (each point brings three values).
    """
    def charts(*titled):  # (title, tag): Multiline; (title, (value, lower, upper)): Margin
        return {title: ["Margin", list(tag)] if isinstance(tag, tuple)
                else ["Multiline", [f"^{re.escape(tag)}$"]] for title, tag in titled}

    layout = {
        "simple_rl": charts(
            ("reward (mean over the step's samples)", "reward_mean"),
            ("held-out accuracy (greedy, %, 95% interval)",
             ("eval/accuracy_pct", "eval/accuracy_low_pct", "eval/accuracy_high_pct")),
            ("loss", "loss"),
            ("KL to the initial policy (with --kl-coef > 0)", "kl_div"),
            ("entropy (nats per token)", "entropy"),
            # a running total: smoothing cannot hide a mismatch, and the line never comes back
            ("mismatched tokens, run total (must stay 0)", "determinism/mismatched_tokens_total"),
            ("step time (s)", "time/step_s"),
        ),
        "simple_rl details": charts(
            ("reward std", "reward_std"),
            ("policy-gradient loss", "pg_loss"),
            ("mismatched tokens per step", "determinism/mismatched_tokens"),
            ("rollout time (s)", "time/rollout_s"),
            ("engine sleep time, within the rollout (s)", "time/engine_sleep_s"),
            ("update time (s)", "time/train_s"),
            ("weight push time (s)", "time/push_s"),
            ("engine wake time, within the push (s)", "time/engine_wake_s"),
            ("GPU memory in use (GiB)", "memory/in_use_gib"),
            ("completion length (tokens)", "completion_len_mean"),
            ("grad norm", "grad_norm"),
        ),
    }
    if routes:
        layout["simple_rl"].update(charts(("tokens routed to other experts (must stay 0)",
                                           "determinism/routing_mismatch")))
    if tools:  # --env: episodes of several turns
        layout["simple_rl"].update(charts(
            ("episodes that call the tool", "episode/tool_call_frac"),
            ("held-out episodes that call the tool (greedy)", "eval/tool_call_frac")))
        layout["simple_rl details"].update(charts(
            ("turns per episode", "episode/turns_mean"),
            ("tool calls per episode", "episode/tool_calls_mean"),
            ("episodes ended by a tool error", "episode/tool_error_frac"),
            ("episodes ended by --tool-timeout", "episode/tool_timeout_frac"),
            ("episodes cut at --max-model-len", "episode/max_model_len_frac"),
            ("episodes cut at --max-turns", "episode/max_turns_frac"),
            ("tool tokens per episode", "episode/tool_tokens_mean"),
            ("time waiting on the env's calls (s)", "time/tool_s"),
            ("abandoned tool calls still running", "tools/abandoned_threads")))
    return layout


def write_scalars(writer, metrics: dict[str, float], step: int) -> None:
    """Each metric to TensorBoard at `step` (on rank 0; the other ranks have no writer)."""
    if writer is not None:
        with writing(Path(writer.log_dir)):
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
            writer.flush()


def log_row(metrics_log, row: dict) -> None:
    """A row of metrics.jsonl, flushed (rank 0 has the file open; the others have None)."""
    if metrics_log is not None:
        with writing(Path(metrics_log.name)):
            metrics_log.write(json.dumps(row) + "\n")
            metrics_log.flush()


def close_logs(trainer: Trainer, metrics_log, run_dir: Path) -> None:
    """metrics.jsonl and TensorBoard closed, each even if the other fails (a disk error: exit
    6, as at every write)."""
    try:
        with writing(run_dir / "metrics.jsonl"):
            if metrics_log is not None:
                metrics_log.close()
    finally:
        with writing(run_dir):
            if trainer.writer is not None:
                trainer.writer.close()


def report_step(trainer: Trainer, step: int, first: bool, metrics: dict[str, float],
                parity: Parity, metrics_log, step_s: float) -> None:
    """The step's row in metrics.jsonl (rank 0), its parity line (with the token table every
    --parity-every steps, the run's first, and any that differs) and its step line."""
    cfg = trainer.cfg
    log_row(metrics_log, {"step": step, **{k: v for k, v in metrics.items()
                                           if not k.startswith("weight_delta/")}})
    bitwise = trainer.model.ops.name != "reference"  # reference kernels: differences expected
    if bitwise or not parity.n_mismatch:  # with reference kernels setup said once why
        if parity.n_mismatch or step % cfg.parity_every == 0 or first:
            print0(parity.table)
        print0(parity_line(parity))
    print0(format_step(step, cfg.steps, metrics, step_s, step_s * (cfg.steps - step - 1)))


def format_step(step: int, steps: int, m: dict[str, float], step_s: float, eta_s: float) -> str:
    memory = f" | {m['memory/in_use_gib']:.0f} GiB" if "memory/in_use_gib" in m else ""
    held_out = f" | held-out {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
    kl = f" | kl {m['kl_div']:.4f}" if "kl_div" in m else ""  # only with --kl-coef > 0
    routing = (f"routing {int(m['determinism/routing_mismatch'])}/"
               f"{int(m['determinism/routing_tokens'])} | "
               if "determinism/routing_mismatch" in m else "")
    turns = (f" | turns {m['episode/turns_mean']:.1f} tools {m['episode/tool_calls_mean']:.1f}"
             if "episode/turns_mean" in m else "")  # episodes of several turns
    if m.get("tools/abandoned_threads"):  # they share the interpreter: steps may slow down
        turns += (f" | {int(m['tools/abandoned_threads'])} abandoned tool calls still running "
                  f"(the run stops at {MAX_ABANDONED_THREADS})")
    return (f"step {step + 1}/{steps} | reward {m['reward_mean']:.3f}{held_out} | loss "
            f"{m['loss']:+.4f}{kl} | ent {m['entropy']:.3f} | len "
            f"{m['completion_len_mean']:.1f}{turns} | mismatched "
            f"{int(m['determinism/mismatched_tokens'])}/{int(m['determinism/tokens'])} | "
            f"{routing}rollout {m['time/rollout_s']:.1f}s train {m['time/train_s']:.1f}s push "
            f"{m['time/push_s']:.2f}s{memory} | {step_s:.1f} s/step | ETA {format_duration(eta_s)}")


def format_duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def step_metrics(cfg: Config, rollout: Rollout, rewards: torch.Tensor, n_prompts: int,
                 sums: torch.Tensor, n_tokens: int, grad_norm: torch.Tensor, parity: Parity,
                 times: tuple[float, float, float]) -> dict[str, float]:
    """The step's scalars over every rank: token means of (pg, kl, entropy, ratio, clipped)
    from their summed token sums, and reward and length statistics over every sample, taken
    in the step's prompt order (so they equal a single process's)."""
    G = cfg.group_size
    pg, kl, ent, ratio, clipped = all_reduce(sums).div(max(n_tokens, 1)).tolist()
    routing = {"determinism/routing_mismatch": parity.routing_mismatch,
               "determinism/routing_tokens": parity.routing_tokens} if parity.routes_checked else {}
    lengths = generated_lengths(rollout)
    per_prompt = [(rewards[j * G:(j + 1) * G].tolist(), lengths[j * G:(j + 1) * G],
                   rollout.completed[j * G:(j + 1) * G],
                   [episode_row(e) for e in rollout.episodes[j * G:(j + 1) * G]] if cfg.env
                   else []) for j in range(n_prompts)]
    every = in_prompt_order(all_gather_objects(per_prompt))
    all_rewards = torch.tensor([r for rs, _, _, _ in every for r in rs])
    lens = torch.tensor([n for _, ns, _, _ in every for n in ns], dtype=torch.float32)
    completed = [s for _, _, ss, _ in every for s in ss]
    rows = [row for *_, rs in every for row in rs]
    return {
        "loss": pg + cfg.kl_coef * kl - cfg.entropy_coef * ent, "pg_loss": pg,
        **({"kl_div": kl} if cfg.kl_coef > 0 else {}),  # no reference model: no KL to show
        "entropy": ent, "ratio_mean": ratio, "ratio_clipped_frac": clipped,
        "grad_norm": float(grad_norm),
        "reward_mean": all_rewards.mean().item(), "reward_std": all_rewards.std().item(),
        "completion_len_mean": lens.mean().item(),
        "completion_stopped_frac": sum(completed) / len(completed),
        "determinism/mismatched_tokens": parity.n_mismatch, "determinism/tokens": parity.n_tokens,
        "determinism/max_abs_diff": parity.max_abs_diff,
        "time/rollout_s": times[0], "time/train_s": times[1], "time/push_s": times[2],
        "time/step_s": sum(times),
        **routing,
        **(episode_metrics(rows) if cfg.env else {}),  # episodes of several turns
    }


def run_metrics(trainer: Trainer, parity: Parity, sleep_s: float, wake_s: float,
                waited: float, memory: dict[str, float]) -> dict[str, float]:
    """The step's scalars beside step_metrics': the engine's sleep (within time/rollout_s) and
    wake (within time/push_s), the slowest rank's wait on its tools (--env, within the rollout
    too), the run's mismatched tokens, the update's weight deltas and the GPU's memory."""
    cfg = trainer.cfg
    metrics = {"time/engine_sleep_s": sleep_s, "time/engine_wake_s": wake_s}
    if cfg.env:  # the slowest rank's wait, and the most threads of abandoned calls alive
        slowest = torch.tensor([waited, abandoned_threads()], device=trainer.ranks.device)
        slowest = all_reduce(slowest.double(), dist.ReduceOp.MAX).tolist()
        metrics["time/tool_s"], metrics["tools/abandoned_threads"] = slowest
    metrics["determinism/mismatched_tokens_total"] = trainer.mismatched_total
    named = dict(trainer.model.named_parameters())
    metrics.update(weight_deltas(trainer.optimizer, named, cfg.log_param_deltas))
    metrics.update(memory)
    return metrics


def episode_row(e: Episode) -> tuple:
    """(turns, tool calls, status, generated tokens per turn, tool tokens, seconds in
    env.step)."""
    tool = sum(len(turn.context) for turn in e.turns[1:])
    return len(e.turns), e.tool_calls, e.status, [len(t.out.ids) for t in e.turns], tool, e.tool_s


def episode_metrics(rows: list[tuple]) -> dict[str, float]:
    """Means over the step's episodes (every rank); how each ended, as fractions; the tokens
    the parity check compared at each turn; the seconds of the env.step calls, summed."""
    n = len(rows)
    turns, calls, status, per_turn, tool, seconds = zip(*rows)
    generated = [sum(c) for c in per_turn]
    checked = {f"determinism/tokens_turn{k + 1}": sum(c[k] for c in per_turn if len(c) > k)
               for k in range(max(turns))}
    return {"episode/turns_mean": sum(turns) / n, "episode/tool_calls_mean": sum(calls) / n,
            "episode/tool_call_frac": sum(c > 0 for c in calls) / n,
            **{f"episode/{end}_frac": status.count(end) / n for end in EPISODE_ENDS},
            "episode/generated_tokens_mean": sum(generated) / n,
            "episode/tool_tokens_mean": sum(tool) / n, "time/tool_calls_s": sum(seconds),
            **checked}


def in_prompt_order(per_rank: list[list]) -> list:
    """Rank r's lists hold prompts r, r + world, ...: put them back in the step's order."""
    out = []
    for j in range(max(len(x) for x in per_rank)):
        out += [x[j] for x in per_rank if j < len(x)]
    return out


DELTA_CHUNK = 1 << 24  # values: 64 MiB a fp32 temporary


def weight_deltas(optimizer: torch.optim.AdamW, named: dict[str, nn.Parameter],
                  per_param: bool) -> dict[str, float]:
    """||W_new - W_old|| and ||W_new - W_old|| / ||W_old|| of the last AdamW update, per layer.

    Reconstructed from the optimizer's state, without a copy of the old weights:
        a     = lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
        W_old = (W_new + a) / (1 - lr * wd),    delta = W_new - W_old
    Over DELTA_CHUNK values of one parameter at a time: its temporaries (a few fp32 copies)
    come after the push, beside the awake engine, where a whole embedding's (2.4 GiB each at
    Qwen3.5-4B) would not fit; local shards summed over ranks.
    """
    group = optimizer.param_groups[0]
    lr = group["lr"]
    wd = group["weight_decay"]
    eps = group["eps"]
    b1, b2 = group["betas"]
    if not optimizer.state:
        return {}
    t = float(next(iter(optimizer.state.values()))["step"])  # every parameter's step count
    keys = sorted({layer_of(n) for n in named} | (set(named) if per_param else set()))
    index = {k: i for i, k in enumerate(keys)}
    sq = torch.zeros(len(keys), 2, device=next(iter(named.values())).device)  # delta^2, old^2
    for name, p in named.items():
        state = optimizer.state.get(p)
        if not state:
            continue
        row = torch.zeros(2, device=sq.device)
        for w, m, v in zip(*(local_tensor(x).reshape(-1).split(DELTA_CHUNK)
                             for x in (p.detach(), state["exp_avg"], state["exp_avg_sq"])),
                           strict=True):
            step = (lr / (1 - b1**t)) * m / (v.sqrt() / math.sqrt(1 - b2**t) + eps)
            old = (w + step) / (1 - lr * wd)
            row += torch.stack([(w - old).square().sum(), old.square().sum()])
        sq[index[layer_of(name)]] += row
        if per_param:
            sq[index[name]] += row
    sq = all_reduce(sq).sqrt().tolist()  # one host sync
    out = {}
    for key, (delta, old) in zip(keys, sq):
        out[f"weight_delta/{key}/magnitude"] = delta
        out[f"weight_delta/{key}/relative_change"] = delta / max(old, 1e-30)
    return out


def layer_of(name: str) -> str:
    """'layers.3.attention.wqkv.weight' -> 'layers.3'; 'norm.weight' -> 'norm'."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def device_in_use(device: torch.device) -> int:
    """Bytes in use on this GPU now, by every allocator (PyTorch's, vLLM's, NCCL's, CUDA's)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def memory_metrics(device: torch.device, rollout_in_use: int) -> dict[str, float]:
    """GiB per GPU, the largest over ranks, read right after the update: the GPU in use after
    the rollout (the engine awake beside the blocks the trainer's allocator keeps cached, which
    a push frees if the engine needs them) and at the update's peak: in use now plus what
    PyTorch's allocator has released since its reserved peak. Also PyTorch's peaks in the
    update, allocated and reserved; both count the sleeping engine's weights and KV cache too
    (vLLM's sleep mode takes them from a PyTorch memory pool and unmaps them while asleep)."""
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    update_peak = device_in_use(device) + reserved - torch.cuda.memory_reserved(device)
    gib = all_reduce(torch.tensor([rollout_in_use, update_peak, allocated, reserved],
                                  dtype=torch.float64, device=device), dist.ReduceOp.MAX) / 2**30
    rollout, update, allocated, reserved = gib.tolist()
    return {"memory/in_use_gib": max(rollout, update), "memory/rollout_gib": rollout,
            "memory/update_gib": update, "memory/peak_allocated_gib": allocated,
            "memory/peak_reserved_gib": reserved}


# ==========================================================================
# Memory estimate
# ==========================================================================


def expert_params(args) -> int:
    """The routed experts' parameters: 3 dim I per expert (w13, w2), E per sparse layer."""
    n_sparse = len(sparse_layers(args))
    if not n_sparse:
        return 0
    return n_sparse * args.moe_args.num_experts * 3 * args.dim * args.moe_inter_dim


def count_params(args) -> int:
    """Parameters of a Qwen3 (the tied head counted once); for Qwen3-MoE every expert counts
    (each has an fp32 master, AdamW state and a bf16 copy in the engine):
    a sparse layer's MLP is E (dim + 3 dim I) (router + experts), a dense one's 3 dim H.
    A Qwen3.5's are counted on the model built on the meta device."""
    if qwen35(args):
        with torch.device("meta"):
            return sum(p.numel() for p in Qwen3(args, bib.reference_kernels(),
                                                torch.float32).parameters())
    q = args.n_heads * args.head_dim
    kv = args.n_kv_heads * args.head_dim
    block = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.hidden_dim \
        + 2 * args.dim + 2 * args.head_dim
    n_sparse = len(sparse_layers(args))
    blocks = args.n_layers * block + expert_params(args)
    if n_sparse:  # in a sparse layer the router (E x dim) and the experts replace the dense MLP
        blocks += n_sparse * (args.moe_args.num_experts * args.dim - 3 * args.dim * args.hidden_dim)
    head = 0 if args.enable_weight_tying else args.vocab_size * args.dim
    return args.vocab_size * args.dim + head + blocks + args.dim


def lora_params(cfg: Config, args) -> int:
    """The adapters' parameters (0 without LoRA), counted on the model built on the meta device:
    every slice's A and B (vLLM's packed layer holds them all, a shared A in each slice)."""
    lora = lora_spec(cfg, args)
    if lora is None:
        return 0
    with torch.device("meta"):
        model = Qwen3(args, bib.reference_kernels(), torch.float32)
        add_lora(model, lora)
    return sum(t.numel() for m in lora_modules(model) for t in (*m.slice_a(), *m.b))


def samples_an_episode(cfg: Config, args) -> int:
    """The update's samples an episode at most: 1, or a Qwen3.5's --max-turns (pack_rollout)."""
    return cfg.max_turns if cfg.env and gdn_layers(args) else 1


def samples_per_rank(cfg: Config, world: int) -> int:
    return -(-cfg.num_prompts // world) * cfg.group_size


def trained_rows(cfg: Config, world: int, prompts: tuple[int, int],
                 turns: int = 1) -> tuple[int, int]:
    """(tokens, generated tokens) in one micro-batch at most, for first prompts of prompts[0]
    to prompts[1] tokens, an episode trained as `turns` samples at most (a Qwen3.5's: one a
    turn, `pack_rollout`). With g the model's tokens an episode may hold (every turn's):
        T <= min(micro-batch, samples per rank x longest sample),
        N <= min(T, samples per rank x g, T g / (P_min + g)),
    the last as each sample's generated share g_b / (P_b + g_b) is at most g / (P_min + g).
    Only the N rows go through the head (`Qwen3.forward`), whose logits are the largest tensor."""
    shortest = prompts[0]
    g, sample = episode_bounds(cfg, prompts)
    samples = samples_per_rank(cfg, world) * turns
    rows = min(cfg.micro_batch_tokens, samples * sample)
    return rows, min(rows, samples * g, -(-rows * g // (shortest + g)))


def episode_bounds(cfg: Config, prompts: tuple[int, int]) -> tuple[int, int]:
    """(g, the longest sample in tokens) for first prompts of prompts[0] to prompts[1] tokens,
    g the model's tokens an episode may hold (every turn's)."""
    shortest, longest = prompts
    g = min(cfg.max_new_tokens * (cfg.max_turns if cfg.env else 1), cfg.max_model_len - shortest)
    # an episode's tool messages lengthen it (not its generated tokens) up to --max-model-len
    return g, cfg.max_model_len if cfg.env else min(cfg.max_model_len, longest + g)


def padded_rows(cfg: Config, world: int, prompts: tuple[int, int], turns: int = 1) -> int:
    """Rows of one Gated DeltaNet layer's fp32 recomputation in the backward: bib's
    gated_delta_rule_varlen cuts each of a micro-batch's B samples into whole chunks of
    C = bib.GDN_CHUNK tokens, sum_b round_up(L_b, C) <= min(T + B (C - 1), B round_up(L, C))
    rows, with T the micro-batch's (`trained_rows`)
        B <= min(samples per rank, T // P_min),   L <= min(T, the longest sample),
    as every sample holds its prompt."""
    rows, _ = trained_rows(cfg, world, prompts, turns)
    _, sample = episode_bounds(cfg, prompts)
    n, C = min(samples_per_rank(cfg, world) * turns, rows // prompts[0]), bib.GDN_CHUNK
    return min(rows + n * (C - 1), n * -(-min(rows, sample) // C) * C)


def prompt_range(task: Task, cfg: Config) -> tuple[int, int]:
    """(shortest, longest) first prompt in tokens: the task's training prompts, unless the
    user's env writes its own first message (`new_episodes`), of any length."""
    if cfg.env not in ("", *EMBEDDED_ENVS):
        return ANY_PROMPT
    lengths = [len(p) for p in task.prompt_ids]
    return min(lengths), max(lengths)


# Measured on H200s (results/h200_memory/): the GPU's use peaks in the rollout, when the awake
# engine sits beside the blocks the trainer's allocator keeps cached from its update: 1.16x the
# terms below at 1.7B (24576 tokens a micro-batch), 1.08x at 4B (8192), 1.05x at Qwen3-30B-A3B's 4
# layers. The slack covers that cache and the allocator's fragmentation, which grow with the
# activations; the experts' fp32 masters, gradients, AdamW state, bf16 casts and the engine's bf16
# copy, a few large tensors made once, get none (their 4 layers on vLLM 0.26: 76 GiB estimated
# against 69.3 in use, 101 with the slack on them; on 0.34, 58.3 in use against 65.5 with the
# gradients counted as late_gradients says: results/h200_a3b_memory_q35_resume/). Dense 8B on
# two GPUs is the known low one: 124.5 against 132 in use. Under LoRA nothing gets slack: the
# push empties the trainer's cache before the KV cache maps again, and the allocator grows its
# segments in place (see the top of this file).
# Measured (results/h200_lora_memory/), against estimates with a 4 GiB margin: Qwen3-14B 123.9
# GiB in use against 138.1 at 12288 tokens a micro-batch (1.11x), 92.2 against 103.1 at 8192
# (1.12x); Qwen3-32B's layers cut to 16 of 64: 36.9 against 41.6 at 4096 (1.13x), 30.4 against
# 32.1 at 2048 (1.06x). What a LoRA run holds beyond its counted holders (CUDA's context,
# workspaces, the engine's graphs) is read off its rollout, which holds nothing uncounted else:
# 1.5-1.7 GiB in those Qwen3 runs (vLLM 0.26), 2.3 at Qwen3.5-9B and 2.6 at 27B's cut layers on
# an H100 (vLLM 0.34; results/h100_fla_narrow_batched/, results/h100_q35_early_stops/), where 4
# GiB put 27B's cut layers at 1.17x. So LoRA's margin is 3 GiB (1.02-1.13x on all six runs);
# full fine-tuning's 4 GiB is part of the fit above.
MEMORY_SLACK, MEMORY_FIXED, LORA_FIXED = 1.25, 4 * 2**30, 3 * 2**30
ANY_PROMPT = (1, 1 << 30)  # prompt lengths unknown: as short and as long as the config allows


def token_layer_bytes(args) -> float:
    """What the backward keeps of one token in one layer, in bytes, the mean over the layers:
        2 (8 dim + mixer) + mlp,  mixer (bf16 values) and mlp (bytes) by the layer's kind:
    softmax attention   2 q + 4 kv; Qwen3.5's gated one 3 q more (the gate's columns of the
                        projection, the gate, the gated output), its Gemma norms as RMSNorm's
    Gated DeltaNet      4 Hk Dk + 5 Hv Dv + 2 Hv: the in-projections' outputs [q k v z] and
                        [b a], the conv's output and the rule's (saved by GatedDeltaRuleFn and
                        the gated norm), the gated norm's (out_proj's input)
    dense MLP           2 x 3 H
    sparse MLP          4 E + 8 k: the fp32 routing (the experts recompute their inside);
                        Qwen3.5-MoE's shared expert 2 (3 S + dim + 1) more (its SwiGLU, its
                        output and its sigmoid gate's input)
    (q = Hq D, kv = Hkv D). The Qwen3 terms are those measured (results/h200_memory/); Qwen3.5's
    are counted alike, and a block's saved tensors on CPU come under them (test_qwen35_memory)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    c, sparse, gdn = qwen35(args), sparse_layers(args), gdn_layers(args)
    total = 0
    for i in range(args.n_layers):
        if i in gdn:
            mixer = 4 * c.k_heads * c.k_dim + 5 * c.v_heads * c.v_dim + 2 * c.v_heads
        else:
            mixer = 2 * q + 4 * kv + (3 * q if c else 0)
        if i in sparse:
            m = args.moe_args
            shared = getattr(c, "shared_expert_dim", 0)
            mlp = 4 * m.num_experts + 8 * m.top_k + (2 * (3 * shared + args.dim + 1) if shared
                                                     else 0)
        else:
            mlp = 2 * 3 * args.hidden_dim
        total += 2 * (8 * args.dim + mixer) + mlp
    return total / args.n_layers


def gdn_backward_bytes(args, padded: int, fla: bool = True) -> int:
    """Peak bytes of one Gated DeltaNet layer's backward, over `padded` rows (`padded_rows`):
    the rule's (`gdn_rule_bytes` a row) or the conv's, the larger. The conv's
    (bib.CausalConv1dFn, over T + B (K - 1) rows: its zeros before each sample) holds
    4 x 7 (2 Hk Dk + Hv Dv) a row (6.3-6.5 measured): at Qwen3.5's heads more than fla's rule,
    less than the fp32 reference's. The gated norm's backward, about 8 Hv Dv fp32 values a
    token, is less. 0 without Gated DeltaNet."""
    if not gdn_layers(args):
        return 0
    c = qwen35(args)
    conv = 4 * 7 * (2 * c.k_heads * c.k_dim + c.v_heads * c.v_dim)
    return padded * max(gdn_rule_bytes(c, fla), conv)


def gdn_rule_bytes(c: Qwen35Args, fla: bool) -> int:
    """Peak bytes a row of the gated delta rule's backward, C = bib.GDN_CHUNK. On the GPU it is
    fla's (bib.gated_delta_rule_backward_fla: its forward again, then its chunked backward):
        2 (2 Hv Dk Dv / C + 4 Hv Dk + 7 Hv Dv + 6 Hk Dk + Hv C + 12 Hv)
    fitted to the peaks an H100 measured with the trainer's strided inputs: 75.5 KiB a row at
    0.8B's heads and 141.5 at 9B's (4.1 a v head between them), 0.87 and 0.95 of this, about
    0.98 at 27B's 48 v heads on that slope (results/h100_q35_t07_27b_fla/). fla 0.6.0's
    allocations read one by one (the state entering each chunk and its gradient; per v head w,
    dw, the WY form's dk, u, the new values, dv twice, the output, its copy of the strided v;
    per k head the L2-normed q and k, dq, dk, its copies of the strided q and k; the chunks' A;
    the gates' fp32 values and gradients) come to 2 (Hv Dk + Hv Dv - Hk Dk) bytes less. Without
    fla (--kernels reference, and the CPU) it is the fp32 reference's autograd through the
    chunked form (bib.gated_delta_rule_backward):
        4 (Hv (9 Dk + 7 Dv + 9 C + 2 Dk Dv / C) + 3 Hk Dk)
    per v head: q and k repeated to it, gathered into chunks, their decayed chunks and W (Dk
    each), v gathered, U, E, the chunks' outputs and their concatenation (Dv each), six C-wide
    chunk matrices a row (decay, k k^T, beta k k^T, A, q k^T, masked), the state entering each
    chunk (Dk Dv / C a row, twice that in one-chunk samples), then the gradients the backward
    adds; per k head the fp32 q and k. Its peak measured on CPU lies at 0.85-1.0 of this
    (tests/test_qwen35_memory.py)."""
    C, Hk, Dk, Hv, Dv = bib.GDN_CHUNK, c.k_heads, c.k_dim, c.v_heads, c.v_dim
    if fla:
        return 2 * (2 * Hv * Dk * Dv // C + 4 * Hv * Dk + 7 * Hv * Dv + 6 * Hk * Dk + Hv * C
                    + 12 * Hv)
    return 4 * (Hv * (9 * Dk + 7 * Dv + 9 * C - (-2 * Dk * Dv // C)) + 3 * Hk * Dk)


def memory_estimate(cfg: Config, args, world: int,
                    prompts: tuple[int, int] = ANY_PROMPT) -> dict[str, float]:
    """Peak bytes per GPU, by holder, and the peak:
        max(s (train - x_train) + x_train, s (rollout - x_rollout) + x_rollout) + fixed,
    train and rollout the sums of each phase's holders, x the experts' bytes in them (which
    get no slack s; under LoRA nothing does: see MEMORY_SLACK).

    trainer state: fp32 master + gradient + AdamW m, v = 16 B/param, sharded over the ranks
    (12: the gradients counted with the activations, where they meet only one micro-batch's);
    bf16 weights: one process casts every weight (kept for the backward); FSDP gathers two
    blocks at a time and the root (embeddings, head) whole, with its bf16 and fp32 gradients;
    activations: what the backward keeps per token and layer (`token_layer_bytes`), plus the
    head's bf16 logits and their gradient on the generated rows or one layer's backward
    (`layer_backward_bytes`), whichever is larger (the head's are freed first); engine: bf16
    weights + KV cache, released while the trainer runs when it sleeps. `trained_rows` bounds
    the rows from the prompts' lengths (see late_gradients too).
    """
    n = count_params(args)
    per_token_layer = token_layer_bytes(args)
    turns = samples_an_episode(cfg, args)
    rows, generated = trained_rows(cfg, world, prompts, turns)
    transient = layer_backward_bytes(args, rows, padded_rows(cfg, world, prompts, turns),
                                     fla=cfg.kernels != "reference")
    root = args.vocab_size * args.dim * (1 if args.enable_weight_tying else 2)
    gathered = 2 * 2 * n / max(args.n_layers, 1) + 8 * root  # two blocks; root bf16 + grads
    a = lora_params(cfg, args)  # LoRA: the trained parameters; the base is the engine's
    est = {
        "trainer state": 16 * (a or n) / world,
        "bf16 weights": 2 * a if a else 2 * n if world == 1 else gathered,
        # the head's logits and their gradient are freed before a layer's backward
        "activations": rows * args.n_layers * per_token_layer
        + max(generated * args.vocab_size * 4, transient)
        + bib.LOGPROB_ROWS * args.vocab_size * 4,
        "engine": 2 * n + kv_cache_bytes(cfg, args, world),
    }
    grads = 0 if a else late_gradients(cfg, world, prompts, turns, n)
    if grads:  # the top layer's backward holds every activation and the head's gradient; the
        # bottom one's, every gradient, its own activations and its transient
        est["trainer state"] -= grads
        est["activations"] = max(est["activations"] + 4 * args.vocab_size * args.dim / world,
                                 grads + rows * per_token_layer + transient)
    if cfg.kl_coef > 0:
        est["reference model"] = 4 * n / world
    if a:  # the reference is the base (adapters off); the engine's weights never sleep
        est.pop("reference model", None)
        est["engine"] -= 2 * n
        est["base weights (the engine's)"] = 2 * n
    train_phase = sum(v for k, v in est.items() if k != "engine" or not cfg.engine_sleep)
    rollout_phase = 12 * (a or n) / world + sum(v for k, v in est.items() if k.startswith(
        ("engine", "base"))) + est.get("reference model", 0)
    e = expert_params(args)  # their bytes in each phase get no slack (see MEMORY_SLACK)
    train_exact = e * ((12 if grads else 16) / world + (2 if world == 1 else 0))  # + bf16 casts
    rollout_exact = e * (12 / world + 2)  # masters and AdamW state + the engine's bf16 copy
    s, fixed = (1, LORA_FIXED) if a else (MEMORY_SLACK, MEMORY_FIXED)  # see MEMORY_SLACK
    est["peak"] = max(s * (train_phase - train_exact) + train_exact,
                      s * (rollout_phase - rollout_exact) + rollout_exact) + fixed
    return est


def layer_backward_bytes(args, rows: int, padded: int, fla: bool = True) -> float:
    """Peak bytes one layer's backward makes beyond what the forward kept, over `rows` trained
    rows (`padded`: the Gated DeltaNet rule's, each sample to whole chunks): a sparse layer's
    grouped experts recompute their inner activations (h, a, W2^T g in fp32, dh and dx a slot,
    the fp32 sum of dx a token: 15.5 KiB a slot measured at Qwen3-30B-A3B's shape), a Gated
    DeltaNet layer its rule (fla's, or the fp32 reference's) and conv (`gdn_backward_bytes`);
    the larger of the two."""
    moe = 0
    if sparse_layers(args):
        m = args.moe_args
        moe = rows * (m.top_k * (14 * args.moe_inter_dim + 2 * args.dim) + 4 * args.dim)
    return max(moe, gdn_backward_bytes(args, padded, fla))


def late_gradients(cfg: Config, world: int, prompts: tuple[int, int], turns: int,
                   n: int) -> float:
    """The fp32 gradients' bytes, 4 n / world for n parameters, where a step's samples always
    fit one micro-batch, else 0. Then the backward makes the gradients as it frees the
    activations, layer by layer from the top, and memory_estimate counts the larger of its two
    ends, not the sum of both (the sum was 1.30x the GPU's use at Qwen3-30B-A3B's 4 layers and
    one micro-batch of 32768 tokens, 58.3 GiB; results/h200_vllm034/). A second micro-batch's
    activations meet the first's gradients."""
    _, sample = episode_bounds(cfg, prompts)
    one = samples_per_rank(cfg, world) * turns * sample <= cfg.micro_batch_tokens
    return 4 * n / world if one else 0


def auto_micro_batch(cfg: Config, args, world: int, total: float,
                     prompts: tuple[int, int] = ANY_PROMPT) -> int:
    """--micro-batch-tokens 0: the largest multiple of 4096 tokens (else 2048 or 1024), up to
    32768, that holds one full sequence, is no larger than a step's tokens need, and whose
    memory estimate fits `total` bytes per GPU; else the smallest (check_memory then names what
    would fit).

    Larger micro-batches run larger GEMMs and fewer kernels per token: on an H200 at 1.7B
    the trainer ran at 44% MFU with 8192 tokens and 48% with 24576.
    """
    # 1024 and 2048 only where no larger size fits (long sequences of a large model)
    sizes = sorted({max(cfg.max_model_len, m) for m in (1024, 2048, *range(4096, 32769, 4096))})
    need_at_most = samples_per_rank(cfg, world) * samples_an_episode(cfg, args) * cfg.max_model_len
    sizes = [m for m in sizes if m < need_at_most + 4096] or sizes[:1]
    fits = [m for m in sizes if memory_estimate(dataclasses.replace(cfg, micro_batch_tokens=m),
                                                args, world, prompts)["peak"] <= total]
    return fits[-1] if fits else sizes[0]


def with_micro_batch(cfg: Config, args, ranks: Ranks,
                     prompts: tuple[int, int] = ANY_PROMPT) -> Config:
    """cfg with --micro-batch-tokens 0 resolved by `auto_micro_batch`, the same on every rank
    (on CPU memory sets no bound)."""
    if cfg.micro_batch_tokens:
        return cfg
    cuda = ranks.device.type == "cuda"
    total = torch.cuda.get_device_properties(ranks.device).total_memory if cuda else math.inf
    mbt = on_rank0(lambda: auto_micro_batch(cfg, args, ranks.world, total, prompts))
    return dataclasses.replace(cfg, micro_batch_tokens=mbt)


def check_memory(cfg: Config, args, ranks: Ranks, prompts: tuple[int, int] = ANY_PROMPT) -> str:
    """Stop before anything slow when the estimate cannot fit this GPU, naming what would;
    else say how much of the GPU the run should fill (for the banner)."""
    total = torch.cuda.get_device_properties(ranks.device).total_memory
    est = memory_estimate(cfg, args, ranks.world, prompts)
    if est["peak"] <= total:
        return f"~{est['peak'] / 2**30:.0f} of {total / 2**30:.0f} GiB per GPU"

    def peak(world=ranks.world, **change):
        return memory_estimate(dataclasses.replace(cfg, **change), args, world, prompts)["peak"]

    options = []
    smaller = [m for m in (cfg.micro_batch_tokens // 2**k for k in range(1, 6))
               if m >= cfg.max_model_len and peak(micro_batch_tokens=m) <= total]
    if smaller:
        options.append(f"--micro-batch-tokens {smaller[0]} (about "
                       f"{peak(micro_batch_tokens=smaller[0]) / 2**30:.0f} GiB)")
    more = [w for w in (2, 4, 8, 16, 32, 64) if w > ranks.world and peak(w) <= total]
    if more:
        options.append(f"`torchrun --nproc-per-node {more[0]} simple_rl.py ...` (about "
                       f"{peak(more[0]) / 2**30:.0f} GiB per GPU)")
    hint = " or ".join(options) or "lower --micro-batch-tokens and --num-prompts"
    parts = ", ".join(f"{k} {v / 2**30:.0f}" for k, v in est.items() if k != "peak")
    raise ConfigError(f"a model of {count_params(args) / 1e9:.2f}B parameters needs about "
                      f"{est['peak'] / 2**30:.0f} GiB per GPU at this config ({parts} GiB, plus "
                      f"the allocator's slack) and this GPU has {total / 2**30:.0f} GiB: run "
                      f"with {hint}.")


def kv_bytes_per_token(args) -> int:
    """2 (K and V) x softmax-attention layers x kv heads x head_dim x 2 (bf16); a Qwen3.5's
    Gated DeltaNet layers hold a state per sequence instead (`gdn_state_bytes`)."""
    return 2 * (args.n_layers - len(gdn_layers(args))) * args.n_kv_heads * args.head_dim * 2


def kv_cache_bytes(cfg: Config, args, world: int) -> int:
    """--kv-cache-gib, or room for every sample of this rank at --max-model-len (no preemption;
    a Qwen3.5's is refused after each generate): samples (L + 16) KV bytes a token, or for a
    Qwen3.5 what vLLM's hybrid allocator needs (`hybrid_kv_cache_bytes`)."""
    if cfg.kv_cache_gib > 0:
        return int(cfg.kv_cache_gib * 2**30)
    if qwen35(args):
        return hybrid_kv_cache_bytes(args, samples_per_rank(cfg, world), cfg.max_model_len)
    return samples_per_rank(cfg, world) * (cfg.max_model_len + 16) * kv_bytes_per_token(args)


def gdn_state_bytes(args) -> int:
    """One sequence's state in one Gated DeltaNet layer of vLLM's cache: the conv's last K - 1
    inputs, (2 Hk Dk + Hv Dv) (K - 1) bf16, and the rule's state, Hv Dv Dk fp32
    (QWEN35_ENGINE_ARGS: mamba_ssm_cache_dtype float32), each rounded up to 16 bytes (vLLM 0.34
    aligns a state to 16 bytes under FlashInfer's ReplaySSM, else to 1: at Qwen3.5's shapes
    the two agree). vLLM 0.34: model_executor/layers/mamba/mamba_utils.py:31-33, 106-118,
    280-301; v1/kv_cache_interface.py:1145-1162."""
    c = qwen35(args)
    conv = (2 * c.k_heads * c.k_dim + c.v_heads * c.v_dim) * (c.conv_kernel - 1) * 2
    return sum(-(-b // 16) * 16 for b in (conv, c.v_heads * c.v_dim * c.k_dim * 4))


# vLLM 0.34's KV block before a hybrid model enlarges it: CacheConfig.DEFAULT_BLOCK_SIZE, which
# FLASH_ATTN keeps (FA3 on Hopper takes any multiple of 16 tokens; FA4's head-256 kernel on
# Blackwell wants 128): config/cache.py:185, v1/attention/backends/flash_attn.py:357-379.
VLLM_BLOCK_TOKENS = 64


def hybrid_kv_cache_bytes(args, samples: int, max_len: int) -> int:
    """The kv_cache_memory_bytes in which vLLM 0.34 holds `samples` Qwen3.5 sequences of up to
    max_len tokens at once. Its hybrid allocator (file:line in vLLM 0.34's package) makes
    blocks of one page per layer of a group, the same page for every layer:
    1. A full-attention page holds b tokens of K and V, b A bytes (A = 2 Hkv D x 2, bf16); a
       Gated DeltaNet page one sequence's state, M bytes (`gdn_state_bytes`). vLLM raises b
       from 64 to the least multiple of 64 whose page holds M, b = 64 ceil(M / 64 A), and pads
       the GDN page to b A (platforms/interface.py:1078-1141); a Qwen3.5-MoE's b holds max_len
       too (`hybrid_block_tokens`).
    2. Each kind's layers fall into groups of g = min(n_full, n_gdn) layers (the larger count
       when below 1.5 the smaller), a kind of n layers in ceil(n / g) groups
       (v1/core/kv_cache_planning.py:567-601); a block is a page of each layer of a group:
       g' b A bytes, g' the largest group (kv_cache_planning.py:621-651).
    3. Given kv_cache_memory_bytes, vLLM skips its profiling and takes them whole (no
       multimodal reservation by default: v1/worker/gpu_worker.py:688-712,
       multimodal/gpu_ipc_memory.py:188-240), as floor(bytes / g' b A) blocks, one of them the
       null block (kv_cache_planning.py:1638-1676, v1/core/block_pool.py:164).
    4. A sequence takes ceil(tokens / b) blocks in each attention group
       (v1/core/single_type_kv_cache_manager.py:219) and one in each GDN group: without prefix
       caching its block spans max_len tokens (model_executor/models/config.py:1111-1118), and
       a Qwen3.5-MoE's one block does too.
       The scheduler keeps tokens <= max_len - 1 (v1/core/sched/scheduler.py:866-873).
    So: (samples (ceil(n_full / g) ceil(max_len / b) + ceil(n_gdn / g)) + 1) g' b A, and for
    a Qwen3.5-MoE at least (1 + ceil(n_full / g) ceil(max_len / b) + 2 ceil(n_gdn / g)) g' b A
    (vLLM's start-up check, below).
    Not yet checked on a GPU: vLLM's block size (it logs "Setting attention block size to b
    tokens") should be b, and its block count (the scheduler's block pool) what these bytes
    give. (A Qwen3.5 without full attention has no page to align to: this gives it up to 64 A
    bytes a layer more than it needs.)"""
    n_gdn = len(gdn_layers(args))
    n_full = args.n_layers - n_gdn
    A = 2 * args.n_kv_heads * args.head_dim * 2
    b = hybrid_block_tokens(args, max_len)
    counts = [n for n in (n_full, n_gdn) if n]
    g = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    block = max(-(-n // -(-n // g)) for n in counts) * b * A  # g' pages
    per_sequence = -(-n_full // g) * -(-max_len // b) + -(-n_gdn // g)
    # vLLM checks at its start that one request fits, with two GDN pages under a prefix cache
    # (v1/kv_cache_interface.py:1168-1172): a Qwen3.5-MoE's, one sample a rank
    one = per_sequence + (-(-n_gdn // g) if sparse_layers(args) else 0)
    return (max(samples * per_sequence, one) + 1) * block


def hybrid_block_tokens(args, max_len: int) -> int:
    """The tokens of vLLM 0.34's KV block for a Qwen3.5 (`hybrid_kv_cache_bytes`, step 1):
    64 ceil(M / 64 A), or for a Qwen3.5-MoE, whose prefix cache is on (qwen35_engine_args),
    max_len rounded up to 128 where that is larger (given as block_size, vLLM keeps it: its
    page holds M, and FA3 takes any multiple of 16). So a long --max-model-len costs a
    Qwen3.5-MoE more: each GDN page is padded to a block's."""
    A = 2 * args.n_kv_heads * args.head_dim * 2
    own = VLLM_BLOCK_TOKENS * -(-gdn_state_bytes(args) // (VLLM_BLOCK_TOKENS * A))
    return max(own, 128 * -(-max_len // 128)) if sparse_layers(args) else own


# vLLM checks at its start that gpu_memory_utilization of the GPU is free, though, given
# kv_cache_memory_bytes, it sizes its KV cache from those bytes alone. So the fraction asks for
# what the engine uses: its bf16 weights, the KV cache, and a margin for its activations, CUDA
# graphs and the CUDA context (a round margin, not a measured one; the fraction stays within
# 0.05 and 0.9).
ENGINE_MARGIN = 6 * 2**30


def engine_memory(cfg: Config, args, ranks: Ranks, lora: bool) -> tuple[dict, int]:
    """VLLMEngine's sizing arguments (its KV cache in bytes, the fraction of the GPU it checks is
    free, the sequences and tokens a step schedules), and the bytes a sleeping engine maps again
    to take a push: weights and KV cache, or under LoRA the KV cache alone (the weights stay
    while the trainer runs: it computes with them)."""
    samples = samples_per_rank(cfg, ranks.world)
    kv = kv_cache_bytes(cfg, args, ranks.world)
    total = torch.cuda.get_device_properties(ranks.device).total_memory
    weights = 2 * count_params(args)
    sizes = dict(kv_cache_memory_bytes=kv,
                 gpu_memory_utilization=min(0.9, max(0.05, (weights + kv + ENGINE_MARGIN) / total)),
                 max_num_seqs=samples,  # every sample decodes in every step
                 max_num_batched_tokens=batched_tokens(cfg, args, samples))
    return sizes, kv if lora else weights + kv


def batched_tokens(cfg: Config, args, samples: int) -> int:
    """The tokens one engine step may schedule: every sample's decode, at least 8192; a
    Qwen3.5's prompt is prefilled whole (QWEN35_ENGINE_ARGS), so the longest fits too, and a
    Qwen3.5-MoE's whole block (qwen35_engine_args)."""
    if qwen35(args) is None:
        return max(samples, 8192)
    return max(samples, 8192, cfg.max_model_len, hybrid_block_tokens(args, cfg.max_model_len))


# ==========================================================================
# Console and environment
# ==========================================================================


# vLLM warnings that simple_rl's settings cause on purpose, or that name a one-time cost: the
# user can do nothing about them. Everything else vLLM warns about is shown.
EXPECTED_VLLM_WARNINGS = (
    "The global random seed is set",  # per-request seeds decide the samples
    "Inductor compilation was disabled",  # on purpose: the trainer mirrors uncompiled ops
    "Using None for EOS token id",  # we pass token ids and stop ids ourselves
    "No FlashInfer autotune cache entries",
    "Triton kernel JIT compilation during inference",  # the backward kernels' first compile
    "Random sampling without an explicit seed",  # vLLM's default parameters; ours are seeded
    "Chat template warmup failed",  # no tokenizer in the engine: we pass token ids
    "FlashInfer's precompiled kernels are missing",  # no FlashInfer kernel runs here
    # a Qwen3.5's prompts are prefilled whole on purpose (QWEN35_ENGINE_ARGS)
    "This model does not officially support disabling chunked prefill",
)


class ExpectedWarnings:
    """A logging filter that drops EXPECTED_VLLM_WARNINGS."""

    @staticmethod
    def filter(record) -> bool:
        return not record.getMessage().startswith(EXPECTED_VLLM_WARNINGS)  # args filled in


def quiet_console(verbose: bool) -> None:
    """vLLM and library logs at WARNING, no progress bars, and no warnings the user cannot act
    on (--verbose: everything)."""
    if verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("FLASHINFER_LOGGING_LEVEL", "warning")  # its autotuner's INFO lines
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # "Generating train split"
    if sys.modules.get("datasets") is not None:  # imported before: it read the variable
        sys.modules["datasets"].disable_progress_bars()
    for module in ("torch", "vllm", "transformers", "torchtitan", "datasets", "triton"):
        warnings.filterwarnings("ignore", module=module)
    import logging

    # torch 2.14 warns at vLLM's import that two of its own APIs are deprecated
    for name in ("torch.distributed", "torch._opaque_base", "torch._library.opaque_object",
                 "torchtitan", "datasets", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_writer_thread() -> None:
    """TensorBoard writes its events from a thread; an error there (a full disk) is raised again
    at the next write or flush in the main thread, where `writing` makes it one sentence: the
    thread's own traceback is not printed."""
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "simple_rl", False):  # installed once per process
        return

    def hook(args):
        if not isinstance(args.thread, _AsyncWriterThread):
            previous(args)

    hook.simple_rl = True
    threading.excepthook = hook


def quiet_vllm(verbose: bool) -> None:
    """Before vLLM sets up its logger (when its engine starts): its console handler drops the
    warnings vLLM is expected to give (the handler's filters are part of vLLM's logging config,
    which it applies afresh at each start)."""
    from vllm import logger

    handler = logger.DEFAULT_LOGGING_CONFIG["handlers"]["vllm"]
    if verbose or "simple_rl" in handler.get("filters", []):
        return
    logger.DEFAULT_LOGGING_CONFIG.setdefault("filters", {})["simple_rl"] = {"()": ExpectedWarnings}
    handler["filters"] = [*handler.get("filters", []), "simple_rl"]


def prepare_environment(cfg: Config) -> None:
    """Before vLLM is imported: CUDA present, the environment parity needs, vLLM importable."""
    need(torch.cuda.is_available(), "no CUDA GPU found; the training job needs one (the tests "
         "run anywhere: see README.md).")
    required = {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_LORA_ENABLE_DUAL_STREAM": "0"}  # "1": LoRA's delta added after, apart
    # vLLM 0.34 has one model runner (V2) and raises on this variable unless it says "1"
    runner = os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if runner not in (None, "1"):
        print0(f"VLLM_USE_V2_MODEL_RUNNER={runner} ignored: vLLM 0.34 has only its V2 model "
               "runner, the one simple_rl's parity is measured on.")
    # cuBLASLt without split-K, as vLLM's batch-invariant mode sets it on Hopper when its engine
    # starts; set here too, before any GEMM, because PyTorch reads it at the first one only.
    os.environ.update(CUBLAS_WORKSPACE_CONFIG=":16:8", CUBLASLT_WORKSPACE_SIZE="1")
    for name, value in required.items():
        if name not in os.environ:
            if cfg.verbose:
                print0(f"{name} is not set; setting {name}={value} before importing vLLM.")
            os.environ[name] = value
        need(os.environ[name] == value, f"{name}={os.environ[name]} breaks bitwise parity; "
             f"unset it or set {name}={value}.")
    try:
        import vllm
    except ImportError as e:
        raise ConfigError("vLLM is not installed; run `pip install -r requirements.txt` "
                          f"({STACK_PINS}).") from e
    need(version_at_least(vllm.__version__, 0, 34), f"vLLM {vllm.__version__} is installed; "
         f"simple_rl computes what vLLM 0.34 computes: run `pip install -r requirements.txt` "
         f"({STACK_PINS}).")
    quiet_vllm(cfg.verbose)


# What requirements.txt installs; a checkpoint records the versions it was made with
STACK_PINS = "vllm==0.34.0, torch==2.14.0, torchtitan==0.2.2"


def version_at_least(version: str, major: int, minor: int) -> bool:
    """'0.34.0+cu130' >= (0, 34): the leading major.minor of a version string, compared."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return bool(found) and (int(found[1]), int(found[2])) >= (major, minor)


# ==========================================================================
# Stops: signals, non-finite numbers, out of memory
# ==========================================================================


class StopRequest:
    """The first Ctrl-C or SIGTERM asks to stop after the current step, last eval or export
    (checkpoint, exit 130 or 143); a second Ctrl-C aborts at once."""

    active: StopRequest | None = None  # the one whose handlers are installed

    def __init__(self):
        self.signal: int | None = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self.handle)
        StopRequest.active = self
        return self

    @staticmethod
    def asked() -> int:
        """The signal a stop was asked with (0: none), read by waits that must not outlast it."""
        return (StopRequest.active and StopRequest.active.signal) or 0

    def handle(self, signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        again = " (Ctrl-C again aborts)" if signum == signal.SIGINT else ""
        print0(f"\n{name}: finishing this step (or the last eval or export), then saving a "
               f"checkpoint{again}.")
        self.signal = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        CallInterrupted.raise_in_call(signum)  # a --reward call in this thread ends now

    def __exit__(self, *exc):
        StopRequest.active = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stops_at(trainer: Trainer, step: int, run_dir: Path, model_dir: Path):
    """A step's faults as a RunStopped with its exit code, naming the last good checkpoint; a
    stop asked while tools ran drops the step and saves the steps done."""
    label = step_label(step, trainer.cfg.steps)
    try:
        yield
    except ToolsStopped as e:
        calls = "tool" if trainer.cfg.env else "reward"
        raise save_and_stop(trainer, run_dir, model_dir, step, e.signum,
                            f"in {label}'s {calls} calls, which were abandoned") from None
    except ToolsStuck as e:
        raise RunStopped(f"{label}: the env ({trainer.cfg.env}) {e}; nothing of this step "
                         f"was applied. Last good checkpoint: {last_good(run_dir)}.",
                         EXIT_REWARD) from None
    except NonFiniteError as e:
        raise nonfinite_stop(e, step, label, run_dir) from e
    except RewardError as e:
        what = (f"env ({trainer.cfg.env})" if trainer.cfg.env else
                f"reward ({trainer.cfg.reward or 'simple_rl.reward'})")
        raise RunStopped(f"{label}: the {what} "
                         f"{e} on {e.where}, completion {e.completion[:80]!r}; nothing of this "
                         f"step was applied. Last good checkpoint: {last_good(run_dir)}.",
                         EXIT_REWARD) from e
    except torch.OutOfMemoryError as e:
        raise oom_stop(trainer, label, run_dir) from e


@contextlib.contextmanager
def starting(device_type: str, memory: str):
    """The engine's start and the trainer's build: out of GPU memory there (PyTorch's error, a
    CUDA call's, or vLLM's refusal when less memory is free than it asks for) is a stop in one
    sentence, exit code 5, saying how much of the GPU was free before (another process may hold
    the rest)."""
    free = torch.cuda.mem_get_info()[0] if device_type == "cuda" else None
    try:
        yield
    except (ValueError, RuntimeError) as e:
        if isinstance(e, (RunStopped, ConfigError)) or not out_of_memory(e):
            raise
        said = " ".join(str(e).split())[:240]
        before = "" if free is None else f"{free / 2**30:.0f} GiB were free before it and "
        raise RunStopped(f"out of GPU memory while starting vLLM and the trainer ({said}); "
                         f"{before}the run needs {memory or 'its estimate'}: free the GPU of "
                         "other processes, or lower --micro-batch-tokens or --kv-cache-gib.",
                         EXIT_OOM) from e


def step_label(step: int, steps: int) -> str:
    """Step `step` (0-based, as checkpoints count the steps done) as the console numbers it:
    step 2 of 4 is 'step 3/4'; a fault after the last step is in the eval after it."""
    return f"step {step + 1}/{steps}" if step < steps else f"the eval after step {steps}"


def last_good(run_dir: Path) -> str:
    found = complete_checkpoints(run_dir)
    return str(found[-1]) if found else "none"


def nonfinite_stop(e: NonFiniteError, step: int, label: str, run_dir: Path) -> RunStopped:
    """The diagnostic file (rank 0's: its episodes, every rank's prompts) and the stop, exit
    code 3."""
    prompts = sorted({p for ps in all_gather_objects(e.prompts) for p in ps})
    diag = run_dir / f"nonfinite_step_{step:06d}.json"
    if is_main():
        with writing(diag):
            diag.write_text(json.dumps(dict(step=step, quantity=e.quantity,
                                            optimizer_step=e.optimizer_step,
                                            samples=e.episodes, prompts=prompts), indent=1))
    return RunStopped(f"{label}: {e}; {e.applied()}. Diagnostic: {diag}. Last good "
                      f"checkpoint: {last_good(run_dir)}.", EXIT_NONFINITE)


def oom_stop(trainer: Trainer, label: str, run_dir: Path) -> RunStopped:
    est = memory_estimate(trainer.cfg, trainer.model.args, trainer.ranks.world,
                          prompt_range(trainer.task, trainer.cfg))["peak"] / 2**30
    return RunStopped(f"out of GPU memory in {label} (estimate {est:.0f} GiB per GPU, for a "
                      "GPU the run has to itself); add GPUs with torchrun --nproc-per-node N or "
                      "lower --micro-batch-tokens. "
                      f"Last good checkpoint: {last_good(run_dir)}.", EXIT_OOM)


def check_finite(logps, loss_total, norm, packed: Packed, optimizer_step: int,
                 optimizer_steps: int) -> None:
    """Raise NonFiniteError on every rank at once (one host sync) if a logprob, the loss or
    the gradient norm is not finite: before the optimizer steps, nothing has changed."""
    finite = torch.stack([torch.isfinite(logps).all(), torch.isfinite(loss_total),
                          torch.isfinite(norm)])
    finite = all_reduce(finite.int(), dist.ReduceOp.MIN).tolist()
    if not all(finite):
        quantity = ["logprobs", "loss", "gradient norm"][finite.index(0)]
        bad = packed.seq[~torch.isfinite(logps.cpu())].unique().tolist()
        every = sorted(set(packed.seq.tolist()))
        raise NonFiniteError(quantity, bad if quantity == "logprobs" else every,
                             optimizer_step, optimizer_steps)


def weights_finite(model: nn.Module, device) -> bool:
    """Every (local shard of every) trained parameter finite, on every rank: one fused pass,
    one sync."""
    local = [local_tensor(p.detach()) for p in model.parameters() if p.requires_grad]
    norms = torch._foreach_norm(local)  # a NaN or Inf anywhere makes its tensor's norm non-finite
    ok = torch.isfinite(torch.stack(norms)).all().int().reshape(1).to(device)
    return bool(all_reduce(ok, dist.ReduceOp.MIN).item())


def after_step(stop: StopRequest, trainer: Trainer, run_dir: Path, model_dir: Path, step: int,
               parity: Parity) -> None:
    """Between two steps: --strict-parity stops at a step with a differing token (RunStopped,
    exit 4), a Ctrl-C or SIGTERM saves and stops, and every --save-every steps a checkpoint."""
    if trainer.cfg.strict_parity and (parity.n_mismatch or parity.routing_mismatch):
        raise RunStopped(f"--strict-parity: {step_label(step, trainer.cfg.steps)} has "
                         f"{parity.n_mismatch} mismatched "
                         f"tokens and {parity.routing_mismatch} routed to other experts.",
                         EXIT_PARITY)
    stop_if_asked(stop, trainer, run_dir, model_dir, step + 1,
                  f"after {step_label(step, trainer.cfg.steps)}")
    if trainer.cfg.save_every and (step + 1) % trainer.cfg.save_every == 0:
        print0(f"saving checkpoint step_{step + 1:06d}")
        save_checkpoint(run_dir, trainer, step + 1, model_dir)


def finish(stop: StopRequest, trainer: Trainer, metrics_log, run_dir: Path,
           model_dir: Path) -> str:
    """After the last step: the held-out eval (where due) and the final export; its sha256. A
    Ctrl-C or SIGTERM during the eval saves and stops before the export; one during the export
    lets it finish whole, then saves and stops."""
    cfg = trainer.cfg
    if eval_due(cfg, cfg.steps):
        with stops_at(trainer, cfg.steps, run_dir, model_dir):
            final = evaluate(trainer, cfg.steps)
        log_row(metrics_log, {"step": cfg.steps, **final})
        print0(f"held-out accuracy after {cfg.steps} steps: {final['eval/accuracy']:.3f}"
               f" ({len(trainer.task.eval_problems)} problems, greedy)")
    stop_if_asked(stop, trainer, run_dir, model_dir, cfg.steps,
                  "after the last step, before the final export")
    digest = export_final(trainer, run_dir, model_dir)
    stop_if_asked(stop, trainer, run_dir, model_dir, cfg.steps,
                  f"after the final export ({export_dir(cfg, run_dir)})")
    return digest


def stop_if_asked(stop: StopRequest, trainer: Trainer, run_dir: Path, model_dir: Path,
                  next_step: int, when: str) -> None:
    """After a Ctrl-C or SIGTERM on any rank, every rank saves the steps done and stops (the
    RunStopped of save_and_stop); else nothing."""
    asked = signal_on_any_rank(stop, trainer.ranks.device)
    if asked:
        raise save_and_stop(trainer, run_dir, model_dir, next_step, asked, when)


def signal_on_any_rank(stop: StopRequest, device) -> int:
    """The Ctrl-C or SIGTERM any rank received (0: none): every rank stops together."""
    return int(all_reduce(torch.tensor([stop.signal or 0], device=device), dist.ReduceOp.MAX))


def save_and_stop(trainer: Trainer, run_dir: Path, model_dir: Path, next_step: int, asked: int,
                  when: str) -> RunStopped:
    """After a signal: the checkpoint of the steps done, and the stop (exit 130 or 143)."""
    print0(f"saving checkpoint step_{next_step:06d}")
    ckpt = save_checkpoint(run_dir, trainer, next_step, model_dir)
    code = EXIT_TERMINATED if asked == signal.SIGTERM else EXIT_INTERRUPTED
    return RunStopped(f"stopped {when}; checkpoint {ckpt}; continue with --resume {ckpt}", code)


# ==========================================================================
# Parity debugger: trainer vs vLLM's own model, op by op, on one episode
# ==========================================================================
# Trainer module (per layer) -> the vLLM module of the same role, in execution order. Both
# sides are recorded by forward hooks. vLLM shares one rotary module across layers, so the
# rotation is checked through `attn`.
TRACED = {"attention_norm": "input_layernorm", "attention.wqkv": "self_attn.qkv_proj",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
          "attention.attn": "self_attn.attn", "attention.wo": "self_attn.o_proj",
          "ffn_norm": "post_attention_layernorm", "feed_forward.w13": "mlp.gate_up_proj",
          "feed_forward.act_fn": "mlp.act_fn", "feed_forward.w2": "mlp.down_proj"}


# A Qwen3-MoE sparse layer's MLP, in place of the dense MLP's three. vLLM's top-k is no module:
# `recording` catches its router's select_experts (weights, ids), as TopK returns them.
MOE_TRACED = {"moe.router.gate": "mlp.gate", "moe.topk": "mlp.experts.router",
              "moe.experts": "mlp.experts"}


def trace_names(n_layers: int, sparse: tuple[int, ...] = ()) -> list[tuple[str, str]]:
    """(trainer module, vLLM module) for every traced op, in execution order."""
    names = []
    for i in range(n_layers):
        ops = list(TRACED.items())
        if i in sparse:
            ops = [op for op in ops if not op[0].startswith("feed_forward.")]
            ops += list(MOE_TRACED.items())
        names += [(f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}") for ours, theirs in ops]
    return names + [("norm", "model.norm")]


@contextlib.contextmanager
def recording(model: nn.Module, names: dict[str, str]):
    """Forward hooks on the named modules: every call appends its output tensors.

    Yields {key: [[tensors of call 1], [tensors of call 2], ...]}; names maps module -> key.
    """
    calls: dict[str, list[list[torch.Tensor]]] = {}

    def hook_for(key):
        def hook(_module, _inputs, out):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            tensors = [o.detach().clone() for o in outs if isinstance(o, torch.Tensor)]
            calls.setdefault(key, []).append(tensors)
        return hook

    handles = [module.register_forward_hook(hook_for(names[name]))
               for name, module in model.named_modules() if name in names]
    routers = []  # vLLM's MoE routers: no modules; their select_experts gives (weights, ids)
    for name, module in model.named_modules():
        router = getattr(module, "router", None)
        if f"{name}.router" in names and hasattr(router, "select_experts"):
            router.select_experts = recorded_call(router.select_experts,
                                                  hook_for(names[f"{name}.router"]))
            routers.append(router)
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
        for r in routers:
            del r.select_experts  # the class's method again


def recorded_call(fn: Callable, hook: Callable) -> Callable:
    """fn, whose every result is also handed to a forward hook (for methods that are no forward)."""
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        hook(None, args, out)
        return out
    return call


def concat_calls(calls: dict[str, list[list[torch.Tensor]]]) -> dict[str, list[torch.Tensor]]:
    """Rows of every call (prefill, then each decode step) joined: one trace per op."""
    return {k: [torch.cat(parts) for parts in zip(*v)] for k, v in calls.items()}


def compare_traces(ours: dict[str, list[torch.Tensor]], theirs: dict[str, list[torch.Tensor]],
                   order: list[str]) -> list[dict]:
    """Per op: elements that differ bitwise, and the max |delta| (tensors seen as (rows, -1))."""
    rows = []
    for name in (n for n in order if n in ours and n in theirs):
        pairs = [(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))
                 for a, b in zip(ours[name], theirs[name])]
        if any(a.shape != b.shape for a, b in pairs):
            shapes = [(tuple(a.shape), tuple(b.shape)) for a, b in pairs]
            rows.append(dict(op=name, n_diff=-1, numel=0, max_abs=float("nan"),
                             note=f"shapes differ: {shapes}"))
            continue
        differ = [(a != b) for a, b in pairs]
        rows.append(dict(op=name, n_diff=sum(int(d.sum()) for d in differ),
                         numel=sum(a.numel() for a, _ in pairs),
                         max_abs=max(float((a.float() - b.float()).abs().max()) for a, b in pairs),
                         rows=sorted({int(i) for d in differ
                                      for i in d.any(-1).nonzero()[:, 0].tolist()})[:8]))
    return rows


def first_divergence(rows: list[dict]) -> str | None:
    return next((r["op"] for r in rows if r["n_diff"] != 0), None)


def first_episode(trainer: Trainer) -> Episode:
    """Step 0's first episode (its first problem's sample 0), played as the run plays it."""
    cfg = trainer.cfg
    j = step_problems(len(trainer.task.problems), cfg.num_prompts, 0, cfg.seed)[0]

    def one() -> Episode:
        envs, prompts = new_episodes(trainer, [trainer.task.problems[j]],
                                     [trainer.task.prompt_ids[j]], 1)
        outs = trainer.engine.generate(prompts, 1, [request_seed(cfg, 0, 0)],
                                       [turn_tokens(cfg, prompts[0])], cfg.temperature)
        episodes = start_episodes(envs, prompts, outs, cfg)
        play(trainer.engine, trainer.tokenizer, cfg, episodes,
             lambda _, turn: turn_seed(cfg, 0, 0, 0, turn), cfg.temperature)
        return episodes[0]

    with failing_together(trainer, lambda _: f"sample 0 of training problem {j}"):
        return one()


def print_debug_parity(trainer: Trainer) -> None:
    """--debug-parity: debug_parity on step 0's first episode, its table and counts printed."""
    rows, n_bad, turns = debug_parity(trainer.engine, trainer.model,
                                      lambda: first_episode(trainer))
    print0(format_debug(rows))
    print0(f"{len(turns)} turn(s); rows vLLM computed (prefix-cache hits) per turn: "
           + ", ".join(f"{n} ({c})" for n, c in turns))
    print0(f"generated-token logprobs that differ: {n_bad}")


def debug_parity(engine: VLLMEngine, model: Qwen3, play_one: Callable[[], Episode]
                 ) -> tuple[list[dict], int, list[tuple[int, int]]]:
    """Trainer vs vLLM on one episode, op by op, over every row vLLM computed in every turn.

    play_one plays the episode through `engine`, a turn per engine.generate. vLLM computes a
    turn's rows as a prefill of what its prefix cache lacks, then a row per decode step; the
    trainer computes the whole episode in one forward. So turn k's rows are the trainer's at
    positions c_k .. P_k + g_k - 2 (c_k: prefix-cache hits, P_k: the prefix's length, g_k: the
    turn's ids; its last id is never fed). Returns the per-op rows (print with `format_debug`),
    how many generated tokens' logprobs differ, and per turn (rows computed, cached tokens).
    """
    names = trace_names(model.args.n_layers, sparse_layers(model.args))
    episode, calls, starts, cached = traced_episode(engine.llm, {v: k for k, v in names},
                                                    play_one)
    rollout = episodes_rollout([episode], routes=False)
    full = pack(rollout.prompts, rollout.completions, rollout.generated)
    # vLLM never feeds the last sampled token: drop it from the trainer's input too
    fed = dataclasses.replace(full, tokens=full.tokens[:-1], positions=full.positions[:-1],
                              cu_seqlens=full.cu_seqlens - torch.tensor([0, 1], dtype=torch.int32),
                              max_seqlen=full.max_seqlen - 1)
    with recording(model, {ours: ours for ours, _ in names}) as ours_calls, torch.no_grad():
        logp, _ = model(fed.to(model.norm.weight.device), engine.cfg.temperature)
    rows, turns, end = [], [], 0
    for k, turn in enumerate(episode.turns):
        first, end = cached[k], end + len(turn.context) + len(turn.out.ids)
        rows.append(torch.arange(first, end - 1))
        turns.append((end - 1 - first, first))
    # a turn's calls: its prefill and decode steps, then (async scheduling, vLLM's default) one
    # step past a stop it had not seen yet, whose rows have no trainer counterpart
    first_op = next(iter(calls.values()))  # the first op vLLM ran: every call's row count
    got = [sum(len(c[0]) for c in first_op[a:b]) for a, b in zip(starts, starts[1:])]
    need(all(n <= r <= n + 1 for r, (n, _) in zip(got, turns)),
         f"--debug-parity: vLLM computed {got} rows in the episode's turns where "
         f"{[n for n, _ in turns]} (or one more) were expected; it scheduled them otherwise.")
    theirs = {}
    for key, v in calls.items():
        per_turn = [[torch.cat(parts)[:n] for parts in zip(*v[a:b])]
                    for (n, _), a, b in zip(turns, starts, starts[1:])]
        theirs[key] = [torch.cat(outs) for outs in zip(*per_turn)]
    at = torch.cat(rows)
    ours = {key: [t[at.to(t.device)] for t in ts] for key, ts in concat_calls(ours_calls).items()}
    want = rollout.logprobs.view(torch.int32)
    n_bad = int((want != logp.cpu().view(torch.int32)).sum())
    return compare_traces(ours, theirs, [n for n, _ in names]), n_bad, turns


def traced_episode(llm, modules: dict[str, str], play_one: Callable[[], Episode]):
    """play_one() with vLLM's modules (vLLM name -> key) recorded: (the episode, the calls by
    key, the index of each turn's first call and one past the last, each turn's cache hits)."""
    llm.reset_prefix_cache()  # the first turn prefills its whole prompt
    stack = contextlib.ExitStack()  # vLLM's model is reached inside the engine, by apply_model
    calls = llm.apply_model(lambda m: stack.enter_context(recording(m, modules)))[0]
    starts, cached = [], []  # per turn: forward calls recorded before it; its cache hits

    def counted(*args, **kwargs):  # llm.generate, noting each turn's calls and cache hits
        starts.append(max(map(len, calls.values()), default=0))
        outs = generate(*args, **kwargs)
        cached.append(outs[0].num_cached_tokens or 0)
        return outs

    generate, llm.generate = llm.generate, counted
    try:
        episode = play_one()
    finally:
        stack.close()
        del llm.generate  # the class's method again
    need(calls, "--debug-parity: no vLLM module has a name it traces (has vLLM's model changed?)")
    return episode, calls, starts + [max(map(len, calls.values()))], cached


def format_debug(rows: list[dict]) -> str:
    lines = [f"{'op':<36} {'differ':>10} {'of':>10} {'max |delta|':>12}"]
    for r in rows:
        lines.append(f"{r['op']:<36} {r['n_diff']:>10} {r['numel']:>10} {r['max_abs']:>12.3g} "
                     f"{r.get('note', '')}{r.get('rows') or ''}")
    first = first_divergence(rows)
    lines.append(f"first divergence: {first}" if first else
                 "no divergence: every traced op is bitwise equal")
    return "\n".join(lines)


# ==========================================================================
# The entry point: main (exit codes) and run (setup, then train; the run directory's lock)
# ==========================================================================


def run(cfg: Config, passed: set[str] = frozenset(), engine_factory=None,
        device_type: str = "cuda") -> str:
    """The whole job; returns the sha256 of its export (under LoRA by default the adapter; ""
    after --check or --debug-parity). The run directory's lock is released however it ends."""
    held = set(RUN_LOCKS)  # the run directories this process had locked before
    try:
        built = setup(cfg, passed, engine_factory, device_type)
        if built is None:  # --check
            return ""
        trainer, start, run_dir, model_dir = built  # a hub model's: its local copy
        if trainer.cfg.debug_parity:  # op by op on one episode, printed; no step
            print_debug_parity(trainer)
            return ""
        return train(trainer, start, run_dir, model_dir)
    finally:
        for locked in set(RUN_LOCKS) - held:
            release_run_dir(locked)


def main(argv: list[str] | None = None, engine_factory=None, device_type: str = "cuda") -> int:
    try:
        cfg, passed = parse_config(argv)
    except SystemExit as e:  # --help, or a flag argparse refused (said in one line)
        return int(e.code or 0)
    quiet_console(cfg.verbose)
    try:
        validate(cfg)
        run(cfg, passed, engine_factory, device_type)
    except (ConfigError, RunStopped) as e:  # bad input (exit 2), or a stop and its exit code
        said = f"simple_rl: {'error: ' if isinstance(e, ConfigError) else ''}{e}"
        if is_main():
            print(said, file=sys.stderr)
        tell_torchrun(said)
        return e.code if isinstance(e, RunStopped) else 2
    finally:
        end_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
