"""Qwen3-MoE on CPU: load, forward vs transformers, HF round trip, config errors, the memory
estimate, routing-parity counting, and a short simple_rl run with a stand-in engine."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import (ExactEngine, cast_once_changes_no_bit, cpu_argv, main_cpu,
                     make_moe_checkpoint, metrics_rows, random_step)

TINY_MOE = dict(vocab=384, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, inter=96,
                moe_inter=32, experts=8, top_k=2, mlp_only=(1,), norm_topk=True, tied=False)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp("moe"), **TINY_MOE)


def load(path):
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    return args, rl.load_hf_state_dict(path)


def test_args_and_hub_format(moe_ckpt):
    args, hf = load(moe_ckpt)
    assert rl.sparse_layers(args) == (0, 2) and args.moe_enabled
    assert args.moe_args.num_experts == 8 and args.moe_args.top_k == 2
    assert args.moe_args.route_norm and args.moe_inter_dim == 32
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in hf
    assert "model.layers.1.mlp.gate_proj.weight" in hf  # the mlp_only layer is dense
    rl.check_weight_headers(moe_ckpt, args)  # names and shapes as config.json implies


@pytest.mark.parametrize("norm_topk", [True, False])
def test_forward_matches_transformers(moe_ckpt, tmp_path, norm_topk):
    """The logits are transformers' for the same config, norm_topk_prob true or false (false:
    each chosen expert weighted by its softmax probability over all 8 experts, not
    renormalised over the 2 chosen)."""
    from transformers import Qwen3MoeForCausalLM

    path = moe_ckpt if norm_topk else make_moe_checkpoint(tmp_path, **{**TINY_MOE,
                                                                       "norm_topk": False})
    args, hf = load(path)
    assert args.moe_args.route_norm == norm_topk
    model = rl.build_model(args, rl.hf_to_trainer(hf, args), bib.reference_kernels(),
                           torch.float32, "cpu")
    assert isinstance(model.layers[0].moe, rl.MoE) and not model.layers[1].sparse
    ref = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert ref.config.norm_topk_prob == norm_topk
    prompts = [[5, 9, 33, 7, 100, 2], [17, 4, 250]]
    batch = rl.pack(prompts, [[] for _ in prompts])
    with torch.no_grad():
        ours = model.logits(model.hidden(batch))  # (T, V)
        theirs = torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts])
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()


def test_round_trip_exact_and_push_names(moe_ckpt):
    args, hf = load(moe_ckpt)
    state = rl.hf_to_trainer(hf, args)
    assert state["layers.0.moe.experts.w13"].shape == (8, 64, 64)  # (E, 2I, D)
    assert state["layers.0.moe.experts.w2"].shape == (8, 64, 32)  # (E, D, I)
    assert state["layers.2.moe.router.gate.weight"].shape == (8, 64)
    assert torch.equal(state["layers.0.moe.experts.w13"][3, 32:],
                       hf["model.layers.0.mlp.experts.3.up_proj.weight"])  # [gate; up]
    back = rl.trainer_to_hf(state, args)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    model = rl.build_model(args, state, bib.reference_kernels(), torch.float32, "cpu")
    pushed = dict(rl.hf_weights(model))  # experts fused, as vLLM's MoE loader takes them
    assert pushed["model.layers.2.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert pushed["model.layers.2.mlp.experts.down_proj"].shape == (8, 64, 32)
    assert not any(".experts.0." in k for k in pushed)
    again = rl.hf_to_trainer(pushed, args)
    assert all(torch.equal(again[k], state[k]) for k in state)
    assert rl.gathered_hf_state(model).keys() == hf.keys()  # export: the hub's format


def broken(tmp_path, src, **change):
    out = tmp_path / "bad"
    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(change)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("change, words", [
    (dict(shared_expert_intermediate_size=64), "shared experts"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(mlp_only_layers="1"), "mlp_only_layers"),
    (dict(architectures=["Qwen2MoeForCausalLM"]), "Qwen3MoeForCausalLM"),
    (dict(norm_topk_prob=1), "norm_topk_prob must be true or false"),
    (dict(num_local_experts=16), "num_experts and num_local_experts disagree"),
])
def test_config_errors(tmp_path, moe_ckpt, change, words):
    with pytest.raises(rl.ConfigError, match=words):
        rl.read_qwen3_config(broken(tmp_path, moe_ckpt, **change))


def test_decoder_sparse_step_counts_layers_from_one(tmp_path, moe_ckpt):
    """decoder_sparse_step 2 makes layers 2, 4, ... (counted from 1) sparse: index 1 of 3; the
    tiny checkpoint's files, sparse at 0 and 2, are then refused from their headers."""
    bad = broken(tmp_path, moe_ckpt, decoder_sparse_step=2, mlp_only_layers=[])
    args = rl.model_args_from_hf(rl.read_qwen3_config(bad))
    assert rl.sparse_layers(args) == (1,)
    with pytest.raises(rl.ConfigError, match=r"weights missing for config\.json's model: "
                       r"model\.layers\.0\.mlp\.down_proj\.weight"):  # layer 0 is dense now
        rl.check_weight_headers(bad, args)


