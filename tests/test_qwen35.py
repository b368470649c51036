"""Qwen3.5 on the reference kernels: the gated delta rule's chunked and recurrent forms and their
gradients against float64, the trainer's forward against transformers', the weights' exact
round trip, --check, a run on the exact stand-in engine, and what is refused."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import ExactEngine, assert_custom_backwards_match_autograd, cpu_argv, main_cpu
from helpers import cpu_trainer as trainer
from helpers import metrics_rows, run_cpu
from helpers import random_ids as seqs

ROOT = Path(__file__).resolve().parents[1]
F64 = dict(dtype=torch.float64)
MOE = dict(experts=8, top_k=2, moe_inter=32, shared_inter=48)  # Qwen3.5-MoE, tiny


def load(path):
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    return args, rl.load_hf_state_dict(path)




def rule_inputs(B=2, H=3, L=150, Dk=16, Dv=8, seed=0) -> list[torch.Tensor]:
    """q, k (unit rows), v, g and beta from gdn_gates of random a, b, A_log, dt_bias, and an
    initial state: the gated delta rule's arguments, float64, L spanning three chunks."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, **F64)

    g, beta = (x.transpose(1, 2).contiguous()
               for x in bib.gdn_gates(r(B, L, H), r(B, L, H), r(H) * 0.5, r(H)))  # (B, H, L)
    q, k = bib.l2_normalize(r(B, H, L, Dk)), bib.l2_normalize(r(B, H, L, Dk))
    return [q, k, r(B, H, L, Dv), g, beta, r(B, H, Dk, Dv)]




# --- the gated delta rule ------------------------------------------------------------------


def test_chunked_and_recurrent_forms_agree_with_float64():
    """From a random initial state over 150 tokens: the chunked form (prefill's) equals the
    recurrent one (decode's) in float64 to rounding, at any chunk size; each form in fp32 is
    within 2e-6 of float64 (outputs and final states of size about 1)."""
    x = rule_inputs()
    o, S = bib.gated_delta_rule_recurrent(*x)  # (B, H, L, Dv), (B, H, Dk, Dv)
    assert o.abs().max() > 0.1 and S.abs().max() > 0.1
    for chunk in (64, 16, 1):
        oc, Sc = bib.gated_delta_rule_chunked(*x, chunk=chunk)
        torch.testing.assert_close(oc, o, atol=1e-12, rtol=0)
        torch.testing.assert_close(Sc, S, atol=1e-12, rtol=0)
    for form in (bib.gated_delta_rule_chunked, bib.gated_delta_rule_recurrent):
        o32, S32 = form(*[t.float() for t in x])
        assert o32.dtype == S32.dtype == torch.float32
        torch.testing.assert_close(o32.double(), o, atol=2e-6, rtol=0)
        torch.testing.assert_close(S32.double(), S, atol=2e-6, rtol=0)


@pytest.mark.parametrize("split", [1, 64, 70, 149])
def test_the_state_carried_across_a_split_equals_one_pass(split):
    """The first `split` tokens' final state, handed to the rest, gives the outputs and state
    of one pass over all 150, in either form: a prefill continued chunked or token by token."""
    q, k, v, g, beta, S0 = rule_inputs()
    o, S = bib.gated_delta_rule_chunked(q, k, v, g, beta, S0)
    head = [t[:, :, :split] for t in (q, k, v, g, beta)]
    tail = [t[:, :, split:] for t in (q, k, v, g, beta)]
    o1, S1 = bib.gated_delta_rule_chunked(*head, S0)
    for form in (bib.gated_delta_rule_chunked, bib.gated_delta_rule_recurrent):
        o2, S2 = form(*tail, S1)
        torch.testing.assert_close(torch.cat([o1, o2], dim=2), o, atol=1e-12, rtol=0)
        torch.testing.assert_close(S2, S, atol=1e-12, rtol=0)


