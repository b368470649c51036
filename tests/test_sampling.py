"""Around the engine's sampling: the garbage collector paused while it decodes and young-only
while it sleeps, and its logprobs read in sample order, for the tokens it sampled. (vLLM's
sampler needs no patch: its noise is a hash of the request's seed, position and token id; the
GPU suite checks that three prompts alone sample what they sample in the batch.)"""

import sys
import types

import pytest


def engine_on(monkeypatch, llm, cfg=None):
    """A VLLMEngine that never started (only its own code runs): vllm's two names stood in,
    `llm` as its LLM."""
    import simple_rl as rl

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        TokensPrompt=dict, SamplingParams=lambda **k: k))
    engine = object.__new__(rl.VLLMEngine)
    engine.cfg, engine.stop_ids, engine.returns_routes, engine.llm = cfg or rl.Config(), [0], \
        False, llm
    return engine


def completion(index, tokens, logprobs, reason="length"):
    """vLLM's CompletionOutput as the rollout reads it (flat logprobs: one a token)."""
    flat = types.SimpleNamespace(token_ids=list(tokens), logprobs=list(logprobs))
    return types.SimpleNamespace(index=index, token_ids=tuple(tokens), logprobs=flat,
                                 finish_reason=reason, routed_experts=None)


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

    import simple_rl as rl

    seen = []

    class LLM:  # vLLM's LLM as the rollout calls it; here its engine dies mid-rollout
        def generate(self, prompts, params, use_tqdm, lora_request=None):
            seen.append((len(prompts), gc.isenabled()))
            raise RuntimeError("engine died")

    engine = engine_on(monkeypatch, LLM())
    with pytest.raises(RuntimeError, match="engine died"):
        engine.first_turn([[1, 2], [3]], [0, 1], 0)
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
    import simple_rl as rl

    asked = []

    class LLM:
        def generate(self, prompts, params, use_tqdm, lora_request=None):
            asked.extend(params)
            return [types.SimpleNamespace(prompt_token_ids=[1, 2], outputs=[
                        completion(1, [7], [-0.5], "stop"), completion(0, [5, 6], [-1.0, -2.0])]),
                    types.SimpleNamespace(prompt_token_ids=[3], outputs=[
                        completion(0, [8, 9, 4], [-0.25, -0.125, -3.0]), completion(1, [], [])])]

    engine = engine_on(monkeypatch, LLM(), rl.Config(group_size=2))
    outs = engine.first_turn([[1, 2], [3]], [0, 1], 0)
    samples = [c for cs in outs for c in cs]
    assert [len(cs) for cs in outs] == [2, 2]  # each prompt's G samples
    assert [c.ids for c in samples] == [[5, 6], [7], [8, 9, 4], []]
    assert [x for c in samples for x in c.logprobs] == [-1.0, -2.0, -0.5, -0.25, -0.125, -3.0]
    assert [c.stopped for c in samples] == [False, True, False, False]
    assert all(p["logprobs"] == 0 and p["flat_logprobs"] for p in asked)


def test_completion_logprobs_refuses_logprobs_of_other_tokens():
    import simple_rl as rl

    def out(tokens, logged, logprobs):
        return types.SimpleNamespace(token_ids=tuple(tokens), logprobs=types.SimpleNamespace(
            token_ids=list(logged), logprobs=list(logprobs)))

    assert rl.completion_logprobs(out([4, 5], [4, 5], [-1.5, -0.5])) == [-1.5, -0.5]
    with pytest.raises(RuntimeError, match="2 logprobs for 1 tokens"):
        rl.completion_logprobs(out([4], [4, 5], [-1.5, -0.5]))  # top-k entries, not one a token
    with pytest.raises(RuntimeError, match="other tokens"):
        rl.completion_logprobs(out([4, 5], [4, 6], [-1.5, -0.5]))


def test_generate_at_t0_asks_for_t0_and_a_training_step_for_its_temperature(monkeypatch):
    """VLLMEngine.generate as the greedy eval calls it (T = 0, one sample, no seed) asks vLLM
    for T = 0, not --temperature, with each prompt's own token budget, and drops the prefix
    cache it filled (the next rollout computes what it would without an eval); a step's
    sampling parameters keep --temperature, the group and the step's seed. A stand-in vllm
    module and LLM record what is asked."""
    import simple_rl as rl

    asked = []

    class LLM:
        def generate(self, prompts, params, use_tqdm, lora_request=None):
            asked.extend(params)
            return [types.SimpleNamespace(outputs=[completion(0, [5], [-0.1], "stop")])
                    for p in params]

        def reset_prefix_cache(self):
            asked.append("reset")

    engine = engine_on(monkeypatch, LLM(),
                       rl.Config(group_size=4, temperature=0.9, max_new_tokens=7))
    engine.generate([[1, 2], [3]], 1, [None, None], [5, 6], 0.0)
    assert [(p["temperature"], p["n"], p["seed"], p["max_tokens"]) for p in asked[:2]] == \
        [(0.0, 1, None, 5), (0.0, 1, None, 6)]
    assert asked[2] == "reset"
    p = engine.sampling_params(11)
    assert (p["temperature"], p["n"], p["seed"], p["max_tokens"]) == (0.9, 4, 11, 7)
