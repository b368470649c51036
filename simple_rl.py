"""simple_rl: bitwise-deterministic GRPO for Qwen3, with vLLM rollouts.

One file, in data-flow order:

    config -> load & convert -> model -> rollout -> reward -> advantages -> loss
           -> parity check -> weight push -> training loop -> main

vLLM samples `group_size` completions per prompt in batch-invariant mode. The
trainer is a TorchTitan-style Qwen3 whose forward calls *the same kernels* vLLM
calls (Triton RMSNorm / matmul / log_softmax, CUDA fused-add-RMSNorm, rotary and
SiluAndMul, FlashAttention 3 with num_splits=1); `batch_invariant_backward.py`
adds their backward. So the trainer's logprob of every generated token equals
vLLM's bit for bit, and every step checks that for every token of every sample.

The objective (GRPO, token-level, one sample i of group g, token t):

    A_i      = (r_i - mean_g r) / (std_g r + eps)          (or r_i - mean_g r)
    rho_it   = exp(logp_theta(y_it) - logp_rollout(y_it))
    pg_it    = -min(rho_it A_i, clip(rho_it, 1 - eps_c, 1 + eps_c) A_i)
    kl_it    = exp(q_it) - q_it - 1,  q_it = logp_ref(y_it) - logp_theta(y_it)   (k3 estimator)
    L        = sum_it (pg_it + beta kl_it - c_H H_it) / (number of generated tokens in the batch)

Departures from textbook GRPO/PPO:
  * The old policy is the rollout policy itself, as computed *by vLLM*. Because
    the trainer reproduces vLLM's numbers exactly, rho = 1 at the first update,
    so the clip only acts with `updates_per_batch` > 1.
  * Logprobs are those of the *sampling* distribution softmax(logits / T):
    vLLM runs with logprobs_mode="processed_logprobs" and the trainer divides its
    fp32 logits by T exactly as vLLM's sampler does, so parity holds at any T
    (at T = 1 the division is exact and the raw logprobs are compared).
  * The loss is a token mean over the whole batch (every token weighs the same).
  * The trainer keeps fp32 master weights and computes in bf16; vLLM receives
    the bf16 cast, which is exactly what the trainer computes with.

Run (GPU, vLLM 0.26 + TorchTitan 0.2.2):

    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model Qwen/Qwen3-1.7B --steps 20
    tensorboard --logdir runs
    python simple_rl.py --resume latest --run-name <run> --steps 40     # continue a run
    python simple_rl.py --model DIR --debug-parity                       # where do we differ?

Tests (any machine):

    python -m pip install -q -r requirements-cpu.txt && python -m pytest -q
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

import batch_invariant_backward as bib

# ==========================================================================
# Config
# ==========================================================================


def opt(default, help: str):
    """A Config field whose help text drives --help."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # --- model
    model: str = opt("Qwen/Qwen3-1.7B", "HF hub id or local directory with config.json + *.safetensors")
    dtype: str = opt("bfloat16", "compute dtype of trainer and vLLM (bfloat16, or float32 for CPU tests)")
    kernels: str = opt("auto", "auto (= vllm), vllm (batch-invariant GPU kernels) or reference (plain PyTorch, not bitwise)")
    # --- rollout
    task: str = opt("arithmetic", "arithmetic (embedded, no download) or gsm8k (needs `datasets` and a network)")
    num_prompts: int = opt(16, "prompts per step")
    group_size: int = opt(8, "completions sampled per prompt (G)")
    max_new_tokens: int = opt(256, "max tokens generated per completion")
    temperature: float = opt(1.0, "sampling temperature; logprobs are those of softmax(logits / T)")
    max_model_len: int = opt(1024, "vLLM max sequence length (prompt + completion)")
    gpu_memory_utilization: float = opt(0.3, "fraction of GPU memory vLLM may take")
    cuda_graphs: bool = opt(True, "replay vLLM's decode steps as CUDA graphs (the same kernels, fewer launches)")
    # --- grpo
    clip_eps: float = opt(0.2, "PPO clip range eps_c")
    kl_coef: float = opt(0.0, "beta of the k3 KL to the frozen initial policy (0: no reference model)")
    entropy_coef: float = opt(0.0, "c_H, entropy bonus (entropy is always logged)")
    std_normalize: bool = opt(True, "divide advantages by the group std (off: mean-only)")
    adv_eps: float = opt(1e-6, "eps in (r - mean) / (std + eps)")
    updates_per_batch: int = opt(1, "optimizer steps per rollout batch (>1 makes the PPO clip act)")
    # --- optim
    steps: int = opt(10, "training steps (rollout + update + weight push)")
    lr: float = opt(1e-6, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.999, "AdamW beta2")
    grad_clip: float = opt(1.0, "max global grad norm (0: off)")
    micro_batch_tokens: int = opt(8192, "max packed tokens per trainer forward/backward")
    # --- logging / output
    seed: int = opt(0, "seed for prompts, sampling and everything else")
    log_dir: str = opt("runs", "TensorBoard root; this run logs to <log_dir>/<run_name>")
    run_name: str = opt("", "run name (default: time stamp)")
    output_dir: str = opt("", "where the final HF checkpoint goes (default: <log_dir>/<run_name>/final)")
    parity_rows: int = opt(8, "rows of the per-step parity table (the first tokens, or the first that differ)")
    strict_parity: bool = opt(False, "stop at the first step whose logprobs are not bitwise equal")
    debug_parity: bool = opt(False, "compare trainer and vLLM op by op on one generated sequence, print where they diverge, exit")
    # --- checkpoints
    save_every: int = opt(10, "save a checkpoint every N steps (0: only on Ctrl-C)")
    keep_last: int = opt(3, "checkpoints to keep")
    resume: str = opt("", "continue from a checkpoint directory, or 'latest'")
    overwrite: bool = opt(False, "allow writing over an existing run directory / --output-dir")


class ConfigError(ValueError):
    """Bad user input: reported as one sentence, without a traceback."""


