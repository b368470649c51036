"""Tiny local Qwen3 checkpoints, a tiny tokenizer, and a CPU stand-in for the vLLM engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import batch_invariant_backward as bib
import simple_rl as rl

SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
# Qwen3's chat template, reduced to what the tests need: user turns, the generation prompt,
# and the empty think block Qwen3 writes when thinking is off.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def make_tokenizer(out: Path, vocab_size: int = 320, chat: bool = False):
    """A byte-level BPE trained locally on arithmetic text; eos = <|endoftext|> (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"Q: {p.question}\nA: {p.answer} Answer: {p.answer}" for p in rl.arithmetic_problems(500, 0)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # off a terminal, its bar is blank lines
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_checkpoint(
    out: Path,
    *,
    tied: bool = True,
    layers: int = 2,
    vocab: int = 384,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 128,
    inter: int = 512,
    shard: str | None = None,
    seed: int = 0,
    dtype=torch.float32,
    max_pos: int = 2048,
    device: str = "cpu",
    chat: bool = False,
) -> Path:
    """A random Qwen3ForCausalLM saved by transformers (GQA, head_dim 128 by default), plus
    tokenizer (with a chat template if `chat`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        tie_word_embeddings=tied,
        max_position_embeddings=max_pos,
        eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    model = random_model(Qwen3ForCausalLM, cfg, dtype, device)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kw)
    make_tokenizer(out, vocab_size=min(vocab, 320), chat=chat)
    return out


def make_qwen35_checkpoint(
    out: Path,
    *,
    tied: bool = True,
    layers: int = 4,
    attention_every: int = 4,
    vocab: int = 384,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    inter: int = 128,
    k_heads: int = 2,
    v_heads: int = 4,
    k_dim: int = 16,
    v_dim: int = 8,
    experts: int = 0,
    top_k: int = 0,
    moe_inter: int = 0,
    shared_inter: int = 0,
    vision: bool = False,
    seed: int = 0,
    dtype=torch.float32,
    max_pos: int = 2048,
    rope_theta: float = 10_000_000.0,
    device: str = "cpu",
    chat: bool = False,
    stop_ids: int = 0,
    random_dt_bias: bool = False,
) -> Path:
    """A random Qwen3.5 text model (Qwen3_5ForCausalLM; with `experts`, Qwen3_5MoeForCausalLM)
    saved by transformers, plus a tokenizer: one full-attention layer in `attention_every`
    (the published models: 4), the others linear attention, each k head serving v_heads /
    k_heads v heads, a quarter of each full-attention head rotated.

    With `stop_ids`, generation_config.json lists that many eos ids spread over the vocabulary
    (eos 0 among them), so that a random model's samples stop early at random lengths.

    With `random_dt_bias`, each Gated DeltaNet head's dt_bias drawn from [0.5, 1.5] (HF inits
    them all to 1, where a head given another's would not show); the GPU presets keep HF's,
    the weights their recorded sha256s were measured on.

    With `vision`, laid out as the hub's Qwen3.5 checkpoints are (ForConditionalGeneration):
    config.json with a text_config, the text weights under model.language_model., and a
    stand-in vision tower (model.visual.) and multi-token-prediction head (mtp.)."""
    from safetensors.torch import load_file, save_file
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)

    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                 linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                 linear_key_head_dim=k_dim, linear_value_head_dim=v_dim,
                 tie_word_embeddings=tied, max_position_embeddings=max_pos, eos_token_id=0,
                 full_attention_interval=attention_every,
                 rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                                  "partial_rotary_factor": 0.25})
    if experts:
        cfg = Qwen3_5MoeTextConfig(**shape, num_experts=experts, num_experts_per_tok=top_k,
                                   moe_intermediate_size=moe_inter,
                                   shared_expert_intermediate_size=shared_inter)
        model = random_model(Qwen3_5MoeForCausalLM, cfg, dtype, device, router_std=2 / hidden**0.5)
    else:
        cfg = Qwen3_5TextConfig(**shape, intermediate_size=inter)
        model = random_model(Qwen3_5ForCausalLM, cfg, dtype, device)
    if random_dt_bias:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("dt_bias"):
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    make_tokenizer(out, vocab_size=min(vocab, 320), chat=chat)
    if stop_ids:
        gen = out / "generation_config.json"
        config = json.loads(gen.read_text()) if gen.is_file() else {}
        config["eos_token_id"] = list(range(0, vocab, max(1, vocab // stop_ids)))[:stop_ids]
        gen.write_text(json.dumps(config, indent=2))
    if vision:
        text = json.loads((out / "config.json").read_text())
        kind = "qwen3_5_moe" if experts else "qwen3_5"
        arch = f"Qwen3_5{'Moe' if experts else ''}ForConditionalGeneration"
        config = {"architectures": [arch], "model_type": kind, "text_config": text,
                  "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                                    "intermediate_size": 64, "out_hidden_size": hidden},
                  "tie_word_embeddings": tied}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        weights = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.")
                   else k: v for k, v in load_file(out / "model.safetensors").items()}
        weights["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 16, 16)
        weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def supervised_warm_start(src: Path, out: Path, steps: int, batch) -> Path:
    """`steps` AdamW steps (lr 3e-3) of next-token loss on the Qwen3 at src (fp32), saved with
    its tokenizer at out. batch(tok, rng) gives a step's (sequences, labels) as id lists, label
    -100 where there is no loss; they are right-padded with eos (labels with -100)."""
    import random

    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(src)
    model = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(1)
    eos = tok.eos_token_id
    for _ in range(steps):
        seqs, labels = batch(tok, rng)
        width = max(map(len, seqs))
        x = torch.tensor([s + [eos] * (width - len(s)) for s in seqs])
        y = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def cast_once_changes_no_bit(args, state, parts: list) -> "rl.Qwen3":
    """Two bf16 models (reference forwards, custom backwards) train on the micro-batches
    `parts`, one under weights_cast_once: the same logprobs and fp32 gradients, bit for bit.
    Returns the model that cast once."""
    kernels = bib.custom_backward_kernels(bib.reference_forwards())
    models = [rl.build_model(args, state, kernels, torch.bfloat16, "cpu") for _ in range(2)]
    logps = []
    for cached, model in zip((False, True), models):
        with rl.weights_cast_once(model) if cached else torch.enable_grad():
            for p in parts:
                lp, ent = model(p, 0.8)
                (lp.sum() + 0.1 * ent.sum()).backward()
                logps.append(lp.detach())
    for a, b in zip(logps[:len(parts)], logps[len(parts):]):
        assert torch.equal(a, b)
    for (name, pa), pb in zip(models[0].named_parameters(), models[1].parameters()):
        assert pa.grad.dtype == torch.float32 and torch.equal(pa.grad, pb.grad), name
    return models[1]


def random_model(cls, cfg, dtype, device, router_std: float = 0.0):
    """transformers' `cls(cfg)` with random norms (HF inits them to 1: random ones make the
    tests see every weight) and, if router_std, random MoE routers (HF inits them to 0)."""
    with torch.device(device):
        model = cls(cfg).to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif router_std and n.endswith("mlp.gate.weight"):
                p.normal_(0, router_std)
    return model


class TorchEngine(rl.Engine):
    """CPU stand-in for VLLMEngine: samples from its own copy of the policy, no KV cache.

    It recomputes the full prefix for each new token (fine for tiny models), returns
    processed logprobs of softmax(logits / T) as vLLM does, and takes pushed weights by HF
    name, as vLLM's loader does. Only `generate` is its own: simple_rl's episode loop runs on it.
    """

    def __init__(self, cfg: rl.Config, files=None, ranks=None):
        self.model = None  # built from the first push
        self.cfg, self.files = cfg, files
        self.stop_ids = set(files.eos_ids + files.tool_ids if files else (0,))  # they end a turn
        self.sleeps = 0
        self.calls = []  # per generate: (prompts, n, seeds, max_tokens, temperature)

    @torch.no_grad()
    def generate(self, prompts, n, seeds, max_tokens, temperature):
        self.calls.append(([list(p) for p in prompts], n, list(seeds), list(max_tokens),
                           temperature))
        seqs = [list(p) for p in prompts for _ in range(n)]
        limit = [m for m in max_tokens for _ in range(n)]
        gens = [None if seeds[i // n] is None else
                torch.Generator().manual_seed(seeds[i // n] * 97 + i % n) for i in range(len(seqs))]
        comps = [[] for _ in seqs]
        lps = [[] for _ in seqs]
        live = [i for i in range(len(seqs)) if limit[i] > 0]
        while live:
            z = self.next_logits([seqs[i] + comps[i] for i in live])
            lp = torch.log_softmax(z / temperature if temperature > 0 else z, -1)
            for row, i in enumerate(live):
                if gens[i] is None:  # greedy
                    t = int(z[row].argmax())
                else:
                    t = int(torch.multinomial(lp[row].exp(), 1, generator=gens[i]))
                comps[i].append(t)
                lps[i].append(float(lp[row, t]))
            live = [i for i in live if comps[i][-1] not in self.stop_ids and
                    len(comps[i]) < limit[i]]
        out = [rl.Completion(c, lp, bool(c) and c[-1] in self.stop_ids)
               for c, lp in zip(comps, lps)]
        return [out[j * n:(j + 1) * n] for j in range(len(prompts))]

    def next_logits(self, seqs):
        """fp32 logits (B, V) of the token after each sequence."""
        packed = rl.pack(seqs, [[] for _ in seqs])
        h = self.model.hidden(packed)
        return self.model.logits(h[packed.cu_seqlens[1:].long() - 1]).float()  # (B, V)

    def sleep(self):
        self.sleeps += 1

    def push(self, weights):
        hf = {k: v.detach().float().cpu().clone() for k, v in weights}
        args = self.files.args if self.files else self.model.args
        if any("lora_" in k for k in hf):  # a LoRA run pushes its adapter (scale folded in B)
            self.push_adapter(hf, args)
            return 0.0  # Engine.push: seconds spent waking (this stand-in never sleeps)
        state = rl.hf_to_trainer(hf, args)
        if self.model is None:
            self.model = rl.build_model(args, state, bib.reference_kernels(), torch.float32, "cpu")
            self.model.requires_grad_(False)
        else:
            self.model.load_state_dict(state)
        return 0.0


    def push_adapter(self, adapter, args):
        """As vLLM: the base from the checkpoint's files, the adapter's (A, B') into its slot
        (an adapter of scale 1: B' already holds alpha / r)."""
        if self.model is None:
            spec = rl.lora_spec(self.cfg, args)
            spec = rl.LoRASpec(spec.rank, float(spec.rank), spec.targets)
            state = {**rl.hf_to_trainer(rl.load_hf_state_dict(self.files.path), args),
                     **rl.lora_init(args, spec, 0)}
            self.model = rl.build_model(args, state, bib.reference_kernels(), torch.float32,
                                        "cpu", lora=spec)
            self.model.requires_grad_(False)
        with torch.no_grad():
            for name, m, slices in rl.adapter_slices(self.model):
                a = m.slice_a()[slices[0]]
                a.copy_(adapter[f"{name}.lora_A.weight"].view(a.shape))
                b = adapter[f"{name}.lora_B.weight"].reshape(-1, a.shape[0])
                for s, part in zip(slices, b.split([m.b[s].shape[0] for s in slices])):
                    m.b[s].copy_(part)


def first_turns(engine, prompts, indices, step) -> rl.Rollout:
    """A step's first turn (Engine.first_turn) as simple_rl's trainer packs it: one-turn episodes
    with no env (nothing scores them); `completed`: the turn ended at a stop id."""
    outs = engine.first_turn(prompts, indices, step)
    episodes = rl.start_episodes([None] * sum(map(len, outs)), prompts, outs, engine.cfg)
    rollout = rl.episodes_rollout(episodes, engine.returns_routes)
    rollout.completed = [c.stopped for cs in outs for c in cs]
    return rollout


class ExactEngine(TorchEngine):
    """The stand-in engine, with its logprobs recomputed by its copy of the policy in the
    trainer's own micro-batches: the trainer's first forward, op for op and shape for shape,
    so every token matches bit for bit, at any thread count, in every turn of an episode.

    Shape for shape because the CPU reference kernels are not batch-invariant (vLLM's are):
    MKL's SGEMM rounds a row differently with the number of rows in the call, and which row
    counts do depends on the thread count (on one 2-core machine: 1-3 rows at any count, 5-7
    and 9-11 rows too at 2 or 8 threads, against 12 or more), and the reference attention pads
    every sample to the batch's longest, so its sums run over a length the others set. The MoE
    experts run one GEMM per expert over its tokens, a handful in a tiny model: a forward of
    the whole batch rounded some tokens unlike the trainer's micro-batches, at some thread
    counts (the routing tests failed at 2, 4 and 8 threads, and passed at 1 by luck).

    The trainer packs whole episodes (a Qwen3.5's turn by turn: rl.pack_rollout), so a turn's
    logprobs depend on the turns after it (they set the micro-batches): the engine follows the
    step's episodes through its generate calls (a later turn's request is an episode's ids and
    the tool's) and, after each call, writes every turn's logprobs again, from the episodes as
    they stand; after the last call they are the trainer's. A request that continues none of
    them (an eval) stops the following.

    `routed` (MoE): per sample, every layer's experts (a dense layer's rows 0) for each token
    that went through the model, the last generated one excepted, as vLLM returns them; for
    an episode of one turn only (as TorchEngine, a later turn returns none).
    """

    episodes = None  # the step's: [first prompt, [(context ids, Completion) per turn]]

    @property
    def returns_routes(self) -> bool:  # as vLLM's with its prefix cache on: an MoE's experts
        return bool(self.files and rl.sparse_layers(self.files.args))

    def first_turn(self, prompts, indices, step):
        self.episodes = None
        outs = super().first_turn(prompts, indices, step)
        self.episodes = [[list(p), [([], c)]] for p, cs in zip(prompts, outs) for c in cs]
        self.rescore()
        return outs

    def generate(self, prompts, n, seeds, max_tokens, temperature):
        outs = super().generate(prompts, n, seeds, max_tokens, temperature)
        if self.episodes is not None:
            self.follow(prompts, outs)
        return outs

    def follow(self, prompts, outs) -> None:
        """Each request's completion as the next turn of the episode it continues (requests
        come in episode order; episodes of equal ids go on alike, by the env contract)."""
        ids = [p + [t for ctx, c in turns for t in ctx + c.ids] for p, turns in self.episodes]
        k = 0
        for prompt, (out,) in zip(prompts, outs):
            while k < len(ids) and not (len(ids[k]) < len(prompt) and
                                        prompt[:len(ids[k])] == ids[k]):
                k += 1
            if k == len(ids):
                self.episodes = None  # not the step's episodes
                return
            self.episodes[k][1].append((prompt[len(ids[k]):], out))
            k += 1
        self.rescore()

    def rescore(self) -> None:
        """Every turn's logprobs (and a one-turn episode's experts) from the trainer's forward
        of the episodes as they stand."""
        episodes = [rl.Episode(None, [rl.Turn(ctx if k else p, c) for k, (ctx, c) in
                                      enumerate(turns)]) for p, turns in self.episodes]
        by_turn = bool(rl.gdn_layers(self.model.args))  # packed as the trainer packs them
        packed, episode = rl.pack_rollout(rl.episodes_rollout(episodes, False), by_turn)
        logprobs = torch.empty(len(packed.targets))  # (N,)
        routed = []
        with torch.no_grad():
            for part_seqs in rl.plan_micro_batches(packed, self.cfg):
                part, owned = rl.sub_pack(packed, part_seqs)
                logprobs[owned], _ = self.model(part, self.cfg.temperature)
                routed += self.routed_rows(part)
        turns = [c for _, ts in self.episodes for _, c in ts]
        for c, lp in zip(turns, logprobs.split([len(c.ids) for c in turns])):
            c.logprobs = lp.tolist()  # fp32 values: Python floats hold them exactly
        if rl.sparse_layers(self.model.args):
            for s, rows in enumerate(routed):  # s: a sequence of the packed batch
                p, ts = self.episodes[int(episode[s])]
                if len(ts) == 1:
                    ts[0][1].routed = rl.generated_routing(rows, len(p), len(ts[0][1].ids))

    def routed_rows(self, part) -> list:
        """vLLM's routed_experts of each sample of the forward just run: (L - 1, layers, k)."""
        args = self.model.args
        if not rl.sparse_layers(args):
            return []
        rows = torch.zeros(len(part.tokens), args.n_layers, args.moe_args.top_k,
                           dtype=torch.uint8)  # (T, layers, k)
        for i, b in enumerate(self.model.layers):
            if b.sparse:
                rows[:, i] = b.moe.topk.ids
        cu = part.cu_seqlens.tolist()
        return [rows[a : b - 1].numpy() for a, b in zip(cu, cu[1:])]


# The tiny CPU run most tests start from: 2 prompts x 3 samples, 5 new tokens, fp32.
CPU_RUN = dict(
    dtype="float32",
    num_prompts=2,
    group_size=3,
    max_new_tokens=5,
    max_model_len=128,
    micro_batch_tokens=128,
    lr=1e-2,
    entropy_coef=0.1,
    kl_coef=0.05,
    seed=3,
    save_every=2,
    keep_last=3,
    eval_size=4,  # the held-out eval runs, at the size of a tiny run
)

# A LoRA run's flags, on top of CPU_RUN.
LORA = dict(lora_rank=8, lr=1e-2, kl_coef=0.05)


# trainer name fragment -> vLLM name fragment (a Qwen3's), for comparing the two models' weights
TO_VLLM = [
    ("tok_embeddings", "model.embed_tokens"),
    ("layers.", "model.layers."),
    ("attention.wqkv", "self_attn.qkv_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("attention.q_norm", "self_attn.q_norm"),
    ("attention.k_norm", "self_attn.k_norm"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("feed_forward.w13", "mlp.gate_up_proj"),
    ("feed_forward.w2", "mlp.down_proj"),
    ("output.", "lm_head."),
]


def vllm_name(name: str) -> str:
    """vLLM's name of a trainer weight (the inverse of rl.trainer_name, by hand)."""
    if name == "norm.weight":
        return "model.norm.weight"
    for a, b in TO_VLLM:
        name = name.replace(a, b, 1) if a in name else name
    return name


def cpu_argv(path, log_dir, **overrides) -> list[str]:
    """Command-line flags for a tiny CPU run of the checkpoint at `path`."""
    argv = ["--model", str(path), "--log-dir", str(log_dir)]
    for name, value in {**CPU_RUN, **overrides}.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def run_cpu(argv, engine=None) -> str:
    """simple_rl.run with the stand-in engine on CPU; returns the final weights' sha256."""
    cfg, passed = rl.parse_config(argv)
    rl.validate(cfg)
    return rl.run(cfg, passed, engine or TorchEngine, "cpu")


def cpu_trainer_of_run(path, tmp_path, **overrides) -> rl.Trainer:
    """simple_rl.setup's Trainer for a tiny CPU run of `path` (the stand-in engine), no step."""
    cfg, given = rl.parse_config(cpu_argv(path, tmp_path / "runs", **overrides))
    rl.validate(cfg)
    return rl.setup(cfg, given, TorchEngine, "cpu")[0]


def main_cpu(argv, engine=None) -> int:
    """simple_rl.main with the stand-in engine on CPU; returns the exit code."""
    return rl.main(argv, engine or TorchEngine, "cpu")


def free_port() -> int:
    """A free TCP port on the loopback (another process could take it before it is used)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_hosts(script: Path, args, env: dict, per_host_env=None,
                     timeout: float = 900) -> list[str]:
    """`script args` under the README's multi-host command, as two "hosts" of one process each
    on this machine: two torchrun launchers (`--nnodes 2 --node-rank i`) meeting through a c10d
    rendezvous on localhost. per_host_env(i) adds host i's variables. Returns each launcher's
    output; a launcher left running at the end is stopped with its workers."""
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    hosts = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(i), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
         "--rdzv-id", f"simple_rl_{port}", str(script), *map(str, args)],
        env={**env, **(per_host_env(i) if per_host_env else {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True) for i in range(2)]
    try:
        outs = [h.communicate(timeout=timeout)[0] for h in hosts]
    finally:
        for h in hosts:  # the launcher and its workers share its session
            if h.poll() is None:
                os.killpg(h.pid, signal.SIGTERM)
                try:
                    h.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(h.pid, signal.SIGKILL)
    assert [h.returncode for h in hosts] == [0, 0], "\n".join(o[-3000:] for o in outs)
    return outs


def metrics_rows(run_dir: Path, timings: bool = True) -> list[dict]:
    """The run's metrics.jsonl, a dict per line; without the time/ keys if not `timings` (runs
    to compare differ only there)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
            .splitlines()]
    return rows if timings else [{k: v for k, v in r.items() if not k.startswith("time/")}
                                 for r in rows]


class CountingEngine(TorchEngine):
    """The stand-in engine, counting how often it was started."""

    made = 0

    def __init__(self, *a, **k):
        CountingEngine.made += 1
        super().__init__(*a, **k)


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(run_dir, tmp_path / "runs" / run_dir.name)
    return tmp_path / "runs" / run_dir.name


def copy_checkpoint(saved: Path, tmp_path: Path) -> Path:
    """A copy of the `saved` fixture's run (lock file included), so a test can damage it;
    returns the copy's checkpoint directory."""
    return copy_run(saved.parent.parent, tmp_path) / "checkpoints" / "step_000002"


# ---------------------------------------------------------------- runs that end in one sentence


class Killed(BaseException):
    """A stand-in for SIGKILL: nothing of simple_rl's catches it."""


def one_sentence(capsys, code: int, want: int, last_line: bool = False) -> str:
    """The exit code is `want` and stderr is one line of simple_rl's (an error, exit 2: its
    "simple_rl: error: "), without a traceback (`last_line`: what other libraries printed
    before it, e.g. datasets' progress bars or torch's warnings, is left out)."""
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    if last_line:
        err = err[-1:]
    assert code == want, err
    prefix = "simple_rl: error: " if want == 2 else "simple_rl: "
    assert len(err) == 1 and err[0].startswith(prefix), err
    assert "Traceback" not in (err[0] if last_line else captured.out + captured.err)
    return err[0]


def refuse(argv, capsys, last_line: bool = False) -> str:
    """main on argv: exit 2 in one sentence, before the engine starts."""
    capsys.readouterr()  # what came before (a checkpoint made for the test) is not the run's
    CountingEngine.made = 0
    err = one_sentence(capsys, main_cpu(argv, CountingEngine), 2, last_line)
    assert CountingEngine.made == 0, "the engine started before the error"
    return err


def exits(capsys, argv, want: int, engine=ExactEngine) -> str:
    """main on argv (after what came before, e.g. a checkpoint built for the test, is read):
    the exit code `want`, in one sentence; on the exact stand-in engine unless `engine`."""
    capsys.readouterr()
    return one_sentence(capsys, main_cpu(argv, engine), want)


def latest(tmp_path, *extra) -> list[str]:
    """Flags that resume the run `r` of tmp_path/runs from its latest checkpoint to step 3
    (`extra` after them: a --steps there wins)."""
    return ["--resume", "latest", "--run-name", "r", "--log-dir", str(tmp_path / "runs"),
            "--steps", "3", *map(str, extra)]


def edit_json(file: Path, **change) -> None:
    data = json.loads(file.read_text())
    data.update(change)
    file.write_text(json.dumps(data))


def make_moe_checkpoint(out: Path, *, vocab, hidden, layers, heads, kv_heads, head_dim, inter,
                        moe_inter, experts, top_k, mlp_only=(), norm_topk=True, tied=False,
                        dtype=torch.float32, device="cpu", max_pos=2048) -> Path:
    """A random Qwen3MoeForCausalLM saved by transformers, in the hub's format (experts per
    expert; config.json says num_experts, as Qwen/Qwen3-30B-A3B's does), plus a tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=inter, moe_intermediate_size=moe_inter, num_experts=experts,
        num_experts_per_tok=top_k, mlp_only_layers=list(mlp_only), norm_topk_prob=norm_topk,
        tie_word_embeddings=tied, max_position_embeddings=max_pos, eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    # router logits of std ~2: clear, varied choices
    model = random_model(Qwen3MoeForCausalLM, cfg, dtype, device, router_std=2 / hidden**0.5)
    model.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts", experts)  # the hub's key
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    make_tokenizer(out, vocab_size=min(vocab, 320))
    return out


def cpu_trainer(path, kernels=None):
    """The trainer's model of the checkpoint at `path`, fp32 on CPU (reference kernels)."""
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), args)
    return rl.build_model(args, state, kernels or bib.reference_kernels(), torch.float32, "cpu")