def test_headers_name_missing_experts(tmp_path, moe_ckpt):
    # config says 16 experts, the files hold 8: refused from the headers, before any start
    bad = broken(tmp_path, moe_ckpt, num_experts=16)
    args = rl.model_args_from_hf(rl.read_qwen3_config(bad))
    with pytest.raises(rl.ConfigError, match="experts"):
        rl.check_weight_headers(bad, args)


def test_params_and_memory_count_every_expert(moe_ckpt):
    args, hf = load(moe_ckpt)
    assert rl.count_params(args) == sum(v.numel() for v in hf.values())
    from torchtitan.models.qwen3 import qwen3_args

    big = rl.dataclasses.replace(qwen3_args["30B-A3B"], max_seq_len=40960)
    big.sparse_layers = tuple(range(big.n_layers))
    assert abs(rl.count_params(big) / 30.53e9 - 1) < 0.01  # Qwen3-30B-A3B: 30.5B
    cfg = rl.Config(micro_batch_tokens=8192, max_model_len=1024)
    prompts = (896, 896)  # 128 tokens left to generate: 8 samples, 1024 generated tokens
    est = rl.memory_estimate(cfg, big, 1, prompts)
    assert est["trainer state"] == 16 * rl.count_params(big)  # fp32 masters + grads + AdamW
    # the experts' backward recomputes their inner activations: a sparse layer keeps its input
    # and routing only (less than the dense 3 x 6144 per token), plus one layer's grouped
    # backward (14 I + 2 D bytes a slot, k = 8 slots a token, 4 D a token), which runs after
    # the head's logits and their gradient (4 V bytes a generated row) are freed: the larger
    dense = rl.dataclasses.replace(big, moe_enabled=False)  # no sparse_layers: all dense
    assert est["activations"] < rl.memory_estimate(cfg, dense, 1, prompts)["activations"]
    transient = 8192 * (8 * (14 * 768 + 2 * 2048) + 4 * 2048)
    small_vocab = rl.dataclasses.replace(big, vocab_size=1000)
    small_vocab.sparse_layers = big.sparse_layers
    lp_rows = bib.LOGPROB_ROWS * 4 * (151936 - 1000)
    shrunk = est["activations"] - rl.memory_estimate(cfg, small_vocab, 1, prompts)["activations"]
    # only the logprob chunk shrinks: the experts' backward (1.0 GB) outweighs the logits of the
    # 1024 generated rows (0.6 GB) at either vocabulary
    assert shrunk == pytest.approx(lp_rows, abs=1)
    long_answers = rl.memory_estimate(cfg, big, 1, (8, 8))  # 8192 rows, 7944 generated
    assert long_answers["activations"] - est["activations"] == 7944 * 151936 * 4 - transient