def test_chunked_gradients_match_float64_recurrent_autograd():
    """Autograd through the fp32 chunked form (the trainer's reference path) against autograd
    through the float64 recurrence: every input's gradient (q, k, v, g, beta, the initial state)
    within 2e-6 of its largest entry; the float64 chunked form to rounding."""
    x = rule_inputs(B=1, H=2, L=80)

    def grads(form, inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        o, S = form(*inputs)
        gen = torch.Generator().manual_seed(1)
        wo, wS = (torch.randn(t.shape, generator=gen, **F64).to(t.dtype) for t in (o, S))
        return torch.autograd.grad((o * wo).sum() + (S * wS).sum(), inputs)

    want = grads(bib.gated_delta_rule_recurrent, x)
    got32 = grads(bib.gated_delta_rule_chunked, [t.float() for t in x])
    got64 = grads(bib.gated_delta_rule_chunked, x)
    for name, a, b, w in zip(("q", "k", "v", "g", "beta", "state"), got32, got64, want):
        scale = w.abs().max().item()
        assert scale > 0.1, name
        torch.testing.assert_close(a.double(), w, atol=2e-6 * scale, rtol=0, msg=name)
        torch.testing.assert_close(b, w, atol=1e-12 * scale, rtol=0, msg=name)


def test_chunk_rows_cut_each_sequence_alone_longest_first():
    """Lengths 10 and 130 at C = 64: the 130 first at every position (it goes on longest), the
    10 padded to one chunk only (the packed batch's 140 rows as 4 chunks, not 2 x 3)."""
    rows, counts = bib.chunk_rows(torch.tensor([0, 10, 140], dtype=torch.int32), chunk=64)
    T = 140
    want = [list(range(10, 74)), list(range(10)) + [T] * 54, list(range(74, 138)),
            [138, 139] + [T] * 62]
    assert rows.tolist() == want and counts == [2, 1, 1]


def test_packed_rule_runs_each_sequence_from_zero_with_shared_k_heads():
    """ref_gated_delta_rule over a packed batch (lengths 1, 70, 130; 2 k heads, 4 v heads):
    each sequence equals the float64 recurrence run alone from a zero state on its L2-normalised
    q and k (v head h reading k head h // 2) and its gates."""
    lens, Hk, Hv, Dk, Dv = [1, 70, 130], 2, 4, 16, 8
    gen = torch.Generator().manual_seed(2)
    T = sum(lens)
    q, k = (torch.randn(T, Hk, Dk, generator=gen) for _ in range(2))
    v, a, b = torch.randn(T, Hv, Dv, generator=gen), *torch.randn(2, T, Hv, generator=gen)
    A_log, dt_bias = torch.randn(Hv, generator=gen) * 0.5, torch.randn(Hv, generator=gen)
    cu = torch.tensor([0, 1, 71, 201], dtype=torch.int32)
    o = bib.ref_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu, max(lens))  # (T, Hv, Dv)
    assert o.shape == (T, Hv, Dv) and o.dtype == torch.float32
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        g, beta = bib.gdn_gates(a[s:e].double(), b[s:e].double(), A_log, dt_bias)  # (L, Hv)

        def heads(t):  # (L, H, D) -> (1, Hv, L, D)
            return t[s:e].double().repeat_interleave(Hv // t.shape[1], dim=1).transpose(0, 1)[None]

        want, _ = bib.gated_delta_rule_recurrent(
            bib.l2_normalize(heads(q)), bib.l2_normalize(heads(k)), heads(v), g.t()[None],
            beta.t()[None])
        torch.testing.assert_close(o[s:e].double(), want[0].transpose(0, 1), atol=2e-6, rtol=0)


def test_causal_conv1d_runs_each_sequence_from_zeros():
    """y_t = silu(sum_j w[:, j] x_{t-3+j}) with x = 0 before the sequence's first token."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 5, generator=gen, **F64), torch.randn(5, 4, generator=gen, **F64)
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    y = bib.ref_causal_conv1d(x, w, cu, 7)
    for s, e in ((0, 2), (2, 9)):
        xs = torch.cat([torch.zeros(3, 5, **F64), x[s:e]])  # (3 + L, C)
        want = torch.stack([(w.t() * xs[t : t + 4]).sum(0) for t in range(e - s)])
        torch.testing.assert_close(y[s:e], torch.nn.functional.silu(want), atol=1e-14, rtol=0)


# --- the model ------------------------------------------------------------------------------


def transformers_model(path, moe, monkeypatch):
    """transformers' own Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM) of `path`, fp32, running its
    PyTorch gated delta rule (even where fla is installed)."""
    import inspect

    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    for module in (modeling_qwen3_5, modeling_qwen3_5_moe):  # its torch rule, even beside fla
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(module, name, inspect.unwrap(getattr(module, name)))
    cls = Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


# wide-v: 16 dims a head for k and v, so v (4 heads) is twice k's width (2), as in every
# published Qwen3.5 (4B: 2048 and 4096); the default shape's widths are equal (32)
KINDS = {"tied": {}, "untied": dict(tied=False), "moe": MOE, "wide-v": dict(k_dim=16, v_dim=16)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_transformers_fp32(q35, kind, monkeypatch):
    """The trainer's packed forward (reference kernels, fp32) against transformers' own
    Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM) on the same random weights, one sequence at a
    time; 80 tokens run two chunks of the linear attention."""
    path = q35(**KINDS[kind])
    model = trainer(path)
    ref = transformers_model(path, kind == "moe", monkeypatch)
    assert ref.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    ids = seqs([33, 7, 80, 1])
    p = rl.pack(ids, [[] for _ in ids])
    with torch.no_grad():
        ours = model.logits(model.hidden(p))  # (T, V)
        for i, x in enumerate(ids):
            want = ref(torch.tensor([x])).logits[0]
            got = ours[p.cu_seqlens[i] : p.cu_seqlens[i + 1]]
            assert want.abs().max() > 0.5
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gradients_match_transformers_fp32(q35, monkeypatch):
    """The gradient of the sum of the completions' logprobs, the trainer's (packed, reference
    kernels, fp32) against autograd through transformers' Qwen3_5ForCausalLM on the same
    weights and tokens, every weight's, by its HF name (the fused ones split as the export
    splits them): what the hand-written backwards are checked against (the reference's
    autograd, through its L2 norms, gates, conv and rule) is the gradient of Qwen3.5."""
    path = q35(tied=False)
    model, ref = trainer(path), transformers_model(path, False, monkeypatch)
    ids = seqs([17, 80])  # the second sequence runs two chunks of the rule
    lp, _ = model(rl.pack([x[:3] for x in ids], [x[3:] for x in ids]), 1.0)
    lp.sum().backward()
    for x in ids:
        logits = ref(torch.tensor([x])).logits[0, 2:-1]  # the rows predicting tokens 3..
        logits.log_softmax(-1).gather(1, torch.tensor(x[3:])[:, None]).sum().backward()
    ours = rl.trainer_to_hf({n: p.grad for n, p in model.named_parameters()}, model.args)
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    assert sorted(ours) == sorted(theirs)
    for name, want in theirs.items():  # A_log's and dt_bias's differ most: 1e-4 of the largest
        scale = want.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(ours[name], want, atol=1e-3 * scale, rtol=0, msg=name)


@pytest.mark.parametrize("moe", [False, True])
def test_custom_backward_model_matches_autograd_model(q35, moe):
    """Every backward of its own a Qwen3.5 runs (its Gemma norms, gates, gated norm, q/k norm
    and partial rotary; its conv and rule, recomputed through the reference; and Qwen3's)
    against plain autograd, through the whole model."""
    assert_custom_backwards_match_autograd(q35(**MOE) if moe else q35(tied=False), [17, 4, 70])


@pytest.mark.parametrize("kind", ["tied", "untied", "moe"])
def test_round_trip_is_exact_and_the_layout_is_vllms(q35, kind):
    """HF -> trainer -> HF gives every tensor back bit for bit; the trainer holds vLLM's fused
    projections: in_proj_qkvz = [in_proj_qkv; in_proj_z], in_proj_ba = [b; a], and the full
    attention's qkv_proj = [q_proj (each head's q, then its gate); k_proj; v_proj]."""
    path = q35(**MOE) if kind == "moe" else q35(tied=kind == "tied")
    args, hf = load(path)
    st = rl.hf_to_trainer(hf, args)
    back = rl.trainer_to_hf(st, args, rl.fused_layers(hf, args))
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    lin, full = "model.layers.0.linear_attn.", "model.layers.3.self_attn."
    assert torch.equal(st["layers.0.attention.in_proj_qkvz.weight"],
                       torch.cat([hf[lin + "in_proj_qkv.weight"], hf[lin + "in_proj_z.weight"]]))
    assert torch.equal(st["layers.0.attention.in_proj_ba.weight"],
                       torch.cat([hf[lin + "in_proj_b.weight"], hf[lin + "in_proj_a.weight"]]))
    assert torch.equal(st["layers.0.attention.conv1d"], hf[lin + "conv1d.weight"])
    assert torch.equal(st["layers.3.attention.wqkv.weight"],
                       torch.cat([hf[full + f"{n}_proj.weight"] for n in "qkv"]))
    assert st["layers.3.attention.wqkv.weight"].shape[0] == (2 * 4 + 2 * 2) * 32
    if kind == "moe":
        shared = "model.layers.2.mlp.shared_expert."
        assert torch.equal(st["layers.2.moe.shared_expert.w13.weight"],
                           torch.cat([hf[shared + "gate_proj.weight"],
                                      hf[shared + "up_proj.weight"]]))
    model = rl.build_model(args, st, bib.reference_kernels(), torch.float32, "cpu")
    assert {n for n, _ in model.named_parameters()} == set(st)


def test_a_vision_language_checkpoint_is_read_as_its_text_model(q35):
    """A checkpoint laid out as the hub's Qwen3.5 (Qwen3_5ForConditionalGeneration: text_config,
    model.language_model.*, a vision tower, an MTP head) gives the trainer the very tensors of
    the text checkpoint with the same weights; the tower and the MTP head are left out."""
    text_args, text_hf = load(q35(tied=False))
    args, hf = load(q35(tied=False, vision=True))
    assert args == text_args and args.qwen35 == text_args.qwen35
    assert sorted(hf) == sorted(text_hf)  # no model.visual.*, no mtp.*
    for k in hf:
        assert torch.equal(hf[k], text_hf[k]), k
    rl.check_weight_headers(q35(tied=False, vision=True), args)


def test_make_checkpoint_cuts_a_qwen35_to_one_layer_of_each_kind(tmp_path):
    """tests/make_checkpoint.py --layers 2 --attention-every 2 --stop-ids 4 (the GPU suite's
    35B-A3B layer shapes on an 80 GiB card, samples stopping early): a Gated DeltaNet layer,
    then a full-attention one, both sparse; four eos ids, spread over the 384 ids."""
    from transformers import AutoTokenizer

    script = Path(__file__).parent / "make_checkpoint.py"
    subprocess.run([sys.executable, str(script), str(tmp_path), "--preset", "qwen3.5-moe-tiny",
                    "--layers", "2", "--attention-every", "2", "--stop-ids", "4"], check=True,
                   capture_output=True)
    hf = rl.read_qwen3_config(tmp_path)
    args = rl.model_args_from_hf(hf)
    assert args.qwen35.layer_types == ("linear_attention", "full_attention")
    assert args.n_layers == 2 and rl.sparse_layers(args) == (0, 1)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert rl.stop_token_ids(tmp_path, tokenizer, hf) == [0, 96, 192, 288]


# --- the run ---------------------------------------------------------------------------------


@pytest.mark.parametrize("vision", [False, True])
def test_check_a_qwen35(q35, tmp_path, capsys, vision):
    path = q35(tied=False, vision=vision)
    capsys.readouterr()
    assert rl.main(cpu_argv(path, tmp_path / "logs", run_name="r") + ["--check"]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    lines = out.out.strip().splitlines()
    n = sum(t.numel() for t in load(path)[1].values())
    model = [line for line in lines if line.startswith(f"check: model {path}:")]
    assert model == [f"check: model {path}: {n / 1e6:.1f}M params; config.json and every "
                     "safetensors header agree" + ("; it is a vision-language model, trained "
                     "(and exported) as its text model, on text: its vision tower and "
                     "multi-token-prediction head are left out" if vision else "")]
    assert f"check: LoRA: off (full fine-tuning: {n / 1e6:.1f}M params trained)" in lines


def test_a_run_on_the_exact_stand_in_engine_matches_every_token(q35, tmp_path):
    """Two steps of GRPO on a Qwen3.5 with a vision tower, the stand-in engine's logprobs the
    trainer's own forward: every token equal; the export is the text model, which transformers
    loads whole."""
    from transformers import Qwen3_5ForCausalLM

    argv = cpu_argv(q35(vision=True), tmp_path / "runs", steps=2, eval_size=0, save_every=0,
                    run_name="r")
    assert main_cpu(argv, ExactEngine) == 0
    rows = metrics_rows(tmp_path / "runs" / "r")
    assert len(rows) == 2
    for row in rows:
        assert row["determinism/tokens"] > 0 and row["determinism/mismatched_tokens"] == 0, row
    final = tmp_path / "runs" / "r" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and "text_config" not in config
    _, info = Qwen3_5ForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_warm_start_trains_a_qwen35_simple_rl_reads(tmp_path, capsys):
    """examples/warm_start.py --arch qwen3.5 at a tiny size (transformers' PyTorch Gated
    DeltaNet): the loss falls, and the checkpoint is a Qwen3_5ForCausalLM, three linear-attention
    layers then a full one, that transformers loads whole, --check passes, and the trainer's
    forward (reference kernels, fp32) gives transformers' logits on the task's own text."""
    import re
    import subprocess
    import sys

    from transformers import Qwen3_5ForCausalLM

    import warm_start

    out = tmp_path / "warm"
    cmd = [sys.executable, str(ROOT / "examples" / "warm_start.py"), "--arch", "qwen3.5",
           "--out", str(out), "--device", "cpu", "--layers", "4", "--dim", "64", "--ffn", "128",
           "--batch", "8", "--steps", "8", "--lr", "0.05", "--eval-every", "8", "--eval-size",
           "1", "--log-every", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "falling back" not in done.stderr  # the expected warning, said in the docstring
    losses = [float(x) for x in re.findall(r"^step \d+/8 \| loss (\d+\.\d+)", done.stdout,
                                           re.MULTILINE)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses  # from ln(512) = 6.2
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (config["linear_num_key_heads"], config["linear_key_head_dim"]) == (4, 8)  # 64 / 2
    assert (config["linear_num_value_heads"], config["linear_value_head_dim"]) == (8, 8)
    ref, info = Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    capsys.readouterr()
    assert rl.main(cpu_argv(out, tmp_path / "logs", run_name="r", kernels="reference")
                   + ["--check"]) == 0
    assert capsys.readouterr().err == ""
    tok = rl.load_model_files(rl.Config(model=str(out))).tokenizer
    problems = rl.arithmetic_problems(3, 7)
    prompts = rl.format_prompts(problems, tok, rl.Config())
    answers = tok([warm_start.worked_solution(p.question) for p in problems],
                  add_special_tokens=False)["input_ids"]
    assert max(len(q + a) for q, a in zip(prompts, answers)) > 64  # two chunks of the rule
    packed = rl.pack(prompts, answers)
    model = trainer(out)
    with torch.no_grad():
        ours = model.logits(model.hidden(packed))  # (T, V)
        for i, (q, a) in enumerate(zip(prompts, answers)):
            want = ref.eval()(torch.tensor([q + a])).logits[0]  # (L, V)
            got = ours[packed.cu_seqlens[i] : packed.cu_seqlens[i + 1]]
            assert want.abs().max() > 0.5
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("vision", [False, True])
def test_an_unknown_layer_type_is_refused_in_one_sentence(q35, tmp_path, capsys, vision):
    path = tmp_path / "ckpt"
    shutil.copytree(q35(vision=vision), path)
    raw = json.loads((path / "config.json").read_text())
    text = raw["text_config"] if vision else raw
    text["layer_types"][1] = "sliding_attention"
    (path / "config.json").write_text(json.dumps(raw))
    capsys.readouterr()
    assert main_cpu(cpu_argv(path, tmp_path / "logs") + ["--check"]) == 2
    assert capsys.readouterr().err == (
        f"simple_rl: error: {path / 'config.json'}: layer_types names 'sliding_attention': "
        "simple_rl runs Qwen3.5's 'linear_attention' and 'full_attention' layers only.\n")


def test_lora_on_a_qwen35_trains_and_exports_what_peft_computes(q35, tmp_path):
    """LoRA r8 on a Qwen3.5's every default target (its attention, MLP and linear attention's
    in_proj_qkv, in_proj_z and out_proj), 3 steps on the exact stand-in engine: every token
    equal, the base frozen; in_proj_qkv is vLLM's q, k and v slices of in_proj_qkvz with one A
    (two A's in that layer's adapter, one for z), so the exported PEFT adapter, loaded by peft
    on transformers' Qwen3.5, gives the merged export's logits; a resume ends where the run
    does."""
    peft = pytest.importorskip("peft")
    from transformers import Qwen3_5ForCausalLM

    path, lora = q35(), dict(lora_rank=8, lr=1e-2, eval_size=0)
    digest = run_cpu(cpu_argv(path, tmp_path, steps=3, run_name="a", **lora), ExactEngine)
    run_cpu(cpu_argv(path, tmp_path, steps=3, run_name="m", export="merged", **lora),
            ExactEngine)
    run_cpu(cpu_argv(path, tmp_path, steps=2, run_name="part", **lora), ExactEngine)
    saved = tmp_path / "part" / "checkpoints" / "step_000002"
    assert run_cpu(cpu_argv(path, tmp_path, steps=3, run_name="part", resume=str(saved)),
                   ExactEngine) == digest
    rows = [r for r in metrics_rows(tmp_path / "a", timings=False) if "loss" in r]
    assert len(rows) == 3 and all(r["determinism/mismatched_tokens"] == 0 for r in rows)
    config = json.loads((tmp_path / "a" / "final" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj",
                                               "in_proj_qkv", "in_proj_z", "out_proj"])
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    with torch.no_grad():
        base = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32)
        plain = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "a" / "final").eval()(ids)
        merged = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "m" / "final",
                                                    dtype=torch.float32)(ids).logits
    torch.testing.assert_close(merged, adapted.logits, rtol=1e-4, atol=1e-4)
    assert (adapted.logits - plain).abs().max() > 1e-3  # the adapter does something
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "a" / "final" / "adapter_model.safetensors")
    for name in ("in_proj_qkv", "in_proj_z", "out_proj"):  # trained, each from B = 0
        b = saved[f"base_model.model.model.layers.0.linear_attn.{name}.lora_B.weight"]
        assert b.abs().max() > 0, name
    files = rl.load_model_files(rl.Config(model=str(path), dtype="float32"))
    with torch.device("meta"):
        model = rl.Qwen3(files.args, bib.reference_kernels(), torch.float32)
        rl.add_lora(model, rl.lora_spec(rl.Config(lora_rank=8), files.args))
    qkvz = model.layers[0].attention.in_proj_qkvz.lora
    assert qkvz.groups == (0, 0, 0, 1) and len(qkvz.a) == 2 and len(qkvz.b) == 4


@pytest.mark.parametrize("flags, words", [
    (dict(lora_rank=8, lora_targets="in_proj_b"), "--lora-rank 8 exceeds the width of "
     "in_proj_b (4)"),
    (dict(lora_rank=8, vision=True), "is a vision-language checkpoint"),
])
def test_lora_flags_a_qwen35_cannot_take_get_one_sentence(q35, tmp_path, capsys, flags, words):
    path = q35(vision=flags.pop("vision", False))
    capsys.readouterr()
    assert main_cpu(cpu_argv(path, tmp_path / "logs", **flags) + ["--check"]) == 2
    assert words in capsys.readouterr().err


def test_the_script_checks_a_qwen35_lora_run_as_a_user_runs_it(q35, tmp_path):
    """python simple_rl.py --check (the file run as a script): a Qwen3.5 with LoRA on its
    default targets passes; its vision-language form with LoRA stops in one sentence, exit 2."""
    def check(path):
        argv = cpu_argv(path, tmp_path / "logs", lora_rank=8) + ["--check"]
        return subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), *argv],
                              capture_output=True, text=True, timeout=600)

    ok = check(q35())
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = check(q35(vision=True))
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("simple_rl: error: --lora-rank: ")
    assert "is a vision-language checkpoint" in bad.stderr


def test_the_lora_push_on_a_qwen35_writes_the_engines_slot_and_passes_its_check(q35):
    """A Qwen3.5 LoRA's casts bound to engine-shaped slot tensors (vLLM's in_proj_qkvz: four
    slices, q, k and v sharing PEFT's in_proj_qkv A): push_weights takes policy_weights (whose
    in_proj_qkv B is a concatenation, not a slot tensor) without refusing it, and the slots then
    hold the trainer's adapter; an A that is not the engine's is refused."""
    path = q35()
    files = rl.load_model_files(rl.Config(model=str(path), dtype="float32"))
    cfg = rl.Config(model=str(path), dtype="float32", lora_rank=8)
    model, _ = rl.build_models(cfg, files.args, rl.load_hf_state_dict(files.path),
                               bib.reference_kernels(), rl.Ranks(0, 1, torch.device("cpu")))
    slots = {rl.vllm_lora_layer(n): tuple(tuple(torch.zeros(1, 1, *p.shape) for p in ps)
                                          for ps in (m.slice_a(), m.b))
             for n, m in model.named_modules() if isinstance(m, rl.LoRA)}
    rl.bind_lora(model, slots)
    with torch.no_grad():
        for m in rl.lora_modules(model):
            for b in m.b:
                b.normal_()  # a trained B: the slots must receive it
    engine = type("Engine", (), dict(asleep=False, lora=True))()
    engine.adapter_ptrs = {t.data_ptr() for a, b in slots.values() for t in a + b}
    engine.llm = type("LLM", (), dict(reset_prefix_cache=lambda self: None))()
    rl.push_weights(engine, rl.policy_weights(model))
    layer = next(i for i, b in enumerate(model.layers) if hasattr(b.attention, "in_proj_qkvz"))
    lora = model.layers[layer].attention.in_proj_qkvz.lora
    a, b = slots[f"model.layers.{layer}.linear_attn.in_proj_qkvz"]
    assert lora.groups == (0, 0, 0, 1) and len(a) == len(b) == 4
    for s in range(4):  # every slice: its group's A, and its B scaled by alpha / r
        assert torch.equal(a[s][0, 0], lora.a[lora.groups[s]].detach())
        assert torch.equal(b[s][0, 0], lora.scale * lora.b[s].detach())
    qkv_b = dict(rl.adapter_weights(model))[
        f"model.layers.{layer}.linear_attn.in_proj_qkv.lora_B.weight"]
    assert qkv_b.data_ptr() not in engine.adapter_ptrs  # the concatenation the check lets by
    with pytest.raises(AssertionError, match="not the engine's tensor"):
        rl.push_weights(engine, [("x.lora_A.weight", torch.zeros(1))])


def test_a_qwen35_lora_keeps_A_log_in_fp32_as_vllm_does(q35):
    """Under LoRA the frozen base is adopted in the compute dtype, but vLLM keeps A_log in
    fp32: a value bf16 cannot hold stays bit for bit (rounded, every decay gate would move)."""
    path = q35()
    files = rl.load_model_files(rl.Config(model=str(path)))
    hf = rl.load_hf_state_dict(files.path)
    key = next(k for k in hf if k.endswith("linear_attn.A_log"))
    hf[key] = torch.full(hf[key].shape, 0.1234567, dtype=torch.float32)
    assert hf[key].to(torch.bfloat16).float()[0] != hf[key][0]  # bf16 cannot hold it
    cfg = rl.Config(model=str(path), dtype="bfloat16", lora_rank=8)
    model, _ = rl.build_models(cfg, files.args, hf, bib.reference_kernels(),
                               rl.Ranks(0, 1, torch.device("cpu")))
    params = dict(model.named_parameters())
    layer = key.split(".")[2]
    assert params[f"layers.{layer}.attention.A_log"].dtype == torch.float32
    assert torch.equal(params[f"layers.{layer}.attention.A_log"].detach(), hf[key])
    assert params[f"layers.{layer}.attention.in_proj_qkvz.weight"].dtype == torch.bfloat16
    assert not params[f"layers.{layer}.attention.A_log"].requires_grad


def test_lora_slices_are_peft_modules_and_tile_each_layer(q35):
    """Each adapted layer's output slices (vLLM's LoRA slices) are one a PEFT module name of
    LORA_LAYERS and together its whole output: Qwen3.5's in_proj_ba is b's Hv rows then a's Hv,
    in_proj_qkvz q, k, v and z. In every layer, the slices a PEFT name labels hold the rows of
    the HF weight of that name (the adapter of in_proj_b's rows is exported as in_proj_b's,
    which peft adds to that weight's output, not to in_proj_a's)."""
    args, hf = load(q35())
    state = rl.hf_to_trainer(hf, args)
    sizes = rl.lora_slice_sizes(args)
    assert sizes["attention.in_proj_ba"] == [4, 4]  # 4 v heads
    assert set(sizes) == set(rl.LORA_LAYERS)
    for path, rows in sizes.items():
        layer, names = rl.LORA_LAYERS[path]
        assert len(rows) == len(names), path
        held = [i for i in range(args.n_layers) if f"layers.{i}.{path}.weight" in state]
        assert held, path
        for i in held:
            weight = state[f"layers.{i}.{path}.weight"]
            assert sum(rows) == weight.shape[0], path
            parts = weight.split(rows)
            for name in dict.fromkeys(names):
                mine = torch.cat([p for p, n in zip(parts, names) if n == name])
                module = f"model.layers.{i}.{layer.split('.')[0]}.{name}.weight"
                assert torch.equal(mine, hf[module]), (path, name, i)


def test_lora_params_count_the_shared_A_in_each_of_its_slices(q35):
    """lora_params (--check's "params trained", the memory estimate's adapters) counts r (K + N)
    a slice, as vLLM's packed layer holds them: in_proj_qkv's one A in each of its q, k and v
    slices. The tiny Qwen3.5 at r 8, every default target: per layer the MLP's 2 x 64 + 256 and
    128 + 64; the full-attention layer's 3 x 64 + 384 and 128 + 64; each of the 3 Gated DeltaNet
    layers' in_proj_qkvz 4 x 64 + 4 x 32 (q, k, v, z) and out_proj 32 + 64."""
    args = rl.model_args_from_hf(rl.read_qwen3_config(q35()))
    mlp, attention, gdn = 2 * 64 + 256 + 128 + 64, 3 * 64 + 384 + 128 + 64, 4 * 64 + 128 + 96
    assert rl.lora_params(rl.Config(lora_rank=8), args) == 8 * (4 * mlp + attention + 3 * gdn)