def random_ids(lengths, vocab=384, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_custom_backwards_match_autograd(path, lengths) -> None:
    """The whole model with every hand-written backward against plain autograd (same
    forwards): every parameter's gradient close, and none all zero."""
    a = cpu_trainer(path, bib.custom_backward_kernels(bib.reference_forwards()))
    b = cpu_trainer(path)
    ids = random_ids(lengths)
    p = rl.pack([x[:3] for x in ids], [x[3:] for x in ids])
    for m in (a, b):
        lp, ent = m(p, 0.9)
        (lp.sum() + 0.1 * ent.sum()).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=2e-5, rtol=1e-4, msg=name)
        assert pa.grad.abs().sum() > 0, name


def random_step(rng, turns=(1,)) -> tuple:
    """A small random step for the memory bounds' checks: (config, ranks, shortest and longest
    first prompt), its episodes of up to a choice of `turns` turns (--env when more than one)."""
    n = rng.choice(turns)
    c = rl.Config(num_prompts=rng.choice([2, 4, 8]), group_size=rng.choice([2, 4]),
                  max_new_tokens=rng.choice([8, 32, 96]), max_model_len=256,
                  env="calc" if n > 1 else "", max_turns=n,
                  micro_batch_tokens=rng.choice([256, 512, 1024, 4096]))
    world = rng.choice([1, 2])
    shortest = rng.randint(1, 100)
    return c, world, shortest, rng.randint(shortest, 256 - c.max_new_tokens)


def two_ranks(monkeypatch, *other):
    """rl.all_reduce as if a second rank held `other` (its tensors, in call order)."""
    calls = iter(other)

    def all_reduce(t, op=dist.ReduceOp.SUM):
        o = torch.tensor(next(calls), dtype=t.dtype)
        t.copy_(torch.maximum(t, o) if op == dist.ReduceOp.MAX else t + o)
        return t

    monkeypatch.setattr(rl, "all_reduce", all_reduce)