def parse_config(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(flag, dest=f.name, type=kind, default=f.default, help=f.metadata["help"])
    return Config(**vars(p.parse_args(argv)))


def validate(cfg: Config) -> None:
    """Every check on the config alone, in one place. Checks that need the checkpoint live in load."""
    checks = [
        (cfg.group_size >= 2, f"--group-size must be at least 2 (got {cfg.group_size}): GRPO normalises rewards within a group."),
        (cfg.num_prompts >= 1, f"--num-prompts must be at least 1 (got {cfg.num_prompts})."),
        (cfg.max_new_tokens >= 1, f"--max-new-tokens must be at least 1 (got {cfg.max_new_tokens})."),
        (cfg.temperature > 0, f"--temperature must be > 0 (got {cfg.temperature}); greedy decoding has no policy gradient."),
        (cfg.max_new_tokens < cfg.max_model_len, f"--max-new-tokens ({cfg.max_new_tokens}) leaves no room for a prompt in --max-model-len ({cfg.max_model_len})."),
        (cfg.clip_eps > 0, f"--clip-eps must be > 0 (got {cfg.clip_eps})."),
        (cfg.kl_coef >= 0 and cfg.entropy_coef >= 0, "--kl-coef and --entropy-coef must be >= 0."),
        (cfg.updates_per_batch >= 1 and cfg.steps >= 0, "--updates-per-batch must be >= 1 and --steps >= 0."),
        (cfg.lr > 0 and cfg.grad_clip >= 0, "--lr must be > 0 and --grad-clip >= 0."),
        (cfg.micro_batch_tokens >= cfg.max_model_len, f"--micro-batch-tokens ({cfg.micro_batch_tokens}) must hold one full sequence (--max-model-len {cfg.max_model_len})."),
        (cfg.dtype in DTYPES, f"--dtype must be one of {sorted(DTYPES)} (got {cfg.dtype!r})."),
        (cfg.kernels in ("auto", "vllm", "reference"), f"--kernels must be auto, vllm or reference (got {cfg.kernels!r})."),
        (cfg.task in TASKS, f"--task must be one of {sorted(TASKS)} (got {cfg.task!r})."),
        (0 < cfg.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]."),
        (cfg.save_every >= 0 and cfg.keep_last >= 1, "--save-every must be >= 0 and --keep-last >= 1."),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if looks_like_path(cfg.model) and not Path(cfg.model).expanduser().is_dir():
        raise ConfigError(f"--model {cfg.model!r} is not a directory.")


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or name.count("/") != 1


# ==========================================================================
# Load & convert: HF Qwen3 checkpoint <-> trainer (vLLM layout)
# ==========================================================================

# The trainer holds weights as vLLM's Qwen3 layers do: q/k/v fused into one
# projection, gate/up fused into one. TorchTitan's adapter maps HF <-> TorchTitan
# names; this table fuses TorchTitan's parts (concatenated on dim 0, in order).
FUSED = {
    "attention.wqkv.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "feed_forward.w13.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json")


def resolve_checkpoint(name: str) -> Path:
    """A local directory as is; otherwise a hub id, fetched (weights, config, tokenizer) into the HF cache."""
    if looks_like_path(name):
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt"]))
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ConfigError(f"could not fetch {name!r} from the Hugging Face hub ({type(e).__name__}); pass a local directory with --model.") from e


def read_qwen3_config(path: Path):
    """The HF config, after checking it describes a dense Qwen3 this script supports."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} has no config.json; --model must be a Hugging Face checkpoint directory.")
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if raw.get("model_type") != "qwen3" or (archs and "Qwen3ForCausalLM" not in archs):
        raise ConfigError(f"{path} holds a {raw.get('model_type')!r} model ({', '.join(archs) or 'no architectures'}); simple_rl trains dense Qwen3 (Qwen3ForCausalLM) only.")
    hf = AutoConfig.from_pretrained(path)
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default"}
    if hf.hidden_act != "silu" or getattr(hf, "attention_bias", False) or rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{path}: only silu MLPs, bias-free attention and default RoPE are supported.")
    return hf


def model_args_from_hf(hf):
    """TorchTitan's Qwen3ModelArgs from an HF Qwen3Config."""
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    rope = getattr(hf, "rope_parameters", None) or {}
    return Qwen3ModelArgs(
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads,
        vocab_size=hf.vocab_size,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        hidden_dim=hf.intermediate_size,
        norm_eps=hf.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(hf, "rope_theta", 1e6)),
        max_seq_len=hf.max_position_embeddings,
        enable_weight_tying=bool(hf.tie_word_embeddings),
    )


def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, on CPU."""
    from safetensors.torch import load_file

    state = {}
    for f in weight_files(path):
        state.update(load_file(path / f))
    return state


def weight_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights (.bin checkpoints are not supported; re-save with safe_serialization=True).")
    return files


def _adapter(args):
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(args, None)


def hf_to_trainer(hf_state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """HF names -> TorchTitan names (TorchTitan's adapter) -> fused vLLM-layout projections."""
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    titan = _adapter(args).from_hf(hf_state)
    if args.enable_weight_tying:
        titan.pop("output.weight", None)  # tied: the trainer reads tok_embeddings.weight
    try:
        for i in range(args.n_layers):
            for fused, parts in FUSED.items():
                titan[f"layers.{i}.{fused}"] = torch.cat([titan.pop(f"layers.{i}.{p}") for p in parts], dim=0)
    except (KeyError, RuntimeError) as e:
        raise ConfigError(f"the checkpoint's weights do not match its config.json ({type(e).__name__}: {e}).") from e
    return titan


def trainer_to_hf(state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_trainer: split the fused projections, then TorchTitan's adapter to HF names."""
    titan = dict(state)
    sizes = {
        "attention.wqkv.weight": [args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.n_kv_heads * args.head_dim],
        "feed_forward.w13.weight": [args.hidden_dim, args.hidden_dim],
    }
    for i in range(args.n_layers):
        for fused, parts in FUSED.items():
            for name, piece in zip(parts, titan.pop(f"layers.{i}.{fused}").split(sizes[fused], dim=0)):
                titan[f"layers.{i}.{name}"] = piece
    return _adapter(args).to_hf(titan)


def save_hf_checkpoint(out: Path, hf_state: dict[str, torch.Tensor], source: Path) -> None:
    """config + model.safetensors + tokenizer files: loadable by transformers and vLLM."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in hf_state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = str(next(iter(hf_state.values())).dtype).removeprefix("torch.")  # what the file holds now
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def weights_sha256(hf_state: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(hf_state):
        t = hf_state[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ==========================================================================
# Model: Qwen3 that computes exactly what vLLM computes
# ==========================================================================


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm, self.k_norm = Norm(args.head_dim), Norm(args.head_dim)


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # [gate; up], as vLLM's gate_up_proj
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm, self.ffn_norm = Norm(args.dim), Norm(args.dim)
        self.attention, self.feed_forward = Attention(args), FeedForward(args)


class Qwen3VLLMCompatModel(nn.Module):
    """Qwen3 with TorchTitan names and vLLM's fused layout, run op by op as vLLM runs it.

    Parameters are fp32 masters; each forward casts them to the compute dtype, so
    the bf16 weights it computes with are exactly those pushed into vLLM.
    """

    def __init__(self, args, kernels: bib.Kernels, compute_dtype: torch.dtype):
        super().__init__()
        self.args, self.kernels, self.compute_dtype = args, kernels, compute_dtype
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = Norm(args.dim)
        self.output = None if args.enable_weight_tying else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.cos_sin = None  # (max_seq_len, head_dim), built by init_buffers once weights are on a device
        self.trace: dict[str, list[torch.Tensor]] | None = None  # set by the parity debugger

    def record(self, name: str, *tensors: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace[name] = [t.detach() for t in tensors]

    def init_buffers(self, device) -> None:
        self.cos_sin = bib.rope_cos_sin_cache(self.args.head_dim, self.args.rope_theta, self.args.max_seq_len, device, self.compute_dtype)

    def w(self, p: torch.Tensor) -> torch.Tensor:
        return p.to(self.compute_dtype)

    def attention(self, i: int, a: Attention, x, positions, cu_seqlens, max_seqlen):
        k, T, D = self.kernels, x.shape[0], a.head_dim
        qkv = k.linear(x, self.w(a.wqkv.weight))  # (T, (Hq + 2 Hk) D)
        q, kk, v = qkv.split([a.n_heads * D, a.n_kv_heads * D, a.n_kv_heads * D], dim=-1)
        q = k.rms_norm(q.view(T, a.n_heads, D), self.w(a.q_norm.weight), self.args.norm_eps)  # (T, Hq, D)
        kk = k.rms_norm(kk.view(T, a.n_kv_heads, D), self.w(a.k_norm.weight), self.args.norm_eps)  # (T, Hk, D)
        self.record(f"layers.{i}.qkv_proj", qkv), self.record(f"layers.{i}.q_norm", q), self.record(f"layers.{i}.k_norm", kk)
        q, kk = k.rotary(q, kk, positions, self.cos_sin)
        o = k.attention(q, kk, v.reshape(T, a.n_kv_heads, D).contiguous(), cu_seqlens, max_seqlen, D**-0.5)  # (T, Hq, D)
        out = k.linear(o.reshape(T, -1), self.w(a.wo.weight))  # (T, dim)
        self.record(f"layers.{i}.attn", o), self.record(f"layers.{i}.o_proj", out)
        return out

    def forward(self, tokens, positions, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """Packed varlen forward: tokens/positions (T,), cu_seqlens (B+1,) -> final hidden states (T, dim)."""
        k, eps = self.kernels, self.args.norm_eps
        h = self.w(self.tok_embeddings.weight[tokens])  # (T, dim); gather first: its grad accumulates in fp32
        residual = None
        for i, layer in enumerate(self.layers):  # vLLM's order: the residual add is fused into the next norm
            if residual is None:
                h, residual = k.rms_norm(h, self.w(layer.attention_norm.weight), eps), h
                self.record(f"layers.{i}.input_layernorm", h)
            else:
                h, residual = k.add_rms_norm(h, residual, self.w(layer.attention_norm.weight), eps)
                self.record(f"layers.{i}.input_layernorm", h, residual)
            h = self.attention(i, layer.attention, h, positions, cu_seqlens, max_seqlen)
            h, residual = k.add_rms_norm(h, residual, self.w(layer.ffn_norm.weight), eps)
            ff = layer.feed_forward
            gate_up = k.linear(h, self.w(ff.w13.weight))  # (T, 2 I)
            act = k.silu_and_mul(gate_up)  # (T, I)
            self.record(f"layers.{i}.post_attention_layernorm", h, residual)
            h = k.linear(act, self.w(ff.w2.weight))
            self.record(f"layers.{i}.gate_up_proj", gate_up), self.record(f"layers.{i}.act_fn", act), self.record(f"layers.{i}.down_proj", h)
        h, _ = k.add_rms_norm(h, residual, self.w(self.norm.weight), eps)
        self.record("norm", h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, V) in the compute dtype, through the tied or untied head."""
        head = self.tok_embeddings if self.output is None else self.output
        return self.kernels.linear(h, self.w(head.weight))

    def token_logprobs(self, h, targets, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, dim) -> log softmax(logits / T)[target] and entropy, fp32 (N,), as vLLM's sampler computes them."""
        return self.kernels.logprobs_entropy(self.logits(h), targets, temperature)


def build_model(args, state: dict[str, torch.Tensor], kernels: bib.Kernels, dtype, device) -> Qwen3VLLMCompatModel:
    """Build on the meta device and load fp32 masters with assign=True: never materialised twice."""
    with torch.device("meta"):
        model = Qwen3VLLMCompatModel(args, kernels, dtype)
    try:
        model.load_state_dict({k: v.to(device=device, dtype=torch.float32, copy=True) for k, v in state.items()}, strict=True, assign=True)
    except RuntimeError as e:  # missing, unexpected or mis-shaped tensors
        detail = " ".join(line.strip() for line in str(e).splitlines()[1:3])
        raise ConfigError(f"the checkpoint's weights do not match its config.json: {detail}") from e
    model.init_buffers(device)
    return model


def model_hf_state(model: Qwen3VLLMCompatModel) -> dict[str, torch.Tensor]:
    """The weights the trainer computes with (compute dtype), under HF names."""
    return trainer_to_hf({k: model.w(v.detach()) for k, v in model.state_dict().items()}, model.args)


# ==========================================================================
# Rollout: vLLM engine, sampling, packing
# ==========================================================================


@dataclass
class Rollout:
    prompts: list[list[int]]  # one per sample (each prompt repeated G times)
    completions: list[list[int]]  # sampled token ids
    logprobs: torch.Tensor  # (N,) fp32, vLLM's logprob of every generated token, samples concatenated
    stopped: list[bool]  # ended at EOS (False: hit max_new_tokens)


def route_vllm_add_rms_norm_through_row_chunks() -> None:
    """Make the engine's fused add+RMSNorm calls row-count invariant, exactly as the trainer's are.

    vLLM 0.26's batch-invariant RMSNorm hands a residual add to a CUDA kernel whose reduction
    order changes at 256 rows (bib.ADD_RMS_NORM_ROWS). The engine runs in this process, so
    replacing the function its RMSNorm layers call is enough: every row is then normalised by a
    call of at most 255 rows, whatever the batch, and the engine may schedule as many tokens per
    step as it likes. Without this its budget had to stay under 256 tokens per step.
    """
    from vllm.model_executor.layers import layernorm

    plain = layernorm.rms_norm_batch_invariant
    if getattr(plain, "row_chunked", False):
        return

    def rms_norm_rows(x, weight, eps=1e-6, residual=None):
        if residual is None or weight is None:
            return plain(x, weight, eps, residual=residual)
        bib.fused_add_rms_norm_rows(x, residual, weight, eps)
        return x, residual

    rms_norm_rows.row_chunked = True
    layernorm.rms_norm_batch_invariant = rms_norm_rows


class VLLMEngine:
    """One vLLM engine for the whole run, in this process (its model is reachable for weight pushes)."""

    def __init__(self, cfg: Config, path: Path, eos_ids: list[int]):
        from vllm import LLM
        from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

        route_vllm_add_rms_norm_through_row_chunks()
        self.cfg, self.eos_ids = cfg, eos_ids
        samples = cfg.num_prompts * cfg.group_size
        graphs = cfg.cuda_graphs and not cfg.debug_parity  # the debugger's hooks see only eager steps
        self.llm = LLM(
            model=str(path),
            skip_tokenizer_init=True,  # we pass token ids; the reward decodes with our tokenizer
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",  # logprobs of softmax(logits / T), what was sampled from
            max_num_seqs=samples,  # every sample decodes in every step
            max_num_batched_tokens=max(samples, 8192),
            attention_backend="FLASH_ATTN",
            # Never torch.compile: Inductor would fuse and reorder the ops the trainer mirrors.
            # CUDA graphs only replay the same kernels, so decode steps may use them.
            enforce_eager=not graphs,
            compilation_config=CompilationConfig(
                mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY, max_cudagraph_capture_size=min(samples, 512),
            ) if graphs else None,
        )

    def rollout(self, prompts: list[list[int]], step: int) -> Rollout:
        """group_size samples per prompt, each with its own seed; keeps vLLM's logprob of every token."""
        from vllm import SamplingParams, TokensPrompt

        cfg = self.cfg
        params = [
            SamplingParams(n=cfg.group_size, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, logprobs=0,
                           seed=sample_seed(cfg, step, i), stop_token_ids=self.eos_ids, detokenize=False)
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        samples = [(o.prompt_token_ids, c) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        logprobs = [lp[t].logprob for _, c in samples for t, lp in zip(c.token_ids, c.logprobs)]
        return Rollout(
            prompts=[list(p) for p, _ in samples],
            completions=[list(c.token_ids) for _, c in samples],
            logprobs=torch.tensor(logprobs, dtype=torch.float32),  # Python floats hold fp32 values exactly
            stopped=[c.finish_reason == "stop" for _, c in samples],
        )

    def push(self, model: "Qwen3VLLMCompatModel") -> None:
        push_weights(self.llm, model)


def sample_seed(cfg: Config, step: int, prompt: int) -> int:
    """Per-request seed: a sample depends on (seed, step, prompt) only, not on batching."""
    return (cfg.seed * 1_000_003 + step * 10_007 + prompt) % (2**31)


@dataclass
class Packed:
    tokens: torch.Tensor  # (T,) prompt + completion of every sample, back to back
    positions: torch.Tensor  # (T,) position within its sample
    cu_seqlens: torch.Tensor  # (B+1,) int32 sample boundaries
    max_seqlen: int
    gen_index: torch.Tensor  # (N,) index into T of the hidden state that predicts each generated token
    targets: torch.Tensor  # (N,) the generated tokens
    sample: torch.Tensor  # (N,) which sample (0..B-1) each generated token belongs to

    def to(self, device) -> "Packed":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if f.name != "max_seqlen"})


def pack(prompts: list[list[int]], completions: list[list[int]]) -> Packed:
    """Concatenate samples without padding; token t of completion b is predicted at start_b + P_b - 1 + t."""
    P = torch.tensor([len(p) for p in prompts])
    C = torch.tensor([len(c) for c in completions])
    L = P + C
    starts = torch.cumsum(L, 0) - L
    tokens = torch.tensor([t for p, c in zip(prompts, completions) for t in p + c])
    positions = torch.arange(len(tokens)) - torch.repeat_interleave(starts, L)
    sample = torch.repeat_interleave(torch.arange(len(C)), C)
    offset = torch.arange(int(C.sum())) - torch.repeat_interleave(torch.cumsum(C, 0) - C, C)  # t within completion
    return Packed(
        tokens=tokens,
        positions=positions,
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(L, 0)]).to(torch.int32),
        max_seqlen=int(L.max()),
        gen_index=(starts + P - 1)[sample] + offset,
        targets=tokens[(starts + P)[sample] + offset],
        sample=sample,
    )


def micro_batches(lengths: list[int], max_tokens: int) -> list[range]:
    """Consecutive sample ranges whose total length fits max_tokens (each sample fits on its own)."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        assert n <= max_tokens, f"a sample of {n} tokens exceeds micro_batch_tokens={max_tokens}"
        if total + n > max_tokens:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    out.append(range(start, len(lengths)))
    return out


# ==========================================================================
# Reward: tasks with verifiable answers
# ==========================================================================


@dataclass
class Problem:
    prompt: str
    answer: str


ARITH = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def arithmetic_problems(n: int, seed: int) -> list[Problem]:
    """n procedurally generated problems "a op1 b op2 c" with exact integer answers.

    op1 is one of + - *, op2 one of + -, so the value is always (a op1 b) op2 c.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 9)
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        value = ARITH[op2](ARITH[op1](a, b), c)
        out.append(Problem(f"Q: What is {a} {op1} {b} {op2} {c}? End with 'Answer: <number>'.\nA:", str(value)))
    return out


def gsm8k_problems(n: int, seed: int) -> list[Problem]:
    """n GSM8K train problems (needs `datasets` and network); answers follow '####'."""
    from datasets import load_dataset

    data = load_dataset("openai/gsm8k", "main", split="train")
    rng = random.Random(seed)
    rows = [data[rng.randrange(len(data))] for _ in range(n)]
    return [Problem(f"Q: {r['question']} End with 'Answer: <number>'.\nA:", r["answer"].split("####")[-1].strip()) for r in rows]


TASKS: dict[str, Callable[[int, int], list[Problem]]] = {"arithmetic": arithmetic_problems, "gsm8k": gsm8k_problems}

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_answer(text: str) -> Decimal | None:
    """The number after the last 'Answer:' (else the last number), before the model starts a new 'Q:'."""
    text = text.split("\nQ:")[0]
    tail = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else text
    found = _NUMBER.findall(tail.replace("**", "").replace("$", ""))
    if not found:
        return None
    try:
        return Decimal((found[0] if "Answer:" in text else found[-1]).replace(",", ""))
    except InvalidOperation:
        return None


def reward(completion: str, answer: str) -> float:
    """1 if the parsed answer equals the reference exactly (1,234 == 1234.0), else 0."""
    got = parse_answer(completion)
    return float(got is not None and got == Decimal(answer.replace(",", "")))


# ==========================================================================
# Advantages & loss (pure functions)
# ==========================================================================


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), or r_i - mean_g r. rewards: (B*G,) grouped consecutively."""
    assert rewards.numel() % group_size == 0, "rewards must come in whole groups"
    r = rewards.view(-1, group_size)  # (B, G)
    a = r - r.mean(-1, keepdim=True)
    if std_normalize:
        a = a / (r.std(-1, keepdim=True) + eps)  # unbiased std; a group of equal rewards gives A = 0
    return a.view(-1)


def ppo_clip_loss(logp, old_logp, adv, clip_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: rho = exp(logp - old), pg = -min(rho A, clip(rho, 1-eps, 1+eps) A). Returns (pg, rho, clipped)."""
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    return -torch.minimum(unclipped, clipped), ratio, (clipped < unclipped).float()


