"""LoRA on CPU: the adapters' forward and backward (alpha / r B A x, the gradient to the base
output), a run whose every token equals the stand-in engine's, the KL reference with the adapters
off, bit-exact resume, the PEFT and merged exports (checked against peft and transformers), the
memory estimate, the refusals, and its checkpoints: adapters only, crafted fields blamed on the
file, a killed export cleaned at the next start."""

import json
import math
import shutil

import pytest
import torch

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import (LORA, ExactEngine, Killed, cpu_argv, edit_json, exits, latest, main_cpu,
                     metrics_rows, refuse, run_cpu)


def lora_inputs(seed=0, T=7, K=32, sizes=(24, 8, 8), r=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g, requires_grad=True)
    y = torch.randn(T, sum(sizes), generator=g)
    a = [torch.randn(r, K, generator=g, requires_grad=True) for _ in sizes]
    b = [torch.randn(n, r, generator=g, requires_grad=True) for n in sizes]
    return x, y, a, b


def test_lora_backward_is_the_gradient_of_its_forward():
    """LoRAFn (the reference forward, the hand-written backward, computing with the casts)
    against autograd on the masters: the output, dx, every dA_s and dB_s (scale 2.5 included)."""
    scale = 2.5
    grads = []
    for kernels in (bib.reference_kernels(), bib.custom_backward_kernels(bib.reference_forwards())):
        x, y, a, b = lora_inputs()
        casts = (tuple(t.detach()[None, None] for t in a),
                 tuple((scale * t.detach())[None, None] for t in b))
        out = kernels.lora(x, y.clone(), casts, scale, *a, *b)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([out.detach(), x.grad, *(t.grad for t in a + b)])
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert grads[0][-1].abs().sum() > 0 and grads[0][2].abs().sum() > 0


def test_a_frozen_base_has_no_weight_gradient_and_the_same_input_gradient(monkeypatch):
    """dx as with a trainable weight, no weight gradient and no weight GEMM (half the backward)."""
    fwd = bib.custom_backward_kernels(bib.reference_forwards())
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 5, generator=g)
    dx = []
    for frozen in (False, True):
        if frozen:
            monkeypatch.setattr(bib, "_mm", lambda *a: pytest.fail("a frozen weight's GEMM"))
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), requires_grad=True)
        wp = w.clone().requires_grad_(not frozen)
        fwd.linear(x, wp).square().sum().backward()
        assert (wp.grad is None) == frozen
        dx.append(x.grad)
    assert torch.equal(dx[0], dx[1])


@pytest.mark.parametrize("rank, alpha", [(8, 32.0), (8, 4.0), (16, 8.0)])
def test_lora_adds_alpha_over_r_times_b_a_x(ckpt, rank, alpha):
    """A layer's output is W x + (alpha / r) B A x, computed here by hand."""
    files = rl.load_model_files(rl.Config(model=str(ckpt()), dtype="float32"))
    cfg = rl.Config(model=str(ckpt()), dtype="float32", lora_rank=rank, lora_alpha=alpha)
    ranks = rl.Ranks(0, 1, torch.device("cpu"))
    model, _ = rl.build_models(cfg, files.args, rl.load_hf_state_dict(files.path),
                               bib.reference_kernels(), ranks)
    layer = model.layers[1].attention.wo  # o_proj: one slice
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        a, b = layer.lora.a[0], layer.lora.b[0]
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(torch.randn(b.shape, generator=g))
        layer.lora.refresh()
        x = torch.randn(3, a.shape[1], generator=g)
        want = x @ layer.weight.T + (alpha / rank) * (x @ a.T) @ b.T  # (3, dim)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
        assert (want - x @ layer.weight.T).abs().max() > 1.0  # the update is not negligible


