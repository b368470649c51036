"""Tiny local Qwen3 checkpoints, a tiny tokenizer, and a CPU stand-in for the vLLM engine."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import simple_rl as rl

SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def make_tokenizer(out: Path, vocab_size: int = 320):
    """A byte-level BPE trained locally on arithmetic text; eos = <|endoftext|> (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [p.prompt + " " + p.answer + " Answer: " + p.answer for p in rl.arithmetic_problems(500, 0)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def make_checkpoint(out: Path, *, tied: bool = True, layers: int = 2, vocab: int = 384, hidden: int = 256,
                    heads: int = 4, kv_heads: int = 2, head_dim: int = 128, inter: int = 512, shard: str | None = None,
                    seed: int = 0, dtype=torch.float32, max_pos: int = 2048, device: str = "cpu") -> Path:
    """A random Qwen3ForCausalLM saved by transformers (GQA, head_dim 128 by default), plus tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
                      tie_word_embeddings=tied, max_position_embeddings=max_pos, eos_token_id=0,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # HF inits norms to 1; random norms make the tests see every weight
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kw)
    make_tokenizer(out, vocab_size=min(vocab, 320))
    return out


class TorchEngine:
    """CPU stand-in for VLLMEngine: samples from its own copy of the policy, no KV cache.

    It recomputes the full prefix for each new token (fine for tiny models) and
    returns processed logprobs of softmax(logits / T), like vLLM does.
    """

    def __init__(self, cfg: rl.Config, path=None, eos_ids=(0,)):
        self.model = None  # a copy of the policy, made by the first push
        self.cfg, self.eos_ids = cfg, set(eos_ids)

    @torch.no_grad()
    def rollout(self, prompts, step):
        cfg = self.cfg
        seqs = [list(p) for p in prompts for _ in range(cfg.group_size)]
        gens = [torch.Generator().manual_seed(rl.sample_seed(cfg, step, i // cfg.group_size) * 97 + i % cfg.group_size) for i in range(len(seqs))]
        comps = [[] for _ in seqs]
        lps = [[] for _ in seqs]
        live = list(range(len(seqs)))
        for _ in range(cfg.max_new_tokens):
            if not live:
                break
            full = [seqs[i] + comps[i] for i in live]
            packed = rl.pack(full, [[] for _ in full])
            h = self.model(packed.tokens, packed.positions, packed.cu_seqlens, packed.max_seqlen)
            last = h[packed.cu_seqlens[1:].long() - 1]  # (B_live, dim)
            z = self.model.logits(last).float() / cfg.temperature
            lp = torch.log_softmax(z, -1)
            for row, i in enumerate(live):
                t = int(torch.multinomial(lp[row].exp(), 1, generator=gens[i]))
                comps[i].append(t)
                lps[i].append(float(lp[row, t]))
            live = [i for i in live if comps[i][-1] not in self.eos_ids]
        return rl.Rollout(prompts=seqs, completions=comps, logprobs=torch.tensor([x for l in lps for x in l]),
                          stopped=[c[-1] in self.eos_ids for c in comps])

    def push(self, model):
        if self.model is None:
            self.model = copy.deepcopy(model).requires_grad_(False)
        self.model.load_state_dict(model.state_dict())