def kl_k3(logp, ref_logp) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(q) - q - 1, q = ref_logp - logp (>= 0, unbiased)."""
    q = ref_logp - logp
    return torch.exp(q) - q - 1


# ==========================================================================
# Parity check: trainer vs vLLM, every generated token, fp32 bit patterns
# ==========================================================================


@dataclass
class Parity:
    n_tokens: int
    n_mismatch: int
    max_abs_diff: float
    table: str


def parity_report(vllm_lp: torch.Tensor, trainer_lp: torch.Tensor, tokens: torch.Tensor, rows: int) -> Parity:
    """Compare int32 views of two fp32 vectors (N,): bitwise equal means the same float, -0/NaN included."""
    a, b = vllm_lp.float().cpu(), trainer_lp.detach().float().cpu()
    diff = a.view(torch.int32) != b.view(torch.int32)
    delta = (a - b).abs()
    lines = [f"{'token':>8} {'vllm':>14} {'trainer':>14} {'vllm bits':>10} {'trainer bits':>12} {'delta':>10}"]
    bad = diff.nonzero()[:, 0]
    show = bad[:rows].tolist() if len(bad) else range(min(rows, len(a)))  # the first differing tokens, if any
    for i in show:
        bits_a, bits_b = a[i : i + 1].view(torch.int32).item() & 0xFFFFFFFF, b[i : i + 1].view(torch.int32).item() & 0xFFFFFFFF
        lines.append(f"{int(tokens[i]):>8} {a[i].item():>14.8f} {b[i].item():>14.8f} {bits_a:>10x} {bits_b:>12x} {delta[i].item():>10.3g}")
    return Parity(len(a), len(bad), float(delta.max()) if len(a) else 0.0, "\n".join(lines))


# ==========================================================================
# Parity debugger: trainer vs vLLM's own model, op by op, on one sequence
# ==========================================================================

# Trainer trace names -> vLLM module names (`layers.{i}.` -> `model.layers.{i}.`), in execution order.
# (vLLM shares one rotary module across layers, so the rotation is checked through `attn`.)
TRACE_OPS = ["input_layernorm", "qkv_proj", "q_norm", "k_norm", "attn", "o_proj",
             "post_attention_layernorm", "gate_up_proj", "act_fn", "down_proj"]
VLLM_MODULES = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
                "qkv_proj": "self_attn.qkv_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
                "attn": "self_attn.attn", "o_proj": "self_attn.o_proj",
                "gate_up_proj": "mlp.gate_up_proj", "act_fn": "mlp.act_fn", "down_proj": "mlp.down_proj"}


def trace_names(n_layers: int) -> list[tuple[str, str]]:
    """(trainer name, vLLM module name) for every traced op, in execution order."""
    names = [(f"layers.{i}.{op}", f"model.layers.{i}.{VLLM_MODULES[op]}") for i in range(n_layers) for op in TRACE_OPS]
    return names + [("norm", "model.norm")]


def compare_traces(ours: dict[str, list[torch.Tensor]], theirs: dict[str, list[torch.Tensor]], order: list[str]) -> list[dict]:
    """Per op: how many elements differ bitwise, and the max |delta|. Tensors are compared as (rows, -1)."""
    rows = []
    for name in (n for n in order if n in ours and n in theirs):
        pairs = [(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)) for a, b in zip(ours[name], theirs[name])]
        if any(a.shape != b.shape for a, b in pairs):
            shapes = [(tuple(a.shape), tuple(b.shape)) for a, b in pairs]
            rows.append(dict(op=name, n_diff=-1, numel=0, max_abs=float("nan"), note=f"shapes differ: {shapes}"))
            continue
        rows.append(dict(op=name, n_diff=sum(int((a != b).sum()) for a, b in pairs), numel=sum(a.numel() for a, _ in pairs),
                         max_abs=max(float((a.float() - b.float()).abs().max()) for a, b in pairs),
                         rows=sorted({int(i) for a, b in pairs for i in (a != b).any(-1).nonzero()[:, 0].tolist()})[:8]))
    return rows


def first_divergence(rows: list[dict]) -> str | None:
    return next((r["op"] for r in rows if r["n_diff"] != 0), None)


def vllm_trace(llm, prompt: list[int], params, names: list[tuple[str, str]]) -> tuple[dict[str, list[torch.Tensor]], list[int], list[float]]:
    """Generate from `prompt` with forward hooks on vLLM's modules.

    Every call (the prefill, then one decode step per token) appends its rows, so
    the trace covers prompt + completion[:-1], row for row, as the trainer sees it.
    """
    from vllm import TokensPrompt

    calls: dict[str, list[list[torch.Tensor]]] = {}
    by_module = {v: k for k, v in names}

    def attach(model):
        handles = []
        for mod_name, module in model.named_modules():
            if mod_name in by_module:
                def hook(_m, _inp, out, key=by_module[mod_name]):
                    outs = out if isinstance(out, (tuple, list)) else (out,)
                    calls.setdefault(key, []).append([o.detach().clone() for o in outs if isinstance(o, torch.Tensor)])
                handles.append(module.register_forward_hook(hook))
        return handles

    llm.reset_prefix_cache()  # a cached prefix would skip rows of the prefill
    handles = llm.apply_model(attach)[0]
    try:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
    finally:
        for h in handles:
            h.remove()
    trace = {k: [torch.cat(parts) for parts in zip(*v)] for k, v in calls.items()}
    return trace, list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def debug_parity(llm, model: Qwen3VLLMCompatModel, prompt: list[int], max_tokens: int, temperature: float, seed: int) -> tuple[list[dict], int]:
    """Trainer vs vLLM on one generated sequence, op by op over prefill and decode rows.

    Returns the per-op rows (print with `format_debug`) and the number of generated
    tokens whose logprobs differ.
    """
    from vllm import SamplingParams

    names = trace_names(model.args.n_layers)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=0, detokenize=False)
    theirs, completion, vllm_lp = vllm_trace(llm, prompt, params, names)
    packed = pack([prompt], [completion]).to(model.norm.weight.device)
    fed = Packed(**{**packed.__dict__, "tokens": packed.tokens[:-1], "positions": packed.positions[:-1],
                    "cu_seqlens": packed.cu_seqlens - torch.tensor([0, 1], dtype=torch.int32, device=packed.tokens.device),
                    "max_seqlen": packed.max_seqlen - 1})  # vLLM never feeds the last sampled token
    model.trace = {}
    try:
        with torch.no_grad():
            h = model(fed.tokens, fed.positions, fed.cu_seqlens, fed.max_seqlen)
            logp, _ = model.token_logprobs(h[fed.gen_index], fed.targets, temperature)
        ours = model.trace
    finally:
        model.trace = None
    n_bad = int((torch.tensor(vllm_lp, dtype=torch.float32).view(torch.int32) != logp.cpu().view(torch.int32)).sum())
    return compare_traces(ours, theirs, [n for n, _ in names]), n_bad


def format_debug(rows: list[dict]) -> str:
    lines = [f"{'op':<36} {'differ':>10} {'of':>10} {'max |delta|':>12}"]
    lines += [f"{r['op']:<36} {r['n_diff']:>10} {r['numel']:>10} {r['max_abs']:>12.3g} {r.get('note', '')}{r.get('rows') or ''}" for r in rows]
    first = first_divergence(rows)
    lines.append(f"first divergence: {first}" if first else "no divergence: every traced op is bitwise equal")
    return "\n".join(lines)


# ==========================================================================
# Weight push: trainer -> the running vLLM engine, in memory
# ==========================================================================


def push_weights(llm, model: Qwen3VLLMCompatModel) -> None:
    """Hand the bf16 weights the trainer computes with to vLLM's own loader, inside the engine.

    The loader fuses q/k/v and gate/up itself and copies in place; no file is written.
    Then the prefix cache is dropped: its KV was computed with the old weights.
    """
    hf = model_hf_state(model)
    llm.apply_model(lambda m: m.load_weights(hf.items()))
    llm.reset_prefix_cache()


# ==========================================================================
# Training loop
# ==========================================================================


def sub_pack(packed: Packed, samples: range) -> tuple[Packed, slice]:
    """Samples [start, stop) as their own packed batch, and the slice of generated tokens (N,) they own."""
    t0, t1 = int(packed.cu_seqlens[samples.start]), int(packed.cu_seqlens[samples.stop])
    n_before = torch.bincount(packed.sample, minlength=samples.stop + 1)  # generated tokens per sample
    n0, n1 = int(n_before[: samples.start].sum()), int(n_before[: samples.stop].sum())
    cu = packed.cu_seqlens[samples.start : samples.stop + 1] - t0
    mb = Packed(
        tokens=packed.tokens[t0:t1], positions=packed.positions[t0:t1], cu_seqlens=cu,
        max_seqlen=int((cu[1:] - cu[:-1]).max()), gen_index=packed.gen_index[n0:n1] - t0,
        targets=packed.targets[n0:n1], sample=packed.sample[n0:n1] - samples.start,
    )
    return mb, slice(n0, n1)


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or logprob is NaN/Inf: raised before the optimizer step."""

    def __init__(self, quantity: str, samples: list[int]):
        super().__init__(f"non-finite {quantity}")
        self.quantity, self.samples = quantity, samples