@pytest.mark.parametrize("kernels", ["reference", "custom backward"])
def test_lora_passes_the_gradient_to_the_base_layers_output(kernels):
    """y = 1.5 z (a base output that depends on z), out = y + s B A x: d(out . w)/dz = 1.5 w."""
    ops = bib.reference_kernels() if kernels == "reference" else \
        bib.custom_backward_kernels(bib.reference_forwards())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g)
    z = torch.randn(5, 12, generator=g, requires_grad=True)
    a = [torch.randn(4, 16, generator=g, requires_grad=True)]
    b = [torch.randn(12, 4, generator=g, requires_grad=True)]
    casts = ((a[0].detach()[None, None],), ((2.0 * b[0].detach())[None, None],))
    w = torch.randn(5, 12, generator=g)
    out = ops.lora(x, 1.5 * z, casts, 2.0, *a, *b)
    (out * w).sum().backward()
    assert z.grad is not None
    torch.testing.assert_close(z.grad, 1.5 * w, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def lora_run(ckpt, tmp_path_factory):
    """4 LoRA steps with the exact stand-in engine (the trainer's bits), and a resume at 2."""
    tmp = tmp_path_factory.mktemp("lora")
    digest = run_cpu(cpu_argv(ckpt(), tmp, steps=4, run_name="a", **LORA), ExactEngine)
    run_cpu(cpu_argv(ckpt(), tmp, steps=2, run_name="part", **LORA), ExactEngine)
    saved = tmp / "part" / "checkpoints" / "step_000002"
    resumed = run_cpu(cpu_argv(ckpt(), tmp, steps=4, run_name="part", resume=str(saved)),
                      ExactEngine)
    return tmp, digest, resumed


def test_lora_run_every_token_equal_adapter_moves_base_frozen_resume_exact(lora_run, ckpt):
    tmp, digest, resumed = lora_run
    rows = [r for r in metrics_rows(tmp / "a", timings=False) if "loss" in r]
    assert len(rows) == 4
    assert all(r["determinism/mismatched_tokens"] == 0 and r["determinism/tokens"] > 0
               for r in rows)
    assert rows[0]["kl_div"] == 0 and all(r["kl_div"] > 0 for r in rows[1:])  # B starts at 0
    assert resumed == digest  # 2 steps, a checkpoint, 2 more: the same adapter, bit for bit
    saved = tmp / "a" / "checkpoints" / "step_000004"
    state = json.loads((saved / "state.json").read_text())
    assert all(".lora." in k for k in state["shapes"])  # the trainer saved no base weight
    assert (saved / "model" / "adapter_config.json").is_file()
    from safetensors.torch import load_file

    adapter = load_file(tmp / "a" / "final" / "adapter_model.safetensors")
    b = [v for k, v in adapter.items() if "lora_B" in k]
    assert len(adapter) == 2 * 7 * 2 and all(v.abs().sum() > 0 for v in b)  # it trained


def test_the_kl_reference_is_the_base_with_the_adapters_off(ckpt):
    files = rl.load_model_files(rl.Config(model=str(ckpt()), dtype="float32"))
    cfg = rl.Config(model=str(ckpt()), dtype="float32", lora_rank=8, kl_coef=0.1)
    hf = rl.load_hf_state_dict(files.path)
    ranks = rl.Ranks(0, 1, torch.device("cpu"))
    model, ref = rl.build_models(cfg, files.args, hf, bib.reference_kernels(), ranks)
    plain, none = rl.build_models(rl.Config(model=str(ckpt()), dtype="float32"), files.args, hf,
                                  bib.reference_kernels(), ranks)
    assert isinstance(ref, rl.BasePolicy) and none is None
    with torch.no_grad():
        for m in rl.lora_modules(model):
            for p in m.b:
                p.normal_()  # an adapter far from the base
        batch = rl.pack([[1, 2, 3, 4], [5, 6]], [[7, 8, 9], [10, 11]])
        lp_ref, _ = ref(batch, 1.0)
        lp_base, _ = plain(batch, 1.0)
        lp_policy, _ = model(batch, 1.0)
    assert torch.equal(lp_ref, lp_base) and not torch.equal(lp_policy, lp_base)
    assert all(m.enabled for m in rl.lora_modules(model))  # switched back on


def test_peft_and_merged_exports_compute_the_trained_policy(lora_run, ckpt, tmp_path):
    """The PEFT adapter, loaded by peft on transformers' Qwen3, and the merged checkpoint,
    loaded by transformers, give the trainer's logits for the same adapter."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    tmp, _, _ = lora_run
    final = tmp / "a" / "final"
    run_cpu(cpu_argv(ckpt(), tmp, steps=4, run_name="m", export="merged", **LORA), ExactEngine)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    base = AutoModelForCausalLM.from_pretrained(ckpt(), dtype=torch.float32)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, final).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp / "m" / "final",
                                                      dtype=torch.float32)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(ckpt(), dtype=torch.float32)(ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)
    assert (adapted - plain).abs().max() > 1e-3  # the adapter does something
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 8  # alpha / r folded into B


def test_lora_memory_estimate_counts_the_base_once_and_trains_the_adapters():
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    args = Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, vocab_size=151936,
                          head_dim=128, hidden_dim=17408, norm_eps=1e-6, rope_theta=1e6,
                          max_seq_len=40960, enable_weight_tying=False)  # Qwen3-14B
    full = rl.Config(micro_batch_tokens=8192)
    lora = rl.Config(micro_batch_tokens=8192, lora_rank=16)
    a = rl.lora_params(lora, args)
    # r (K + N) per adapted layer: qkv 3 x 5120 + 7168, o 5120 + 5120, gate_up 2 x 5120 + 34816,
    # down 17408 + 5120, over 40 layers
    assert a == 40 * 16 * (3 * 5120 + 7168 + 2 * 5120 + 2 * 5120 + 34816 + 17408 + 5120)
    e, f = rl.memory_estimate(lora, args, 1), rl.memory_estimate(full, args, 1)
    n = rl.count_params(args)
    assert e["trainer state"] == 16 * a and f["trainer state"] == 16 * n
    assert e["base weights (the engine's)"] == 2 * n and "reference model" not in e
    assert e["engine"] == rl.kv_cache_bytes(lora, args, 1)  # its weights: the base, above
    # no slack under LoRA: the update's holders (the KV cache asleep) plus the fixed margin
    train = sum(v for k, v in e.items() if k not in ("engine", "peak"))
    assert e["peak"] == pytest.approx(train + rl.LORA_FIXED)
    full_train = sum(v for k, v in f.items() if k not in ("engine", "peak"))
    assert f["peak"] == pytest.approx(rl.MEMORY_SLACK * full_train + rl.MEMORY_FIXED)
    assert e["peak"] < 140 * 2**30 < f["peak"]  # 14B fits one H200 under LoRA, not in full


@pytest.mark.parametrize("flags, words", [
    (dict(lora_rank=7), "vLLM serves LoRA ranks"),
    (dict(lora_rank=8, lora_alpha=0.0), "--lora-alpha must be > 0"),
    (dict(lora_rank=8, lora_targets="q_proj,qkv"), "--lora-targets names 'qkv'"),
    (dict(lora_rank=8, kernels="reference"), "with --kernels reference"),
    (dict(lora_rank=512), "exceeds the width of"),
])
def test_bad_lora_flags_get_one_sentence_and_exit_2(ckpt, tmp_path, capsys, flags, words):
    argv = cpu_argv(ckpt(), tmp_path, **flags) + ["--check"]
    assert main_cpu(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_resuming_a_lora_run_with_another_rank_is_refused(lora_run, ckpt, capsys):
    tmp, _, _ = lora_run
    saved = tmp / "a" / "checkpoints" / "step_000002"
    for rank in ("16", "0"):
        argv = cpu_argv(ckpt(), tmp, steps=6, run_name="a", resume=str(saved)) + [
            "--lora-rank", rank]
        assert main_cpu(argv, ExactEngine) == 2
        err = capsys.readouterr().err
        assert "trained with --lora-rank 8" in err and f"change it to {rank}" in err, err


@pytest.mark.parametrize("check", [False, True])
def test_3_all_with_a_target_is_refused_at_validation(ckpt, tmp_path, capsys, check):
    argv = cpu_argv(ckpt(), tmp_path, lora_rank=8, lora_targets="all,q_proj")
    err = refuse(argv + ["--check"] * check, capsys)
    assert "--lora-targets all,q_proj: all already names every target; give it alone" in err


def test_6_an_alpha_far_too_large_is_refused_on_the_command_line(ckpt, tmp_path, capsys):
    err = refuse(cpu_argv(ckpt(), tmp_path, lora_rank=8, lora_alpha=1e30), capsys)
    assert "alpha / r may be at most 1024" in err


@pytest.mark.parametrize("flags, named", [
    (dict(lora_alpha=16.0), "--lora-alpha"),
    (dict(export="merged"), "--export"),
    (dict(lora_targets="q_proj", lora_alpha=8.0), "--lora-alpha, --lora-targets"),
])
@pytest.mark.parametrize("check", [False, True])
def test_8_lora_flags_without_a_rank_are_refused(ckpt, tmp_path, capsys, flags, named, check):
    err = refuse(cpu_argv(ckpt(), tmp_path, **flags) + ["--check"] * check, capsys)
    assert f"{named} set a LoRA run's adapters and export, and full fine-tuning has none: add " \
           "--lora-rank r, or drop them." in err


def test_8_targets_with_spaces_and_repeats_are_the_set_they_name(ckpt, tmp_path, capsys):
    capsys.readouterr()
    argv = cpu_argv(ckpt(), tmp_path, steps=1, run_name="s", lora_rank=8,
                    lora_targets="v_proj, q_proj,q_proj ")
    assert main_cpu(argv, ExactEngine) == 0
    banner = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("simple_rl |"))
    assert "M params, LoRA rank 8 on q_proj,v_proj (0." in banner and "M trained) |" in banner
    config = json.loads((tmp_path / "s" / "final" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]


def test_moe_trains_attention_adapters_and_its_experts_take_none(tmp_path, capsys):
    from helpers import make_moe_checkpoint

    moe = make_moe_checkpoint(tmp_path / "moe", vocab=384, hidden=128, layers=2, heads=4,
                              kv_heads=2, head_dim=32, inter=256, moe_inter=64, experts=4,
                              top_k=2)
    assert main_cpu(cpu_argv(moe, tmp_path, lora_rank=8, lora_targets="q_proj,up_proj")
                    + ["--check"]) == 2
    assert "an MoE model's MLPs are its experts" in capsys.readouterr().err
    files = rl.load_model_files(rl.Config(model=str(moe), dtype="float32"))
    assert rl.lora_spec(rl.Config(lora_rank=8), files.args).targets == LORA_ATTENTION
    run_cpu(cpu_argv(moe, tmp_path / "runs", steps=2, run_name="m", **LORA), ExactEngine)
    rows = [r for r in metrics_rows(tmp_path / "runs" / "m", timings=False) if "loss" in r]
    assert all(r["determinism/mismatched_tokens"] == 0 for r in rows)
    assert all(r["determinism/routing_mismatch"] == 0 < r["determinism/routing_tokens"]
               for r in rows)


LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_vllm_names_map_to_the_trainers_and_the_adapter_binds_to_the_engines_slot(ckpt):
    """vLLM's Qwen3 parameter names (LoRA-wrapped layers hold theirs under base_layer) map to
    the trainer's; bind_lora makes the adapter casts the engine's slot tensors, after which
    the push finds the adapter already in place (and refuses tensors that are not the slot)."""
    theirs = ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.base_layer.weight",
              "model.layers.0.self_attn.o_proj.base_layer.weight",
              "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
              "model.layers.0.input_layernorm.weight",
              "model.layers.0.post_attention_layernorm.weight",
              "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
              "model.norm.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.1.mlp.experts.routed_experts.w13_weight",  # vLLM 0.34's names
              "model.layers.1.mlp.experts.routed_experts.w2_weight"]
    assert [rl.trainer_name(n) for n in theirs] == [
        "tok_embeddings.weight", "layers.0.attention.wqkv.weight", "layers.0.attention.wo.weight",
        "layers.0.attention.q_norm.weight", "layers.0.attention.k_norm.weight",
        "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
        "layers.0.feed_forward.w13.weight", "layers.0.feed_forward.w2.weight", "norm.weight",
        "output.weight", "layers.1.moe.router.gate.weight", "layers.1.moe.experts.w13",
        "layers.1.moe.experts.w2"]
    files = rl.load_model_files(rl.Config(model=str(ckpt()), dtype="float32"))
    cfg = rl.Config(model=str(ckpt()), dtype="float32", lora_rank=8, lora_targets="q_proj,v_proj")
    ranks = rl.Ranks(0, 1, torch.device("cpu"))
    model, _ = rl.build_models(cfg, files.args, rl.load_hf_state_dict(files.path),
                               bib.reference_kernels(), ranks)
    slots = {rl.vllm_lora_layer(n): tuple(tuple(torch.zeros(1, 1, *p.shape) for p in ps)
                                          for ps in (m.a, m.b))
             for n, m in model.named_modules() if isinstance(m, rl.LoRA)}
    assert sorted(slots) == ["model.layers.0.self_attn.qkv_proj",
                             "model.layers.1.self_attn.qkv_proj"]  # k_proj rides along
    rl.bind_lora(model, slots)
    engine = type("Engine", (), dict(asleep=False, lora=True, llm=None))()
    engine.adapter_ptrs = {t.data_ptr() for a, b in slots.values() for t in a + b}
    engine.llm = type("LLM", (), dict(reset_prefix_cache=lambda self: None))()
    rl.push_weights(engine, rl.policy_weights(model))
    a_q = slots["model.layers.0.self_attn.qkv_proj"][0][0]
    assert torch.equal(a_q[0, 0], model.layers[0].attention.wqkv.lora.a[0].detach())
    names = [n for n, _ in rl.adapter_weights(model)]
    assert len(names) == 2 * 2 * 2 and not any("k_proj" in n for n in names)
    with pytest.raises(AssertionError, match="not the engine's tensor"):
        rl.push_weights(engine, iter([("x.lora_A.weight", torch.zeros(1))]))


def test_lora_flags_on_the_real_command_line(ckpt, tmp_path):
    """python simple_rl.py itself (the script, not the module): --check accepts a LoRA run and
    refuses a rank vLLM does not serve, in one sentence."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "simple_rl.py"

    def check(rank):
        argv = cpu_argv(ckpt(), tmp_path / "runs", lora_rank=rank, run_name=f"r{rank}")
        return subprocess.run([sys.executable, str(script), *argv, "--check"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    good, bad = check(8), check(7)
    assert good.returncode == 0 and "check: config: valid" in good.stdout, good.stderr
    assert bad.returncode == 2 and bad.stderr.startswith("simple_rl: error: --lora-rank 7: "
                                                         "vLLM serves LoRA ranks"), bad.stderr


# ---------------------------------------------------------------- a LoRA checkpoint


SEVEN = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@pytest.fixture(scope="module")
def lora_saved(ckpt, tmp_path_factory):
    """A 2-step LoRA run (checkpoint at step 2) on its own copy of the tiny model."""
    tmp = tmp_path_factory.mktemp("lora_saved")
    model = tmp / "model"
    shutil.copytree(ckpt(), model)
    run_cpu(cpu_argv(model, tmp / "runs", steps=2, run_name="r", **LORA), ExactEngine)
    return tmp


def copy_lora_run(lora_saved, tmp_path):
    """A copy of `lora_saved` (model and run) to damage; returns its checkpoint."""
    for name in ("model", "runs"):
        shutil.copytree(lora_saved / name, tmp_path / name)
    return tmp_path / "runs" / "r" / "checkpoints" / "step_000002"


def test_a_lora_checkpoint_writes_the_adapters_only(lora_saved):
    """What DCP wrote (its metadata and its shards), not what state.json says."""
    ckpt_dir = lora_saved / "runs" / "r" / "checkpoints" / "step_000002"
    meta = rl.read_dcp_metadata(ckpt_dir)
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys[:5]
    written = sum(p.stat().st_size for p in (ckpt_dir / "trainer").glob("*.distcp"))
    base = (lora_saved / "model" / "model.safetensors").stat().st_size
    assert written < base / 4  # adapters and their Adam moments: a fraction of the base


def test_1_an_unchanged_base_resumes_without_a_word(lora_saved, tmp_path, capsys):
    copy_lora_run(lora_saved, tmp_path)
    capsys.readouterr()
    assert main_cpu(latest(tmp_path), ExactEngine) == 0
    captured = capsys.readouterr()
    assert "differs" not in captured.out + captured.err


def test_8_the_seven_targets_spelled_out_resume_a_run_of_all(lora_saved, tmp_path, capsys):
    copy_lora_run(lora_saved, tmp_path)
    capsys.readouterr()
    assert main_cpu(latest(tmp_path, "--lora-targets", SEVEN), ExactEngine) == 0
    assert "--lora-targets" not in capsys.readouterr().out  # no warning either
    err = exits(capsys, latest(tmp_path, "--lora-targets", "q_proj,v_proj"), 2)
    assert "cannot change it to q_proj,v_proj" in err


@pytest.mark.parametrize("change, words", [
    (dict(lora_targets=["q_proj"]), "holds an invalid config: --lora-targets must be a str "
                                    "(got ['q_proj'])."),
    (dict(lora_alpha=1e30), "--lora-alpha 1e+30 with --lora-rank 8 scales B A by "
                            "1.25e+29; alpha / r may be at most 1024."),
    (dict(lora_rank=True), "--lora-rank must be a int (got True)."),
    (dict(lora_alpha="32"), "--lora-alpha must be a float (got '32')."),
])
def test_6_a_crafted_lora_field_is_one_sentence(lora_saved, tmp_path, capsys, change, words):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    edit_json(ckpt_dir / "run_config.json", **change)
    assert words in exits(capsys, latest(tmp_path), 2)


@pytest.mark.parametrize("change, name, said, trained", [
    (dict(lora_rank=16), "--lora-rank", "16", "8"),
    (dict(lora_targets="q_proj"), "--lora-targets", "q_proj", "'all'"),
    (dict(lora_alpha=64.0), "--lora-alpha", "64.0", "32.0"),
])
def test_8_a_crafted_lora_config_is_blamed_on_the_file_not_the_model(lora_saved, tmp_path,
                                                                     capsys, change, name, said,
                                                                     trained):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    state = json.loads((ckpt_dir / "state.json").read_text())
    assert state["lora"] == dict(lora_rank=8, lora_alpha=32.0, lora_targets="all")
    edit_json(ckpt_dir / "run_config.json", **change)
    err = exits(capsys, latest(tmp_path), 2)
    assert f"{ckpt_dir / 'run_config.json'} says {name} {said}, but the checkpoint's weights " \
           f"were trained with {trained} (state.json): restore the file." in err


def test_8_an_older_checkpoints_other_rank_names_the_weight_not_the_count(lora_saved, tmp_path,
                                                                          capsys):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    state = json.loads((ckpt_dir / "state.json").read_text())
    del state["lora"]  # as older versions saved it
    (ckpt_dir / "state.json").write_text(json.dumps(state))
    edit_json(ckpt_dir / "run_config.json", lora_rank=16)
    err = exits(capsys, latest(tmp_path), 2)
    assert "holds other weights than --model" in err and "has 28" not in err
    assert "saved [8, " in err and "here [16, " in err, err


def test_8_a_crafted_export_in_a_full_runs_config_is_refused(saved, tmp_path, capsys):
    from helpers import copy_checkpoint

    ckpt_dir = copy_checkpoint(saved, tmp_path)
    edit_json(ckpt_dir / "run_config.json", export="merged")
    err = exits(capsys, latest(tmp_path), 2)
    assert "holds an invalid config: --export set a LoRA run's adapters and export" in err


def kill_in_export(monkeypatch, save: str):
    """SIGKILL's stand-in in the middle of the final export (after its files are written)."""
    real = getattr(rl, save)

    def killed(out, *a, **k):
        real(out, *a, **k)
        if out.name.startswith(".tmp_"):
            raise Killed

    monkeypatch.setattr(rl, save, killed)
    return real


@pytest.mark.parametrize("where", ["final", "output dir"])
def test_4_the_next_start_removes_what_a_killed_export_left(lora_saved, tmp_path, monkeypatch,
                                                            capsys, where):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    run_dir = ckpt_dir.parent.parent
    out = tmp_path / "exports" / "mine"
    other = tmp_path / "exports" / ".tmp_mine.another-run"  # not this run's: left alone
    other.mkdir(parents=True)
    extra = ["--output-dir", out] if where == "output dir" else []
    real = kill_in_export(monkeypatch, "save_peft_adapter")
    with pytest.raises(Killed):
        main_cpu(latest(tmp_path, *extra), ExactEngine)
    place = out.parent if extra else run_dir
    left = [p for p in place.glob(".tmp_*") if p != other]
    assert len(left) == 1 and (left[0] / "adapter_model.safetensors").is_file()
    old_style = run_dir / ".tmp_final.k3j2l1x0"  # what an older version's mkdtemp left
    old_style.mkdir()
    (old_style / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(rl, "save_peft_adapter", real)
    assert main_cpu(latest(tmp_path, *extra), ExactEngine) == 0
    assert not left[0].exists() and not old_style.exists() and other.is_dir()
    assert (out if extra else run_dir / "final").joinpath("adapter_config.json").is_file()


def test_11_the_adapter_names_the_hub_id_as_its_base(ckpt, tmp_path, monkeypatch):
    local = ckpt()
    monkeypatch.setattr(rl, "resolve_checkpoint", lambda name: local)  # the hub's cache
    argv = cpu_argv("Org/tiny-qwen3", tmp_path, steps=2, run_name="h", **LORA)
    run_cpu(argv, ExactEngine)
    for where in ("final", "checkpoints/step_000002/model"):
        config = json.loads((tmp_path / "h" / where / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "Org/tiny-qwen3"


def adapted(args, targets):
    with torch.device("meta"):
        model = rl.Qwen3(args, bib.reference_kernels(), torch.float32)
        rl.add_lora(model, rl.LoRASpec(8, 16.0, targets))
    return model


def test_lora_init_draws_a_within_one_over_sqrt_of_the_input_width(ckpt):
    """lora_init is PEFT's: A ~ U(-1/sqrt(K), 1/sqrt(K)), K the layer's input width; B = 0."""
    args = rl.model_args_from_hf(rl.read_qwen3_config(ckpt()))
    init = rl.lora_init(args, rl.LoRASpec(8, 16.0, ("q_proj", "o_proj", "down_proj")), 0)
    for name, K in (("layers.0.attention.wqkv.lora.a.0", 256),  # dim
                    ("layers.0.attention.wo.lora.a.0", 512),  # 4 heads x 128
                    ("layers.1.feed_forward.w2.lora.a.0", 512)):  # intermediate_size
        a = init[name]
        assert a.shape == (8, K)
        assert 0.9 / math.sqrt(K) < a.abs().max() <= 1 / math.sqrt(K), name
    assert torch.equal(init["layers.0.attention.wqkv.lora.a.1"], torch.zeros(8, 256))  # k_proj
    assert all(not b.any() for k, b in init.items() if ".b." in k)


def test_a_lora_rank_equal_to_a_layers_width_is_accepted(ckpt):
    """check_lora refuses a rank above a layer's width (the narrower of its input and output),
    not one equal to it: k_proj is 256 wide (2 kv heads x 128, from dim 256), so rank 256
    passes and 320 names it; q_proj and o_proj (256 <-> 512) are 256 wide too."""
    args = rl.model_args_from_hf(rl.read_qwen3_config(ckpt()))
    rl.check_lora(rl.Config(lora_rank=256, lora_targets="k_proj,v_proj"), args)
    with pytest.raises(rl.ConfigError, match=r"--lora-rank 320 exceeds the width of "
                                             r"k_proj \(256\), v_proj \(256\)"):
        rl.check_lora(rl.Config(lora_rank=320, lora_targets="k_proj,v_proj"), args)
    # a layer's width is the narrower of its input and output: q_proj maps 256 to 512 (4 heads
    # x 128) and o_proj 512 to 256, so rank 320 exceeds both, though each has a side of 512
    with pytest.raises(rl.ConfigError, match=r"--lora-rank 320 exceeds the width of "
                                             r"q_proj \(256\), o_proj \(256\):"):
        rl.check_lora(rl.Config(lora_rank=320, lora_targets="q_proj,o_proj"), args)


@pytest.mark.parametrize("targets,layers", [
    (("q_proj",), ["qkv_proj"]), (("v_proj", "up_proj"), ["gate_up_proj", "qkv_proj"]),
    (("o_proj", "down_proj"), ["down_proj", "o_proj"]),
    (rl.LORA_TARGETS[:7], ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),
    (("in_proj_z",), ["in_proj_qkvz"]), (("in_proj_b",), ["in_proj_ba"])])
def test_the_engine_wraps_every_layer_that_holds_a_target(targets, layers):
    """engine_lora_args: vLLM's lora_target_modules name each fused layer holding any target,
    not only those whose every slice is one (q_proj alone is vLLM's qkv_proj: without it the
    engine gets no LoRA layer there and bind_lora finds no slot for the adapter)."""
    got = rl.engine_lora_args(rl.LoRASpec(8, 16.0, targets))
    assert got == dict(enable_lora=True, max_lora_rank=8, max_loras=1,
                       lora_target_modules=layers)


def test_lora_alpha_may_be_exactly_the_largest_scale_times_r():
    """validate_lora: alpha / r may be at most MAX_LORA_SCALE: equal passes, above is refused."""
    rl.validate_lora(rl.Config(lora_rank=8, lora_alpha=8 * rl.MAX_LORA_SCALE))
    with pytest.raises(rl.ConfigError, match="alpha / r may be at most 1024"):
        rl.validate_lora(rl.Config(lora_rank=8, lora_alpha=8 * rl.MAX_LORA_SCALE + 1))


def test_the_lora_reference_rounds_u_to_the_compute_dtype_before_b():
    """ref_lora is vLLM's shrink and expand: u_s = x A_s^T summed in fp32, rounded to bf16,
    times B'_s summed in fp32, rounded and added to y_s in bf16. Against that computed in
    float64 from the rounded u, all agree but the few whose fp32 sum rounds across a bf16
    boundary from the float64 one (u left in fp32 puts about 30% of them an ulp off); the u
    returned is the fp32 sum, and each slice adds only to its own columns."""
    g = torch.Generator().manual_seed(7)
    T, K, r, sizes = 64, 96, 8, (48, 16)
    x = torch.randn(T, K, generator=g).bfloat16()
    y = torch.randn(T, sum(sizes), generator=g).bfloat16()
    a = [(torch.randn(r, K, generator=g) / K**0.5).bfloat16() for _ in sizes]
    b = [torch.randn(n, r, generator=g).bfloat16() for n in sizes]
    got = y.clone()
    u = bib.ref_lora(x, got, [t[None, None] for t in a], [t[None, None] for t in b])
    u64 = [x.double() @ a_s.double().t() for a_s in a]
    torch.testing.assert_close(u.double(), torch.stack(u64), rtol=1e-5, atol=1e-5)
    want = torch.cat([y_s + (u_s.bfloat16().double() @ b_s.double().t()).bfloat16()
                      for y_s, u_s, b_s in zip(y.split(sizes, -1), u, b)], -1)
    agree = (got == want).double().mean()
    assert u.dtype == torch.float32 and got.dtype == torch.bfloat16 and agree > 0.99, agree


def test_the_merged_export_adds_the_update_in_fp32_and_rounds_once(ckpt):
    """merged_weights of a bf16 LoRA model: W + (alpha / r) B_s A_s summed in fp32 and rounded
    once to bf16, each slice's rows its own (q_proj and v_proj targeted, k_proj as the base).
    Against that in float64 all agree but the few whose fp32 sum rounds across a bf16 boundary
    from the float64 one; rounding the update to bf16 before adding it leaves about 30% of
    them an ulp off."""
    path = ckpt()
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    spec = rl.LoRASpec(8, 32.0, ("q_proj", "v_proj"))
    hf = rl.load_hf_state_dict(path)
    state = {**rl.hf_to_trainer(hf, args), **rl.lora_init(args, spec, 0)}
    model = rl.build_model(args, state, bib.reference_kernels(), torch.bfloat16, "cpu",
                           lora=spec)
    lora = model.layers[0].attention.wqkv.lora
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in lora.b:
            b.copy_(torch.randn(b.shape, generator=g) / 8)  # trained; k's A = 0 keeps it 0
    merged = dict(rl.merged_weights(model))
    for s, name in enumerate(("q_proj", "k_proj", "v_proj")):
        key = f"model.layers.0.self_attn.{name}.weight"
        w = hf[key].bfloat16().double()  # the base as the run holds it
        want = (w + 4.0 * lora.b[s].double() @ lora.a[s].double()).bfloat16()
        assert merged[key].dtype == torch.bfloat16, name
        if name == "k_proj":
            assert torch.equal(merged[key], w.bfloat16())  # untargeted: the base, bit for bit
        else:
            agree = (merged[key] == want).double().mean()
            assert agree > 0.99, (name, agree)


def test_the_adapters_start_from_the_runs_seed(ckpt):
    """--seed reaches the adapters' initial A (PEFT's, lora_init): the adapters of a run of
    seed 1 and one of seed 2 are each what lora_init draws from that seed (B = 0), and the two
    runs' first A differ."""
    files = rl.load_model_files(rl.Config(model=str(ckpt()), dtype="float32"))
    hf = rl.load_hf_state_dict(files.path)
    ranks = rl.Ranks(0, 1, torch.device("cpu"))
    first = {}
    for seed in (1, 2):
        cfg = rl.Config(model=str(ckpt()), dtype="float32", lora_rank=8, seed=seed)
        model, _ = rl.build_models(cfg, files.args, hf, bib.reference_kernels(), ranks)
        init = rl.lora_init(files.args, rl.lora_spec(cfg, files.args), seed)
        adapters = {k: v for k, v in model.state_dict().items() if ".lora." in k}
        assert adapters.keys() == init.keys()
        assert all(torch.equal(adapters[k], init[k]) for k in init), seed
        first[seed] = adapters["layers.0.attention.wqkv.lora.a.0"]
    assert not torch.equal(first[1], first[2])