def test_a_bf16_qwen35_gates_with_dt_bias_in_bf16_and_A_log_in_fp32(q35):
    """As vLLM holds them: the rule's kernels get dt_bias in the compute dtype (the engine
    stores it in bf16) and A_log in fp32; fp32 tests cannot tell the two casts apart."""
    args, hf = load(q35())
    model = rl.build_model(args, rl.hf_to_trainer(hf, args), bib.reference_kernels(),
                           torch.bfloat16, "cpu")
    seen = []
    rule = model.ops.gated_delta_rule

    def spy(q, k, v, a, b, A_log, dt_bias, *rest):
        seen.append((A_log.dtype, dt_bias.dtype, q.dtype))
        return rule(q, k, v, a, b, A_log, dt_bias, *rest)

    model.ops = rl.dataclasses.replace(model.ops, gated_delta_rule=spy)
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = model.ops
    batch = rl.pack([[1, 2, 3]], [[4, 5]])
    with torch.no_grad():
        model(batch, 1.0)
    assert seen and set(seen) == {(torch.float32, torch.bfloat16, torch.bfloat16)}


def test_a_vllm_without_the_lora_layers_the_trainer_binds_is_refused_in_one_sentence(q35):
    """vLLM versions differ in how they lay out a Qwen3.5's projections under LoRA (one
    in_proj_qkvz, or in_proj_qkv beside in_proj_z): slots under other names are refused."""
    path = q35()
    files = rl.load_model_files(rl.Config(model=str(path), dtype="float32"))
    cfg = rl.Config(model=str(path), dtype="float32", lora_rank=8)
    model, _ = rl.build_models(cfg, files.args, rl.load_hf_state_dict(files.path),
                               bib.reference_kernels(), rl.Ranks(0, 1, torch.device("cpu")))
    slots = {rl.vllm_lora_layer(n).replace("in_proj_qkvz", "in_proj_qkv"):
             tuple(tuple(torch.zeros(1, 1, *p.shape) for p in ps) for ps in (m.slice_a(), m.b))
             for n, m in model.named_modules() if isinstance(m, rl.LoRA)}
    with pytest.raises(rl.ConfigError, match=r"vLLM's model has no LoRA layer model\.layers\."
                       r"\d+\.linear_attn\.in_proj_qkvz \(nor \d+ more"):
        rl.bind_lora(model, slots)