def train_step(model, ref_model, optimizer, packed: Packed, old_logp, adv, cfg: Config) -> tuple[dict, torch.Tensor]:
    """`updates_per_batch` optimizer steps over all micro-batches of one rollout batch.

    old_logp (N,) and adv (B,) live on the model's device. Returns the metrics of the
    first update and its logprobs (N,): these are what the parity check compares.
    Raises NonFiniteError, before the optimizer step, if a logprob, the loss or the
    gradient norm is not finite.
    """
    device = old_logp.device
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    parts = [(*sub_pack(packed, g), g) for g in micro_batches(lengths, cfg.micro_batch_tokens)]
    parts = [(mb.to(device), tok, g) for mb, tok, g in parts]
    n_tok = len(packed.targets)
    first_logp = torch.empty(n_tok, dtype=torch.float32, device=device)
    sums = torch.zeros(6, device=device)  # pg, kl, entropy, ratio, clipped (token sums), grad norm
    for update in range(cfg.updates_per_batch):
        optimizer.zero_grad(set_to_none=True)
        loss_total = torch.zeros((), device=device)
        logp_finite = torch.ones((), dtype=torch.bool, device=device)
        for mb, tok, g in parts:
            h = model(mb.tokens, mb.positions, mb.cu_seqlens, mb.max_seqlen)  # (T_mb, dim)
            logp, ent = model.token_logprobs(h[mb.gen_index], mb.targets, cfg.temperature)  # (N_mb,)
            pg, ratio, clipped = ppo_clip_loss(logp, old_logp[tok], adv[mb.sample + g.start], cfg.clip_eps)
            kl = torch.zeros_like(logp)
            if cfg.kl_coef > 0:
                with torch.no_grad():
                    ref_h = ref_model(mb.tokens, mb.positions, mb.cu_seqlens, mb.max_seqlen)
                    ref_logp, _ = ref_model.token_logprobs(ref_h[mb.gen_index], mb.targets, cfg.temperature)
                kl = kl_k3(logp, ref_logp)
            loss = (pg + cfg.kl_coef * kl - cfg.entropy_coef * ent).sum() / n_tok
            loss.backward()
            loss_total += loss.detach()
            logp_finite &= torch.isfinite(logp).all()
            if update == 0:
                first_logp[tok] = logp.detach()
                sums[:5] += torch.stack([pg.sum(), kl.sum(), ent.sum(), ratio.sum(), clipped.sum()]).detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        finite = torch.stack([logp_finite, torch.isfinite(loss_total), torch.isfinite(norm)]).tolist()  # one host sync
        if not all(finite):
            quantity = ["logprobs", "loss", "gradient norm"][finite.index(False)]
            bad = packed.sample[~torch.isfinite(first_logp.cpu())].unique().tolist() if quantity == "logprobs" else []
            raise NonFiniteError(quantity, bad or sorted(set(packed.sample.tolist())))
        if update == 0:
            sums[5] = norm
        optimizer.step()
    sums[:5] /= max(n_tok, 1)
    pg, kl, ent, ratio, clipped, grad_norm = sums.tolist()  # one host sync
    metrics = dict(loss=pg + cfg.kl_coef * kl - cfg.entropy_coef * ent, pg_loss=pg, kl_div=kl, entropy=ent,
                   ratio_mean=ratio, ratio_clipped_frac=clipped, grad_norm=grad_norm)
    return metrics, first_logp