def test_memory_estimate_of_qwen3_30b_a3b_layers_is_what_was_measured():
    """Qwen3-30B-A3B's 4 layers on one H200 (results/h200_vllm034/, vLLM 0.34), 16 x 8 samples
    of the task's 21-23-token prompts and 128 new tokens, one micro-batch of 32768 tokens a
    step: 58.3 GiB in use at the peak; the estimate within 15% above it (1.12x). With one
    micro-batch the fp32 gradients are made as the backward frees the activations, so the
    larger of its two ends counts (counting both whole was 1.30x). Its experts' 2.4B
    parameters are counted at 18 B each on one GPU (fp32 master, gradient, AdamW m and v, bf16
    cast) and 8 on two where micro-batches are several, with none of the slack the dense terms
    get."""
    from torchtitan.models.qwen3 import qwen3_args

    a3b = rl.dataclasses.replace(qwen3_args["30B-A3B"], max_seq_len=40960, n_layers=4)
    a3b.sparse_layers = (0, 1, 2, 3)
    cfg = rl.Config(num_prompts=16, group_size=8, max_new_tokens=128, max_model_len=512,
                    micro_batch_tokens=32768)
    est = rl.memory_estimate(cfg, a3b, 1, (21, 23))
    assert 1.0 < est["peak"] / 2**30 / 58.3 < 1.15
    n = rl.count_params(a3b)
    assert est["trainer state"] == 12 * n and est["activations"] > 4 * n  # one micro-batch
    several = rl.memory_estimate(rl.dataclasses.replace(cfg, micro_batch_tokens=8192), a3b, 1,
                                 (21, 23))
    assert several["trainer state"] == 16 * n
    assert rl.auto_micro_batch(rl.dataclasses.replace(cfg, micro_batch_tokens=0), a3b, 1,
                               140 * 2**30, (21, 23)) == 32768
    wider = rl.dataclasses.replace(a3b, moe_inter_dim=1536)  # twice the experts' parameters
    wider.sparse_layers = a3b.sparse_layers
    added = rl.expert_params(wider) - rl.expert_params(a3b)
    assert added == rl.count_params(wider) - rl.count_params(a3b) == 4 * 128 * 3 * 2048 * 768
    cfg = rl.dataclasses.replace(cfg, micro_batch_tokens=8192)  # several micro-batches a step
    for world, per_param in ((1, 18), (2, 8)):
        grown = rl.memory_estimate(cfg, wider, world, (21, 23))["peak"]
        base = rl.memory_estimate(cfg, a3b, world, (21, 23))["peak"]
        gathered = 0 if world == 1 else rl.MEMORY_SLACK * 2 * 2 * added / 4  # FSDP: 2 blocks
        assert grown - base == pytest.approx(per_param * added + gathered, rel=1e-9)