def test_lora_init_leaves_an_untargeted_in_proj_z_at_zero(q35):
    """--lora-targets in_proj_qkv: in_proj_qkvz's z slice (its own A, group 1) starts at A = 0,
    so it stays untrained; the shared q, k, v A is drawn."""
    from test_lora import adapted

    args = rl.model_args_from_hf(rl.read_qwen3_config(q35()))
    model = adapted(args, ("in_proj_qkv",))
    assert model.layers[0].attention.in_proj_qkvz.lora.groups == (0, 0, 0, 1)
    init = rl.lora_init(args, rl.LoRASpec(8, 16.0, ("in_proj_qkv",)), 0)
    assert init["layers.0.attention.in_proj_qkvz.lora.a.0"].abs().max() > 0.1
    assert torch.equal(init["layers.0.attention.in_proj_qkvz.lora.a.1"], torch.zeros(8, 64))


def test_in_proj_qkvz_lora_slices_are_q_k_v_z_when_k_and_v_widths_differ(q35):
    """lora_slice_sizes: in_proj_qkvz's slices are [k, k, v, v] rows (vLLM's q, k, v, z); the
    tiny Qwen3.5 has k = v (32), so here v_heads 8 makes v = 64 (as Qwen3.5-4B: 2048 vs 4096)."""
    args = rl.model_args_from_hf(rl.read_qwen3_config(q35()))
    args.qwen35 = rl.dataclasses.replace(args.qwen35, v_heads=8)  # k = 2 x 16, v = 8 x 8
    sizes = rl.lora_slice_sizes(args)
    assert sizes["attention.in_proj_qkvz"] == [32, 32, 64, 64]
    assert sizes["attention.in_proj_ba"] == [8, 8]
    assert rl.fused_sizes(args)["attention.in_proj_qkvz.weight"] == [128, 64]