def weight_delta_metrics(before: dict[str, torch.Tensor], model: nn.Module) -> dict[str, float]:
    """||W_new - W_old|| and ||W_new - W_old|| / ||W_old|| per parameter, with one host sync."""
    params = dict(model.named_parameters())
    stats = torch.stack([torch.stack([(params[n].detach() - w).norm(), w.norm()]) for n, w in before.items()])  # (P, 2)
    out = {}
    for n, (mag, ref) in zip(before, stats.tolist()):
        out[f"weight_delta/{n}/magnitude"] = mag
        out[f"weight_delta/{n}/relative_change"] = mag / max(ref, 1e-30)
    return out


@dataclass
class Trainer:
    """Everything a step touches, built once by `run` (or by a test, with a stand-in engine)."""

    cfg: Config
    engine: object  # .rollout(prompts, step) -> Rollout and .push(model), e.g. VLLMEngine
    tokenizer: object
    model: Qwen3VLLMCompatModel
    ref_model: Qwen3VLLMCompatModel | None
    optimizer: torch.optim.Optimizer
    writer: object  # TensorBoard SummaryWriter


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW on the fp32 masters; on CUDA its fused kernel (one launch set for all tensors, deterministic)."""
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, fused=fused)


def rl_step(tr: Trainer, step: int) -> tuple[dict[str, float], Parity]:
    """rollout -> reward -> advantages -> update (+ parity check) -> weight push -> log."""
    cfg, device = tr.cfg, tr.model.norm.weight.device
    problems = TASKS[cfg.task](cfg.num_prompts, cfg.seed * 7919 + step)
    prompt_ids = [tr.tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems]
    longest = max(map(len, prompt_ids))
    if longest + cfg.max_new_tokens > cfg.max_model_len:
        raise ConfigError(f"a prompt of {longest} tokens plus --max-new-tokens {cfg.max_new_tokens} exceeds --max-model-len {cfg.max_model_len}.")

    t0 = time.perf_counter()
    ro = tr.engine.rollout(prompt_ids, step)
    t1 = time.perf_counter()
    vocab = len(tr.tokenizer)  # a model's vocab may be larger than its tokenizer's: skip ids past it
    texts = tr.tokenizer.batch_decode([[t for t in c if t < vocab] for c in ro.completions], skip_special_tokens=True)
    rewards = torch.tensor([reward(t, problems[i // cfg.group_size].answer) for i, t in enumerate(texts)])
    adv = group_advantages(rewards, cfg.group_size, cfg.std_normalize, cfg.adv_eps).to(device)
    packed = pack(ro.prompts, ro.completions)

    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    try:
        metrics, trainer_logp = train_step(tr.model, tr.ref_model, tr.optimizer, packed, ro.logprobs.to(device), adv, cfg)
    except NonFiniteError as e:  # say which step and prompts, for the diagnostic
        e.step, e.prompts = step, sorted({i // cfg.group_size for i in e.samples})
        raise
    parity = parity_report(ro.logprobs, trainer_logp, packed.targets, cfg.parity_rows)
    t2 = time.perf_counter()
    tr.engine.push(tr.model)
    if device.type == "cuda":
        torch.cuda.synchronize()  # the push is asynchronous: time it whole
    t3 = time.perf_counter()

    metrics.update(weight_delta_metrics(before, tr.model))
    lens = torch.tensor([len(c) for c in ro.completions], dtype=torch.float32)
    metrics.update({
        "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
        "completion_len_mean": lens.mean().item(), "completion_stopped_frac": sum(ro.stopped) / len(ro.stopped),
        "determinism/mismatched_tokens": parity.n_mismatch, "determinism/tokens": parity.n_tokens,
        "determinism/max_abs_diff": parity.max_abs_diff,
        "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/push_s": t3 - t2,
    })
    for k, v in metrics.items():
        tr.writer.add_scalar(k, v, step)
    tr.writer.flush()
    return metrics, parity


def format_step(step: int, m: dict[str, float]) -> str:
    return (f"step {step:4d} | reward {m['reward_mean']:.3f} | loss {m['loss']:+.4f} | kl {m['kl_div']:.4f} | "
            f"ent {m['entropy']:.3f} | len {m['completion_len_mean']:.1f} | mismatched {int(m['determinism/mismatched_tokens'])}"
            f"/{int(m['determinism/tokens'])} | rollout {m['time/rollout_s']:.2f}s train {m['time/train_s']:.2f}s push {m['time/push_s']:.2f}s")


# ==========================================================================
# Checkpoints & resume
# ==========================================================================


def save_checkpoint(run_dir: Path, tr: Trainer, next_step: int, source: Path) -> Path:
    """checkpoints/step_XXXXXX: HF model (compute dtype), fp32 masters, optimizer, RNG, data position, config.

    Written to a temp dir and renamed, so a crash mid-write leaves the previous checkpoint
    whole; then all but the newest `keep_last` are removed.
    """
    root = run_dir / "checkpoints"
    final, tmp = root / f"step_{next_step:06d}", root / f".tmp_step_{next_step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(tmp / "model", model_hf_state(tr.model), source)
    torch.save({
        "next_step": next_step,
        "model": {k: v.detach().cpu() for k, v in tr.model.state_dict().items()},  # fp32 masters
        "optimizer": tr.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        # prompts and sampler seeds are pure functions of (seed, step): the step is the data position
        "data": {"task": tr.cfg.task, "seed": tr.cfg.seed, "next_step": next_step},
        "sampler_seeds": [sample_seed(tr.cfg, next_step, i) for i in range(tr.cfg.num_prompts)],  # of the next step
        "config": dataclasses.asdict(tr.cfg),
    }, tmp / "trainer.pt")
    (tmp / "run_config.json").write_text(json.dumps(dataclasses.asdict(tr.cfg), indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("step_*"))[: -tr.cfg.keep_last]:
        shutil.rmtree(old)
    return final


def restore_checkpoint(tr: Trainer, ckpt: Path) -> int:
    """Load masters, optimizer and RNG from `ckpt` into `tr`; returns the step to run next."""
    state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
    tr.model.load_state_dict(state["model"])
    tr.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["next_step"]


def find_checkpoint(cfg: Config) -> Path:
    """--resume PATH (a checkpoint dir) or 'latest' (newest checkpoint of --run-name, else of any run)."""
    if cfg.resume != "latest":
        ckpt = Path(cfg.resume).expanduser()
        if not all((ckpt / f).is_file() for f in ("trainer.pt", "run_config.json")):
            raise ConfigError(f"--resume {cfg.resume!r} is not a checkpoint directory (no trainer.pt and run_config.json).")
        return ckpt
    runs = [Path(cfg.log_dir) / cfg.run_name] if cfg.run_name else [p for p in Path(cfg.log_dir).glob("*") if p.is_dir()]
    found = sorted((c for r in runs for c in r.glob("checkpoints/step_*") if (c / "trainer.pt").is_file()), key=lambda c: c.stat().st_mtime)
    if not found:
        raise ConfigError(f"--resume latest: no checkpoint under {runs[0] if cfg.run_name else cfg.log_dir}.")
    return found[-1]


def resume_config(cfg: Config, ckpt: Path) -> Config:
    """The checkpoint's config, with this invocation's --steps (so a run can be extended).

    Read from run_config.json: trainer.pt holds the masters and optimizer state, read once by restore.
    """
    saved = json.loads((ckpt / "run_config.json").read_text())
    return dataclasses.replace(Config(**saved), steps=cfg.steps, resume=cfg.resume)


def prepare_run_dir(cfg: Config, resuming: bool) -> Path:
    """<log_dir>/<run_name>: refuses to write into another run's directory unless told to."""
    run_dir = Path(cfg.log_dir) / cfg.run_name
    if run_dir.exists() and any(run_dir.iterdir()) and not resuming:
        if not cfg.overwrite:
            raise ConfigError(f"{run_dir} already holds a run; pass --resume latest --run-name {cfg.run_name} to continue it, or --overwrite to replace it.")
        shutil.rmtree(run_dir)
    out = Path(cfg.output_dir) if cfg.output_dir else None
    if out and out.exists() and any(out.iterdir()) and not (cfg.overwrite or resuming):
        raise ConfigError(f"--output-dir {out} is not empty; pick another or pass --overwrite.")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


