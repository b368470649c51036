"""Warm start: a small Qwen3 or Qwen3.5 that half knows simple_rl's arithmetic task, from scratch.

RL can only sharpen what a model already does sometimes: a random model never writes a right
answer, its reward is 0 and every GRPO advantage is 0. This script makes a model worth
training with RL, with nothing downloaded:

  1. a byte-level BPE tokenizer trained on the task's own text, digits split one per token,
     with Qwen3's special tokens and the shape of its chat template;
  2. a Qwen3ForCausalLM of about 25M parameters (8 layers, hidden 512, GQA, head_dim 128),
     trained with plain next-token loss on the completions only, where by default 70% of
     the completions guess the value at once (`Answer: 3896`, --direct-fraction) and 30% work
     it out one operation per line:

         47 * 83 = 47 * 80 + 47 * 3 = 3760 + 141 = 3901
         3901 - 5 = 3896
         Answer: 3896

  3. stopped early on purpose, after --steps (500): it mostly guesses, and mostly wrong, so
     GRPO has room to teach it that working the problem out pays (measured on an H200:
     held-out greedy accuracy 21.9% here, on 256 problems with transformers' generate; 24.6%
     in simple_rl's first eval, on 512 with vLLM);
  4. saved as a Hugging Face checkpoint (bf16 safetensors, config, tokenizer) that
     transformers, vLLM and `simple_rl.py --model` load.

It prints a line every --log-every steps (loss, time so far, seconds a step, time left), the
held-out accuracy in it every --eval-every. The training problems never include simple_rl's
held-out problems (`rl.EVAL_SEED`).

    python examples/warm_start.py --out warm/qwen3-arith        # one H200: about 1 minute
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model warm/qwen3-arith --eval-every 25 ...

With `--tool lookup` it warm-starts simple_rl's multi-hop task instead (`--env lookup`): every
answer searches the person asked about (<search>NAME</search>, the tool's entry as simple_rl
renders it). By default 70% then answer that entry's age (--direct-fraction 0.7: right only by
chance); the rest search the mentor too, and each further mentor the question needs with
probability --deeper-fraction (0.1), then answer the last entry's age. Such a warm start never
searches past what the question needs, but rarely as far: a question of one link is answered
right 30% of the time, of two 3%, of four 0.03%. GRPO must learn to chain, a link at a time.

    python examples/warm_start.py --tool lookup --out warm/lookup     # one H200: about 3 minutes

With `--arch qwen3.5` the model is a Qwen3_5ForCausalLM of about the same size (27.6M params):
every fourth layer full attention (output-gated, head_dim 128, a quarter of each head rotated),
the others Gated DeltaNet linear attention (4 key and 8 value heads, of 64 at --dim 512; a
causal conv of width 4); the tokenizer, data, loss and schedule are the ones above. Without
flash-linear-attention and causal-conv1d installed, transformers runs Gated DeltaNet in plain
PyTorch: correct, and slower (on a CPU a step takes about 3 times Qwen3's).

    python examples/warm_start.py --arch qwen3.5 --out warm/qwen35-arith

On a CPU the default size takes hours (a step of 256 sequences is about 3 TFLOP of forward and
backward): its progress lines say how long.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA

import torch  # noqa: E402

import simple_rl as rl  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# The shape of Qwen3's template: user and assistant turns, and the empty think block Qwen3
# writes when thinking is off (simple_rl's default), so prompts look as they would for Qwen3.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+) ([-+]) (\d+)\?")


def direct_answer(problem: rl.Problem) -> str:
    """The guess: the value at once, no steps (a small model gets few of these right)."""
    return f"Answer: {problem.answer}"


def worked_solution(question: str) -> str:
    """One operation per line; a product a * b splits b into tens and units first."""
    a, op1, b, op2, c = QUESTION.match(question).groups()
    a, b, c = int(a), int(b), int(c)
    v1 = rl.ARITH[op1](a, b)
    v2 = rl.ARITH[op2](v1, c)
    if op1 == "*" and b >= 10:
        tens, units = b // 10 * 10, b % 10
        first = f"{a} * {b} = {a} * {tens} + {a} * {units} = {a * tens} + {a * units} = {v1}"
    else:
        first = f"{a} {op1} {b} = {v1}"
    return f"{first}\n{v1} {op2} {c} = {v2}\nAnswer: {v2}"


def progress(step: int, steps: int, loss: float, spent: float, acc: float | None = None) -> str:
    """One progress line, eval or not: the time left is the pace so far (evals included) times
    the steps left."""
    held_out = f" | held-out greedy accuracy {acc:.3f}" if acc is not None else ""
    eta = rl.format_duration(spent / step * (steps - step))
    return (f"step {step}/{steps} | loss {loss:.4f}{held_out} | {rl.format_duration(spent)} "
            f"({spent / step:.2f} s/step) | ETA {eta}")


def make_tokenizer(vocab_size: int, seed: int, tool: str = ""):
    """Byte-level BPE on the task's text; digits are never merged (one token per digit). With
    `tool`, its tags (<calc> and </calc>, or <search> and </search>) are one token each (not
    special ones: the env reads them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    if tool == "lookup":
        table = rl.lookup_table()
        corpus = [f"user\n{p.question}\nassistant\n{rl.search(table, name)}"
                  for p, name in zip(rl.lookup_problems(table), table)]
    else:
        corpus = [f"user\n{p.question}\nassistant\n{worked_solution(p.question)}"
                  for p in rl.arithmetic_problems(2000, seed)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2 * bool(tool), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # its bar printed blank lines
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    if tool:
        fast.add_tokens(["<search>", "</search>"] if tool == "lookup" else ["<calc>", "</calc>"])
    return fast


def tool_answer(problem: rl.Problem, tokenizer) -> list[tuple[list[int], bool]]:
    """A calculator call, as (ids, trained) pieces: <calc>the sum</calc>, the tool's message as
    simple_rl's episode renders it (not trained on), then the answer."""
    a, op1, b, op2, c = QUESTION.match(problem.question).groups()
    ids = tokenizer([f"<calc>{a} {op1} {b} {op2} {c}</calc>", f"Answer: {problem.answer}"],
                    add_special_tokens=False)["input_ids"]
    tool = rl.tool_message_ids(tokenizer, [problem.answer], rl.Config())[0]
    return [(ids[0], True), (tool, False), (ids[1], True)]


LOOKUP_QUESTION = re.compile(r"How old is ((?:the mentor of )+)(\w+)\?")


def lookup_calls(problem: rl.Problem, rng: random.Random, direct: float, deeper: float) -> int:
    """How many searches the warm start shows for a question: 1 with probability `direct`, else
    2, then one more for each further link the question needs, each with probability `deeper`
    (the chain stops at the first miss); never more than the question needs."""
    if rng.random() < direct:
        return 1
    need = 1 + LOOKUP_QUESTION.match(problem.question)[1].count("mentor")  # 2 or more
    calls = 2
    while calls < need and rng.random() < deeper:
        calls += 1
    return calls


def lookup_answer(problem: rl.Problem, tokenizer, calls: int) -> list[tuple[list[int], bool]]:
    """`calls` searches along the question's chain, as (ids, trained) pieces, each followed by
    the tool's entry as simple_rl's episode renders it (not trained on), then the last entry's
    age as the answer: right when `calls` is all the question needs."""
    table = rl.lookup_table()
    names = rl.lookup_chain(table, LOOKUP_QUESTION.match(problem.question)[2], calls - 1)
    parts = []
    for n in names:
        call = tokenizer(f"<search>{n}</search>", add_special_tokens=False)["input_ids"]
        tool = rl.tool_message_ids(tokenizer, [rl.search(table, n)], rl.Config())[0]
        parts += [(call, True), (tool, False)]
    age = str(table[names[-1]][1])
    return parts + [(tokenizer(f"Answer: {age}", add_special_tokens=False)["input_ids"], True)]


# Qwen3.5's linear attention keeps its 9B's proportions at any --dim: value_dim = hidden and
# key_dim = hidden / 2, here in 4 key heads and 8 value heads (of 64 at --dim 512).
LINEAR_K_HEADS, LINEAR_V_HEADS = 4, 8


def make_model(tokenizer, a: argparse.Namespace):
    """A Qwen3ForCausalLM, or (--arch qwen3.5) a Qwen3_5ForCausalLM with every fourth layer full
    attention (output-gated, a quarter of each head rotated) and the others Gated DeltaNet linear
    attention; the same embeddings, attention heads and MLP."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=a.vocab, hidden_size=a.dim, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=128,
        intermediate_size=a.ffn, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    if a.arch == "qwen3":
        rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
        return Qwen3ForCausalLM(Qwen3Config(**shape, rope_parameters=rope))
    # Qwen3.5's pattern and rope: three linear-attention layers then a full one; theta 1e7, a
    # quarter of each head rotated
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
             for i in range(a.layers)]
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    linear = dict(linear_num_key_heads=LINEAR_K_HEADS, linear_num_value_heads=LINEAR_V_HEADS,
                  linear_key_head_dim=a.dim // 2 // LINEAR_K_HEADS,
                  linear_value_head_dim=a.dim // LINEAR_V_HEADS, linear_conv_kernel_dim=4)
    config = Qwen3_5TextConfig(**shape, **linear, layer_types=kinds, hidden_act="silu",
                               rms_norm_eps=1e-6, rope_parameters=rope)
    # Without flash-linear-attention and causal-conv1d, transformers runs Gated DeltaNet in plain
    # PyTorch (correct, slower) and warns so once per op; the docstring says it instead.
    logging.getLogger("transformers.integrations.hub_kernels").addFilter(
        lambda record: "falling back to its reference PyTorch" not in record.getMessage())
    return Qwen3_5ForCausalLM(config)


def answer_parts(problems: list[rl.Problem], direct: list[bool], tokenizer, tool: str = ""
                 ) -> list[list[tuple[list[int], bool]]]:
    """Each arithmetic problem's completion as (ids, trained) pieces: direct[i], answered at
    once, else worked out step by step (with `tool`: by a calculator call)."""
    texts = [direct_answer(p) if d else worked_solution(p.question)
             for p, d in zip(problems, direct)]
    answers = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [tool_answer(q, tokenizer) if tool and not d else [(c, True)]
            for q, d, c in zip(problems, direct, answers)]


def batch_of(problems: list[rl.Problem], parts: list[list[tuple[list[int], bool]]], tokenizer,
             device):
    """(input_ids, attention_mask, labels), right-padded: each prompt, then its completion's
    pieces parts[i] and eos; the loss sees the trained pieces and the eos."""
    prompts = rl.format_prompts(problems, tokenizer, rl.Config())  # (B, P_b): simple_rl's ids
    from torch.nn.utils.rnn import pad_sequence

    eos = tokenizer.eos_token_id
    seqs = [torch.tensor(p + [t for ids, _ in ps for t in ids] + [eos])
            for p, ps in zip(prompts, parts)]
    targets = [torch.tensor([-100] * len(p) + [t if own else -100 for ids, own in ps for t in ids]
                            + [eos]) for p, ps in zip(prompts, parts)]
    ids = pad_sequence(seqs, batch_first=True, padding_value=tokenizer.pad_token_id)  # (B, L)
    labels = pad_sequence(targets, batch_first=True, padding_value=-100)  # (B, L)
    mask = pad_sequence([torch.ones_like(t) for t in seqs], batch_first=True)  # (B, L)
    return ids.to(device), mask.to(device), labels.to(device)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[rl.Problem], device,
                    max_new_tokens: int = 64) -> float:
    """Greedy decoding of simple_rl's prompts, scored by simple_rl's reward. Prompts of one
    length are decoded together, so no padding enters the computation."""
    model.eval()
    prompts = rl.format_prompts(problems, tokenizer, rl.Config())
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    score = 0.0
    for idx in by_length.values():
        ids = torch.tensor([prompts[i] for i in idx], device=device)  # (B, P)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        score += sum(rl.reward(t, problems[i].answer) for t, i in zip(texts, idx))
    model.train()
    return score / len(problems)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the HF checkpoint")
    p.add_argument("--seed", type=int, default=0, help="model init, problems and their mix")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps (stopped early on "
                   "purpose: the model still mostly guesses)")
    p.add_argument("--direct-fraction", type=float, default=0.7,
                   help="share of training completions that guess the answer without steps")
    p.add_argument("--deeper-fraction", type=float, default=0.1,
                   help="--tool lookup: the chance that a chain of searches goes one link further "
                   "when the question needs it (above)")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--eval-every", type=int, default=100, help="optimizer steps between evals")
    p.add_argument("--eval-size", type=int, default=256, help="held-out problems per eval")
    p.add_argument("--batch", type=int, default=256, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate")
    p.add_argument("--arch", default="qwen3", choices=("qwen3", "qwen3.5"),
                   help="qwen3.5: a Qwen3_5ForCausalLM of about the same size, every fourth "
                   "layer full attention and the others Gated DeltaNet linear attention")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--dim", type=int, default=512, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="query heads (head_dim 128)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--ffn", type=int, default=1536, help="MLP intermediate size")
    p.add_argument("--vocab", type=int, default=512, help="the model's vocabulary (the "
                   "tokenizer's must fit)")
    p.add_argument("--tool", nargs="?", const="calc", default="", choices=("calc", "lookup"),
                   help="calc: answers that are not guesses call the calculator (<calc>a op b "
                   "op c</calc>, then 'Answer: N') instead of working the sum out, a warm start "
                   "for simple_rl.py --env calc; lookup: a warm start for --env lookup (above)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to train")
    a = p.parse_args()
    split = math.lcm(LINEAR_V_HEADS, 2 * LINEAR_K_HEADS)
    if a.arch == "qwen3.5" and a.dim % split:
        sys.exit(f"warm_start: --arch qwen3.5 splits --dim into {LINEAR_V_HEADS} value heads "
                 f"(and half of it into {LINEAR_K_HEADS} key heads); choose a multiple of {split}.")
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"warm_start: {out} is not empty; choose another --out.")

    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    tokenizer = make_tokenizer(a.vocab, a.seed, a.tool)
    assert len(tokenizer) <= a.vocab, "the tokenizer must fit the model's vocab"
    model = make_model(tokenizer, a).to(device)
    n_params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    cfg = rl.Config(eval_size=a.eval_size, seed=0)
    _, heldout = rl.arithmetic_split(cfg)  # what simple_rl scores at its default seed
    never = rl.heldout_arithmetic_questions()  # every problem simple_rl may hold out
    # the lookup task holds out its first --eval-size questions: train past the most it may
    lookup_pool = rl.lookup_split(rl.Config(eval_size=rl.LOOKUP_PEOPLE // 2))[0]
    rng = random.Random(a.seed)
    print(f"warm start | {n_params / 1e6:.1f}M params | vocab {len(tokenizer)} | "
          f"{len(heldout)} held-out problems | device {device}", flush=True)

    history = []
    began = time.perf_counter()
    for step in range(1, a.steps + 1):
        problems = rng.sample(lookup_pool, a.batch) if a.tool == "lookup" else [
            q for q in rl.arithmetic_problems(a.batch + 16, rng.randrange(2**31))
            if q.question not in never][: a.batch]
        if a.tool == "lookup":
            parts = [lookup_answer(q, tokenizer, lookup_calls(q, rng, a.direct_fraction,
                                                                a.deeper_fraction))
                     for q in problems]
        else:
            parts = answer_parts(problems, [rng.random() < a.direct_fraction for _ in problems],
                                 tokenizer, a.tool)
        ids, mask, labels = batch_of(problems, parts, tokenizer, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        acc = None
        if step % a.eval_every == 0 or step == a.steps:
            minutes = (time.perf_counter() - began) / 60
            # one turn, no tool: the lookup task is scored by simple_rl's episodes
            acc = math.nan if a.tool == "lookup" else greedy_accuracy(model, tokenizer,
                                                                       heldout, device)
            history.append(dict(step=step, minutes=round(minutes, 2), loss=loss.item(),
                                heldout_accuracy=acc))
        if step % a.log_every == 0 or acc is not None:
            print(progress(step, a.steps, loss.item(), time.perf_counter() - began, acc),
                  flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id,
                                            tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.save_pretrained(out)
    report = dict(args=vars(a), params=n_params, history=history)
    (out / "warm_start.json").write_text(json.dumps(report, indent=1))
    print(f"saved {out} | step {a.steps} | held-out greedy accuracy "
          f"{history[-1]['heldout_accuracy']:.3f}", flush=True)  # nan: the lookup task


if __name__ == "__main__":
    main()
