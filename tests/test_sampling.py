"""The engine's seeded sampling noise: one launch for every seeded request, run by Triton's CPU
interpreter. A row's noise must depend on its request's seed and draw count only, advance the
generator as vLLM expects, be Exp(1), and make argmax(p / q) a draw from p."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

NOISE_CHECK = """
import json, math, torch, simple_rl as rl

class Gen:  # a CUDA generator's interface: its seed and its Philox offset
    def __init__(self, seed):
        self.seed, self.offset = seed, 0
    def initial_seed(self):
        return self.seed
    def get_offset(self):
        return self.offset
    def set_offset(self, offset):
        self.offset = offset

V = 5000
def draw(gens):  # {row: generator} -> q (R, V)
    q = torch.full((max(gens) + 1, V), -1.0)
    rl.seeded_exponential_(q, gens)
    return q

a, b, c = Gen(8), Gen(16), Gen(2**64 - 8)  # the last one's seed needs all 64 bits
first = draw({0: a, 1: b, 2: c})
out = dict(offsets=[g.offset for g in (a, b, c)])
a.offset = b.offset = c.offset = 0
moved = draw({3: c, 0: b, 1: a})  # other rows, other order, other batch
out["batch_free"] = [torch.equal(first[0], moved[1]), torch.equal(first[1], moved[0]),
                     torch.equal(first[2], moved[3])]
out["untouched_row"] = bool((moved[2] == -1).all())
second = draw({0: a})
a.offset -= 4  # what vLLM does when it discards a token sampled for a partial prefill
out["next_draw_differs"] = not torch.equal(second[0], first[0])
out["rewind_redraws"] = torch.equal(draw({0: a})[0], second[0])
out["rows_differ"] = not torch.equal(first[0], first[1])

big = torch.empty(1, 2**16)
rl.seeded_exponential_(big, {0: Gen(12345)})
x = big[0].double()
out["mean"], out["var"] = x.mean().item(), x.var().item()
out["tail"] = (x > 1).double().mean().item()  # P(q > 1) = 1/e
p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
wins = torch.argmax(p / big[0].double().view(-1, 4), dim=-1)  # 16384 races of 4 tokens
out["freq"] = torch.bincount(wins, minlength=4).double().div(len(wins)).tolist()
print(json.dumps(out))
"""


def test_seeded_noise_is_batch_free_advances_like_vllm_and_samples_p():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", NOISE_CHECK], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["offsets"] == [4, 4, 4]  # one draw = offset + 4, as one exponential_ call
    assert out["batch_free"] == [True, True, True] and out["untouched_row"]
    assert out["next_draw_differs"] and out["rewind_redraws"] and out["rows_differ"]
    # Exp(1) over 65,536 draws: mean and variance 1 (sd of the mean 0.004), P(q > 1) = 1/e
    assert abs(out["mean"] - 1) < 0.02 and abs(out["var"] - 1) < 0.05
    assert abs(out["tail"] - 0.36788) < 0.01
    # the exponential race picks token i with probability p_i (sd <= 0.004 over 16,384 races)
    for got, want in zip(out["freq"], [0.5, 0.3, 0.15, 0.05]):
        assert abs(got - want) < 0.02, out["freq"]


@pytest.mark.gpu
def test_gpu_seeded_noise_with_cuda_generators_is_batch_free():
    """On the GPU, with vLLM's kind of generators (CUDA, seeded): 256 requests over Qwen3's
    vocabulary in one launch give each row the bits it gets alone, at another row."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import simple_rl as rl

    V = 151_936
    gens = [torch.Generator(device="cuda").manual_seed(8 * i) for i in range(256)]
    q = torch.empty(256, V, device="cuda")
    rl.seeded_exponential_(q, dict(enumerate(gens)))
    assert [g.get_offset() for g in gens] == [4] * 256
    assert torch.isfinite(q).float().mean() > 0.999 and (q > 0).all()
    assert abs(q.double().mean().item() - 1) < 1e-3  # 39M draws of Exp(1)
    for i in (0, 77, 255):
        gens[i].set_offset(0)
        alone = torch.empty(3, V, device="cuda")
        rl.seeded_exponential_(alone, {2: gens[i]})
        assert torch.equal(alone[2], q[i])