# ==========================================================================
# Main
# ==========================================================================


def prepare_environment() -> None:
    """Env vars vLLM reads at import: set them (saying so) or stop when they contradict parity."""
    required = {"VLLM_BATCH_INVARIANT": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for name, value in required.items():
        if name not in os.environ:
            print(f"{name} is not set; setting {name}={value} before importing vLLM.")
            os.environ[name] = value
        elif os.environ[name] != value:
            raise ConfigError(f"{name}={os.environ[name]} breaks bitwise parity; unset it or set {name}={value}.")
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU found; the training job needs one (the tests run anywhere: see README.md).")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ConfigError("vLLM is not installed; run `pip install -r requirements.txt` (vllm==0.26.0, torchtitan==0.2.2).") from e


def load_model_files(cfg: Config):
    """Path, TorchTitan args, tokenizer and eos id, after checking they fit together and the config."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(cfg.model)
    hf_cfg = read_qwen3_config(path)
    args = model_args_from_hf(hf_cfg)
    if cfg.max_model_len > args.max_seq_len:
        raise ConfigError(f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings ({args.max_seq_len}).")
    weight_files(path)  # fail now, before minutes of engine start, if there are no weights
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"{path} has no loadable tokenizer ({type(e).__name__}); add tokenizer.json and tokenizer_config.json.") from e
    eos_ids = stop_token_ids(path, tokenizer, hf_cfg)
    if not eos_ids or len(tokenizer) > args.vocab_size or max(eos_ids) >= args.vocab_size:
        raise ConfigError(f"the tokenizer ({len(tokenizer)} tokens, eos ids {eos_ids}) does not fit the model's vocab of {args.vocab_size}.")
    return path, args, tokenizer, eos_ids


def stop_token_ids(path: Path, tokenizer, hf_cfg) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos and config.json's / generation_config.json's eos ids
    (Qwen3 lists both <|im_end|> and <|endoftext|>)."""
    found = [tokenizer.eos_token_id, hf_cfg.eos_token_id]
    if (path / "generation_config.json").is_file():
        found.append(json.loads((path / "generation_config.json").read_text()).get("eos_token_id"))
    flat = [i for x in found for i in (x if isinstance(x, list) else [x]) if i is not None]
    return sorted(set(flat))


def train(tr: Trainer, start: int, run_dir: Path, source: Path) -> str:
    """Steps start..cfg.steps-1 with periodic checkpoints; the final HF checkpoint and its sha256.

    Ctrl-C lets the current step finish, saves a checkpoint and closes TensorBoard (a second
    Ctrl-C aborts at once). A non-finite loss, gradient norm or logprob stops the run before
    its optimizer step, writes a diagnostic and keeps the last good checkpoint.
    """
    cfg = tr.cfg
    stop = {"requested": False}

    def on_sigint(signum, frame):
        print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again aborts).", flush=True)
        stop["requested"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, on_sigint)
    metrics_log = (run_dir / "metrics.jsonl").open("a")
    try:
        for step in range(start, cfg.steps):
            try:
                metrics, parity = rl_step(tr, step)
            except NonFiniteError as e:
                diag = run_dir / f"nonfinite_step_{step:06d}.json"
                diag.write_text(json.dumps({"step": step, "quantity": e.quantity, "samples": e.samples, "prompts": e.prompts}, indent=1))
                last = sorted((run_dir / "checkpoints").glob("step_*"))
                raise RunStopped(f"step {step}: {e}; nothing was applied. Diagnostic: {diag}. Last good checkpoint: {last[-1] if last else 'none'}.", 3) from e
            metrics_log.write(json.dumps({"step": step, **{k: v for k, v in metrics.items() if not k.startswith("weight_delta/")}}) + "\n")
            metrics_log.flush()
            print(parity.table)
            print(f"parity: identical={'yes' if parity.n_mismatch == 0 else 'no'} | {parity.n_mismatch}/{parity.n_tokens} tokens differ | max |delta| {parity.max_abs_diff:.3g}")
            print(format_step(step, metrics), flush=True)
            if cfg.strict_parity and parity.n_mismatch:
                raise RunStopped(f"--strict-parity: step {step} has {parity.n_mismatch} mismatched tokens.", 4)
            if stop["requested"] or (cfg.save_every and (step + 1) % cfg.save_every == 0):
                ckpt = save_checkpoint(run_dir, tr, step + 1, source)
                if stop["requested"]:
                    raise RunStopped(f"interrupted after step {step}; checkpoint {ckpt}; continue with --resume {ckpt}", 130)
    finally:
        signal.signal(signal.SIGINT, previous)
        metrics_log.close()
        tr.writer.close()

    hf_state = model_hf_state(tr.model)
    out = Path(cfg.output_dir) if cfg.output_dir else run_dir / "final"
    save_hf_checkpoint(out, hf_state, source)
    digest = weights_sha256(hf_state)
    print(f"saved {out} | weights sha256 {digest}")
    return digest