def test_trained_rows_bound_what_a_micro_batch_holds():
    """(tokens, generated tokens) a micro-batch holds at most: 128 samples of 20 to 30 prompt
    tokens and 128 new ones fill 20224 of 32768 tokens, 16384 of them generated; a prompt of 1
    token makes almost every row generated; several turns fill --max-model-len. Then the bound
    against what `pack` and `plan_micro_batches` make of random rollouts: single turns, and
    episodes whose tool messages (context, not targets) lengthen them, on 1 and 2 ranks."""
    cfg = rl.Config(num_prompts=16, group_size=8, max_new_tokens=128, max_model_len=512,
                    micro_batch_tokens=32768)
    assert rl.trained_rows(cfg, 1, (20, 30)) == (128 * (30 + 128), 128 * 128)
    assert rl.trained_rows(cfg, 2, (20, 30)) == (64 * 158, 64 * 128)  # a rank's half
    small = rl.dataclasses.replace(cfg, micro_batch_tokens=4096)
    assert rl.trained_rows(small, 1, (20, 30)) == (4096, -(-4096 * 128 // 148))
    assert rl.trained_rows(small, 1, (1, 30)) == (4096, -(-4096 * 128 // 129))
    episodes = rl.dataclasses.replace(cfg, env="calc", max_turns=4)  # 4 x 128 model tokens
    assert rl.trained_rows(episodes, 1, (20, 30)) == (32768, -(-32768 * 492 // 512))
    rng = random.Random(0)
    for _ in range(300):
        c, world, shortest, longest = random_step(rng, turns=(1, 1, 2, 4))
        turns = c.max_turns
        prompts, completions, model = [], [], []
        for _ in range(rl.samples_per_rank(c, world)):
            p = rng.randint(shortest, longest)
            room, ids, mask = c.max_model_len - p, [], []
            for turn in range(turns):  # each turn: up to max_new model tokens, then a tool message
                n = min(rng.randint(1, c.max_new_tokens), room - len(ids))
                ids, mask = ids + [1] * n, mask + [True] * n
                tool = min(rng.randint(0, 60), room - len(ids)) if turn < turns - 1 else 0
                ids, mask = ids + [2] * tool, mask + [False] * tool
            prompts.append([3] * p)
            completions.append(ids)
            model.append(mask)
        packed = rl.pack(prompts, completions, model)
        rows, generated = rl.trained_rows(c, world, (shortest, longest))
        for part in rl.plan_micro_batches(packed, c):
            batch, _ = rl.sub_pack(packed, part)
            assert len(batch.tokens) <= rows and len(batch.targets) <= generated, (c, part)
    from types import SimpleNamespace

    q17 = SimpleNamespace(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                          hidden_dim=6144, vocab_size=151936, enable_weight_tying=True)
    for world in (1, 2):  # known prompts only tighten the estimate for any prompts
        known = rl.memory_estimate(cfg, q17, world, (20, 30))["peak"]
        assert known < rl.memory_estimate(cfg, q17, world)["peak"]


def test_a_users_env_may_write_any_first_prompt():
    """A user's env writes its own first message (`new_episodes`), which can be shorter than
    every prompt of the task: the estimate then assumes nothing of its length; --env calc and
    single turns start from the task's prompts."""
    task = rl.Task([], [[1] * 40, [1] * 60], [], [])
    assert rl.prompt_range(task, rl.Config()) == (40, 60)
    assert rl.prompt_range(task, rl.Config(env="calc")) == (40, 60)
    assert rl.prompt_range(task, rl.Config(env="my_env.py:Env")) == rl.ANY_PROMPT


def test_routing_mismatch_counts_tokens():
    # 2 samples (3 and 2 generated tokens), 3 layers of which 0 and 2 are sparse, top-2
    ids = torch.tensor([[[1, 2], [3, 4]], [[0, 5], [6, 7]], [[2, 3], [1, 0]],
                        [[4, 5], [2, 6]], [[7, 1], [3, 5]]], dtype=torch.int32)  # (N, 2, 2)
    engine = []
    for rows in ids.split([3, 2]):  # vLLM: every layer (dense rows 0), ids in its own order
        full = torch.zeros(len(rows), 3, 2, dtype=torch.int32)
        full[:, [0, 2]] = rows.flip(-1)
        engine.append(full)
    assert rl.routing_report(engine, ids, [3, 2], (0, 2)) == (5, 0)
    engine[1][0, 2, 0] = 0  # sample 1, token 0, layer 2: another expert
    assert rl.routing_report(engine, ids, [3, 2], (0, 2)) == (5, 1)
    engine[1][0, 1, 0] = 9  # a dense layer's row is not compared
    assert rl.routing_report([engine[0], None], ids, [3, 2], (0, 2)) == (3, 0)


def test_generated_routing_rows():
    routed = np.arange(6 * 2 * 1).reshape(6, 2, 1).astype(np.uint8)  # P=4 + C=3 - 1 rows
    got = rl.generated_routing(routed, 4, 3)
    assert got.tolist() == torch.from_numpy(routed[3:6].astype(np.int32)).tolist()
    assert rl.generated_routing(routed, 5, 3) is None and rl.generated_routing(None, 4, 3) is None


class RoutingEngine(ExactEngine):
    """The exact stand-in engine (with the trainer's weights, the first step, every token's
    logprob and experts match the trainer's), returning routed experts as vLLM does.
    `corrupt` changes one id of the first sample."""

    corrupt = False

    def first_turn(self, prompts, indices, step):
        out = super().first_turn(prompts, indices, step)
        if self.corrupt:
            args = self.model.args
            first = out[0][0].routed[0, rl.sparse_layers(args)[0]]
            first[0] = (first[0] + 1) % args.moe_args.num_experts
            while int(first[0]) in first[1:].tolist():
                first[0] = (first[0] + 1) % args.moe_args.num_experts
        return out


def only_run_metrics(log_dir):
    return metrics_rows(next(p for p in Path(log_dir).iterdir() if p.is_dir()))


@pytest.mark.parametrize("corrupt, updates", [(False, 1), (True, 1), (False, 2)])
def test_simple_rl_runs_moe_and_reports_routing(tmp_path, moe_ckpt, corrupt, updates, capsys):
    """Routing parity compares the first pass's choices (a second pass's forwards, on
    moved weights, are not the rollout's)."""
    engine = type("E", (RoutingEngine,), {"corrupt": corrupt})
    argv = cpu_argv(moe_ckpt, tmp_path / "runs", steps=2, eval_size=0, save_every=0,
                    kl_coef=0.0, updates_per_batch=updates)
    assert main_cpu(argv, engine) == 0
    rows = [r for r in only_run_metrics(tmp_path / "runs") if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["determinism/routing_tokens"] == r["determinism/tokens"] > 0
        assert r["determinism/routing_mismatch"] == (1 if corrupt else 0), r
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert len(steps) == 2 and all(f"| routing {1 if corrupt else 0}/" in s for s in steps)
    # reference kernels print a parity line only for a step where no token differs: the first
    # one at least (the engine's logprobs are its copy's forward on the same weights)
    parity = [line for line in out if line.startswith("parity:")]
    assert parity and all(f"| routing: {1 if corrupt else 0}/" in p for p in parity), parity


def test_an_engine_that_returns_no_experts_reports_tokens_only(tmp_path, moe_ckpt, capsys):
    """vLLM returns a Qwen3-MoE's experts only with its prefix cache: under --no-prefix-caching
    the step checks tokens alone and says nothing of routing (no "0/0")."""
    class NoRoutes(RoutingEngine):
        returns_routes = False

        def first_turn(self, prompts, indices, step):
            out = super().first_turn(prompts, indices, step)
            for c in (c for cs in out for c in cs):
                c.routed = None
            return out

    argv = cpu_argv(moe_ckpt, tmp_path / "runs", steps=1, eval_size=0, save_every=0,
                    kl_coef=0.0)
    assert main_cpu(argv, NoRoutes) == 0
    rows = [r for r in only_run_metrics(tmp_path / "runs") if "loss" in r]
    assert rows[0]["determinism/tokens"] > 0 and "determinism/routing_tokens" not in rows[0]
    out = capsys.readouterr().out
    assert "parity: identical=yes" in out and "routing" not in out


def test_debugger_traces_the_moe_ops(moe_ckpt):
    names = rl.trace_names(3, (0, 2))
    assert ("layers.2.moe.topk", "model.layers.2.mlp.experts.router") in names
    assert ("layers.1.feed_forward.w13", "model.layers.1.mlp.gate_up_proj") in names
    assert not [n for n, _ in names if n.startswith("layers.0.feed_forward")]
    args, hf = load(moe_ckpt)
    model = rl.build_model(args, rl.hf_to_trainer(hf, args), bib.reference_kernels(),
                           torch.float32, "cpu")
    ours = [n for n, _ in names]
    with rl.recording(model, {n: n for n in ours}) as calls, torch.no_grad():
        model.hidden(rl.pack([[3, 4, 5]], [[]]))
    assert set(calls) == set(ours)
    weights, ids = calls["layers.0.moe.topk"][0]
    assert weights.shape == ids.shape == (3, 2) and ids.dtype == torch.int32

    class Router:  # vLLM's router: no module; select_experts gives (weights, ids)
        def select_experts(self, hidden_states, router_logits):
            return router_logits.softmax(-1), router_logits.argmax(-1, keepdim=True)

    vllm_layer = torch.nn.Module()
    vllm_layer.experts = torch.nn.Module()
    vllm_layer.experts.router = Router()
    with rl.recording(vllm_layer, {"experts.router": "topk"}) as theirs:
        vllm_layer.experts.router.select_experts(hidden_states=None,
                                                 router_logits=torch.ones(2, 4))
    assert [len(c) for c in theirs["topk"]] == [2]
    assert "select_experts" not in vars(vllm_layer.experts.router)  # unpatched after


def test_a_fused_checkpoint_as_transformers_saves_it_loads(tmp_path, moe_ckpt):
    """transformers 5's own layout (experts fused per layer, save_original_format=False) is
    accepted, as vLLM accepts it, and converts to the same trainer weights as the hub's."""
    from transformers import Qwen3MoeForCausalLM

    out = tmp_path / "fused"
    shutil.copytree(moe_ckpt, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    ref = Qwen3MoeForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32)
    ref.save_pretrained(out, save_original_format=False)
    shutil.copy(moe_ckpt / "config.json", out / "config.json")
    args, hf = load(out)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf
    rl.check_weight_headers(out, args)
    ours, theirs = rl.hf_to_trainer(hf, args), rl.hf_to_trainer(load(moe_ckpt)[1], args)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_strict_parity_stops_on_a_token_routed_to_other_experts(tmp_path, moe_ckpt, capsys):
    argv = cpu_argv(moe_ckpt, tmp_path / "runs", steps=2, eval_size=0, save_every=0,
                    kl_coef=0.0, strict_parity=True)
    assert main_cpu(argv, type("E", (RoutingEngine,), {"corrupt": True})) == rl.EXIT_PARITY
    err = capsys.readouterr().err
    assert "step 1/2 has 0 mismatched tokens and 1 routed to other experts" in err


def test_the_experts_are_cast_once_and_change_no_bit(moe_ckpt):
    """A bf16 Qwen3-MoE under weights_cast_once: every sparse layer's experts read the casts
    made on entry (zeroing one changes the output); two micro-batches give the logprobs and the
    fp32 gradients of the model that casts in every forward, bit for bit; on exit no cast is
    left."""
    args, hf = load(moe_ckpt)
    parts = [rl.pack([[3, 4, 5, 6], [9, 8]], [[7, 1, 2], [5]]), rl.pack([[11, 12]], [[13, 14]])]
    model = cast_once_changes_no_bit(args, rl.hf_to_trainer(hf, args), parts)
    experts = [b.moe.experts for b in model.layers if b.sparse]
    assert len(experts) == 2
    with torch.no_grad(), rl.weights_cast_once(model):
        assert all(m.compute_weights[0].dtype == torch.bfloat16 for m in experts)
        assert torch.equal(experts[0].compute_weights[1], experts[0].w2.to(torch.bfloat16))
        before = model(parts[0], 0.9)[0]
        experts[1].compute_weights[1].zero_()
        assert not torch.equal(model(parts[0], 0.9)[0], before)
    assert all(m.compute_weights is None for m in experts)