def test_gc_is_paused_inside_a_rollout_and_restored_after_even_on_error():
    import gc

    import simple_rl as rl

    assert gc.isenabled()
    with rl.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with rl.gc_paused():
            raise ValueError
    assert gc.isenabled()
    gc.disable()  # a caller that had switched it off keeps it off
    try:
        with rl.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_rollout_decodes_with_the_collector_paused(monkeypatch):
    import gc
    import types

    import simple_rl as rl

    seen = []

    class LLM:  # vLLM's LLM as the rollout calls it; here its engine dies mid-rollout
        def generate(self, prompts, params, use_tqdm, lora_request=None):
            seen.append((len(prompts), gc.isenabled()))
            raise RuntimeError("engine died")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        TokensPrompt=dict, SamplingParams=lambda **k: k))
    engine = object.__new__(rl.VLLMEngine)  # no engine start: only rollout's own code runs
    engine.cfg, engine.eos_ids, engine.moe, engine.llm = rl.Config(), [0], False, LLM()
    with pytest.raises(RuntimeError, match="engine died"):
        engine.rollout([[1, 2], [3]], [0, 1], 0)
    assert seen == [(2, False)] and gc.isenabled()


def test_the_engine_sleeps_with_young_collections_only_and_restores_gc_collect():
    import gc
    import weakref

    import simple_rl as rl

    class Cycle:
        def __init__(self):
            self.me = self

    old, young, freed = Cycle(), None, {}
    gc.collect()  # `old` survives a full pass: it now sits in the oldest generation
    old_ref = weakref.ref(old)
    del old

    class LLM:  # vLLM's sleep ends with a full gc.collect()
        def sleep(self, level):
            freed["n"] = gc.collect()
            freed["old"], freed["young"] = old_ref() is None, young_ref() is None

    engine = object.__new__(rl.VLLMEngine)
    engine.cfg, engine.asleep, engine.llm = rl.Config(), False, LLM()
    young = Cycle()
    young_ref = weakref.ref(young)
    del young
    plain = gc.collect
    engine.sleep()
    assert engine.asleep and freed["young"] and not freed["old"]  # only the young garbage went
    assert gc.collect is plain and gc.collect() >= 1 and old_ref() is None  # a full pass again

    class Dying(LLM):
        def sleep(self, level):
            raise RuntimeError("engine died")

    engine.asleep, engine.llm = False, Dying()
    with pytest.raises(RuntimeError, match="engine died"):
        engine.sleep()
    assert gc.collect is plain


def test_the_rollout_reads_vllms_flat_logprobs_in_sample_order(monkeypatch):
    import types

    import simple_rl as rl

    def completion(index, tokens, logprobs, reason="length"):
        flat = types.SimpleNamespace(token_ids=list(tokens), logprobs=list(logprobs))
        return types.SimpleNamespace(index=index, token_ids=tuple(tokens), logprobs=flat,
                                     finish_reason=reason)

    asked = []

    class LLM:
        def generate(self, prompts, params, use_tqdm, lora_request=None):
            asked.extend(params)
            return [types.SimpleNamespace(prompt_token_ids=[1, 2], outputs=[
                        completion(1, [7], [-0.5], "stop"), completion(0, [5, 6], [-1.0, -2.0])]),
                    types.SimpleNamespace(prompt_token_ids=[3], outputs=[
                        completion(0, [8, 9, 4], [-0.25, -0.125, -3.0]), completion(1, [], [])])]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        TokensPrompt=dict, SamplingParams=lambda **k: k))
    engine = object.__new__(rl.VLLMEngine)
    engine.cfg, engine.eos_ids, engine.moe = rl.Config(group_size=2), [0], False
    engine.llm = LLM()
    outs = engine.rollout([[1, 2], [3]], [0, 1], 0)
    samples = [c for cs in outs for c in cs]
    assert [len(cs) for cs in outs] == [2, 2]  # each prompt's G samples
    assert [c.ids for c in samples] == [[5, 6], [7], [8, 9, 4], []]
    assert [x for c in samples for x in c.logprobs] == [-1.0, -2.0, -0.5, -0.25, -0.125, -3.0]
    assert [c.stopped for c in samples] == [False, True, False, False]
    assert all(p["logprobs"] == 0 and p["flat_logprobs"] for p in asked)


def test_completion_logprobs_refuses_logprobs_of_other_tokens():
    import types

    import simple_rl as rl

    def out(tokens, logged, logprobs):
        return types.SimpleNamespace(token_ids=tuple(tokens), logprobs=types.SimpleNamespace(
            token_ids=list(logged), logprobs=list(logprobs)))

    assert rl.completion_logprobs(out([4, 5], [4, 5], [-1.5, -0.5])) == [-1.5, -0.5]
    with pytest.raises(RuntimeError, match="2 logprobs for 1 tokens"):
        rl.completion_logprobs(out([4], [4, 5], [-1.5, -0.5]))  # top-k entries, not one a token
    with pytest.raises(RuntimeError, match="other tokens"):
        rl.completion_logprobs(out([4, 5], [4, 6], [-1.5, -0.5]))