class RunStopped(RuntimeError):
    """The run stopped on purpose (interrupt, NaN guard, strict parity): a message and an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def setup(cfg: Config, engine_factory=None, device=None) -> tuple[Trainer, int, Path, Path]:
    """Build (or rebuild from a checkpoint) everything `train` needs.

    engine_factory(cfg, path, eos_ids) makes the rollout engine; the default is VLLMEngine
    on CUDA (tests pass a CPU stand-in with the reference kernels).
    """
    from torch.utils.tensorboard import SummaryWriter

    ckpt = find_checkpoint(cfg) if cfg.resume else None
    if ckpt:
        cfg = resume_config(cfg, ckpt)
    path, args, tokenizer, eos_ids = load_model_files(cfg)
    cfg.run_name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = prepare_run_dir(cfg, resuming=ckpt is not None)
    if engine_factory is None:
        prepare_environment()
        engine_factory, device = VLLMEngine, torch.device("cuda")
    kernels = bib.reference_kernels() if cfg.kernels == "reference" or device.type == "cpu" else bib.vllm_kernels()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    engine = engine_factory(cfg, path, eos_ids)  # first: vLLM sizes its KV cache from the memory free now
    state = hf_to_trainer(load_hf_state_dict(path), args)
    model = build_model(args, state, kernels, DTYPES[cfg.dtype], device)
    ref_model = build_model(args, state, kernels, DTYPES[cfg.dtype], device).requires_grad_(False) if cfg.kl_coef > 0 else None
    del state
    optimizer = make_optimizer(model, cfg)
    tr = Trainer(cfg, engine, tokenizer, model, ref_model, optimizer, writer=None)
    start = restore_checkpoint(tr, ckpt) if ckpt else 0
    engine.push(model)  # from here on the engine holds exactly the trainer's weights (resumed ones too)
    # On resume, drop what the interrupted run logged after its checkpoint (TensorBoard and metrics.jsonl).
    tr.writer = SummaryWriter(str(run_dir), purge_step=start if ckpt else None)
    tr.writer.add_text("config", json.dumps(dataclasses.asdict(cfg), indent=2))
    metrics_log = run_dir / "metrics.jsonl"
    if ckpt and metrics_log.is_file():
        kept = [line for line in metrics_log.read_text().splitlines() if json.loads(line)["step"] < start]
        metrics_log.write_text("".join(line + "\n" for line in kept))
    if ckpt:
        print(f"resuming {ckpt} at step {start} (config from the checkpoint)")
    print(f"simple_rl | {path} | {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params | kernels {kernels.name} | run {run_dir}")
    return tr, start, run_dir, path


def run(cfg: Config) -> str:
    """The whole job; returns the sha256 of the final weights."""
    tr, start, run_dir, path = setup(cfg)
    if cfg.debug_parity:
        prompt = tr.tokenizer.encode(TASKS[cfg.task](1, cfg.seed)[0].prompt, add_special_tokens=False)
        rows, n_bad = debug_parity(tr.engine.llm, tr.model, prompt, cfg.max_new_tokens, cfg.temperature, cfg.seed)
        print(format_debug(rows))
        print(f"generated-token logprobs that differ: {n_bad}")
        return ""
    return train(tr, start, run_dir, path)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    try:
        validate(cfg)
        run(cfg)
    except ConfigError as e:
        print(f"simple_rl: error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        print(f"simple_rl: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
