"""Qwen3.5's memory: the KV cache vLLM's hybrid allocator needs (full-attention KV a token, a
Gated DeltaNet state a sequence, in pages and blocks shared by both), what the backward keeps of a
Gated DeltaNet layer and what its fp32 recomputation holds at its peak (measured on CPU), the
micro-batch picked for Qwen3.5-4B, and Qwen3's estimates as they were."""

import json
import random
from types import SimpleNamespace

import pytest
import torch
from make_checkpoint import PRESETS, QWEN35_PRESETS
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import make_qwen35_checkpoint, random_step

GIB = 2**30


def qwen35_args(preset: str = "qwen3.5-4b", **change):
    """The model args of a Qwen3.5 preset's shape (tests/make_checkpoint.py), no weights."""
    p = {**QWEN35_PRESETS[preset], **change}
    hf = Qwen3_5TextConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"], intermediate_size=p["inter"], tie_word_embeddings=p["tied"],
        linear_num_key_heads=p["k_heads"], linear_num_value_heads=p["v_heads"],
        linear_key_head_dim=p["k_dim"], linear_value_head_dim=p["v_dim"],
        max_position_embeddings=p["max_pos"], layer_types=p.get("layer_types"),
        rope_parameters={"rope_type": "default", "rope_theta": p["rope_theta"],
                         "partial_rotary_factor": 0.25})
    return rl.model_args_from_hf(hf)


# --- Qwen3 and Qwen3-MoE: unchanged -------------------------------------------------------


def test_qwen3_estimates_are_the_same_as_before_qwen35_was_counted():
    """Bytes pinned from the estimate before Qwen3.5's terms were added, equal to the bit: dense
    Qwen3 on one and two GPUs, with known prompts, Qwen3-30B-A3B's layers, dense and sparse
    layers mixed with a reference model, Qwen3-14B under LoRA."""
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    def qwen3(dim, layers, heads, inter, tied=True):
        return SimpleNamespace(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=8,
                               head_dim=128, hidden_dim=inter, vocab_size=151936,
                               enable_weight_tying=tied)

    a3b = rl.dataclasses.replace(qwen3_args["30B-A3B"], max_seq_len=40960, n_layers=4)
    a3b.sparse_layers = (0, 1, 2, 3)
    mixed = rl.dataclasses.replace(qwen3_args["30B-A3B"], max_seq_len=40960, n_layers=6)
    mixed.sparse_layers = (1, 3, 5)
    q14 = Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, vocab_size=151936,
                         head_dim=128, hidden_dim=17408, norm_eps=1e-6, rope_theta=1e6,
                         max_seq_len=40960, enable_weight_tying=False)
    q8, q17 = qwen3(4096, 36, 32, 12288, tied=False), qwen3(2048, 28, 16, 6144)
    C = rl.Config
    short = C(num_prompts=16, group_size=8, max_new_tokens=128, max_model_len=256,
              micro_batch_tokens=32768)
    pinned = [  # (args, cfg, world, prompts): (activations, peak, KV cache) bytes
        (q8, C(micro_batch_tokens=4096), 1, rl.ANY_PROMPT,
         27261724160, 222663668096.0, 19629342720),
        (q8, C(micro_batch_tokens=4096), 2, rl.ANY_PROMPT,
         27261724160, 133863675349.33334, 9814671360),
        (q17, C(micro_batch_tokens=24576), 1, (20, 30),
         73666480128, 135091004416.0, 15267266560),
        # one micro-batch a step: the larger of the backward's two ends, the top layer's (every
        # activation, the head's gradient) and the bottom one's (every gradient, one layer's
        # activations); 52138563328.0 counting both whole
        (a3b, short, 2, (128, 128), 9750708224.0, 46337399040.0, 142606336),
        (mixed, C(micro_batch_tokens=8192, kl_coef=0.01), 1, (40, 90),
         8465567232.0, 79916544640.0, 1635778560),
        # 111034072576.0 before LoRA's fixed margin went from 4 GiB to 3 (LORA_FIXED)
        (q14, C(micro_batch_tokens=8192, lora_rank=16), 1, rl.ANY_PROMPT,
         76046435840, 111034072576.0 - 2**30, 21810380800),
    ]
    for args, cfg, world, prompts, activations, peak, kv in pinned:
        est = rl.memory_estimate(cfg, args, world, prompts)
        assert (est["activations"], est["peak"]) == (activations, peak)
        assert rl.kv_cache_bytes(cfg, args, world) == kv
        assert rl.gdn_backward_bytes(args, 10**6) == 0


# --- the engine's KV cache ----------------------------------------------------------------


def test_kv_cache_of_qwen35_4b_is_full_attention_kv_and_gdn_states_in_vllms_blocks():
    """Qwen3.5-4B: 8 full-attention layers of 4 kv heads x 256, 24 Gated DeltaNet layers of 16 k
    heads and 32 v heads of 128, conv kernel 4. Worked out:
      KV a token, full attention only:  2 x 8 x 4 x 256 x 2 = 32768 (one layer's A = 4096)
      a GDN layer's state a sequence:   (2 x 16 x 128 + 32 x 128) x 3 x 2 (conv, bf16)
                                        + 32 x 128 x 128 x 4 (rule, fp32) = 2146304
      vLLM's block: b = 64 ceil(2146304 / (64 x 4096)) = 576 tokens, a page 576 A = 2359296 B,
        groups of 8 layers (one full attention, three GDN), 8 pages a block = 18874368 B
      a sequence of 1024 tokens: ceil(1024 / 576) = 2 blocks + 3 (one a GDN group) = 5
      128 samples (the defaults: 16 prompts x 8): (128 x 5 + 1 null block) blocks."""
    args = qwen35_args()
    assert rl.gdn_layers(args) == tuple(i for i in range(32) if i % 4 != 3)
    assert rl.kv_bytes_per_token(args) == 32768
    assert rl.gdn_state_bytes(args) == 49152 + 2097152 == 2146304
    block = 8 * 576 * 4096
    assert block == 18874368
    cfg = rl.Config()
    assert rl.kv_cache_bytes(cfg, args, 1) == (128 * 5 + 1) * block
    assert rl.kv_cache_bytes(cfg, args, 2) == (64 * 5 + 1) * block  # a rank's 64 samples
    # at least what the tokens and states need, less than a tenth more (block rounding)
    need = 128 * (8 * 1024 * 4096 + 24 * 2146304)
    assert need < rl.kv_cache_bytes(cfg, args, 1) < 1.12 * need
    assert rl.kv_cache_bytes(rl.Config(kv_cache_gib=3.5), args, 1) == int(3.5 * GIB)


def test_qwen35_kv_cache_grows_by_blocks_with_samples_and_attention_with_length():
    """Each sample adds its blocks (ceil(L / b) for attention, one a GDN group); a longer
    --max-model-len adds attention blocks only, b tokens at a time, the states staying one a
    sequence whatever its length."""
    args = qwen35_args()
    b, block = 576, 18874368

    def kv(samples, max_len):
        return rl.hybrid_kv_cache_bytes(args, samples, max_len)

    for max_len in (256, 576, 577, 1024, 4096):
        per_sample = -(-max_len // b) + 3
        assert kv(1, max_len) == (per_sample + 1) * block
        grown = [kv(s + 1, max_len) - kv(s, max_len) for s in (1, 7, 100)]
        assert grown == [per_sample * block] * 3
    assert kv(64, 576) == kv(64, 1) == 64 * 4 * block + block  # the states: one block a group
    assert kv(64, 577) - kv(64, 576) == 64 * block  # one attention block more
    assert kv(64, 576 * 7) - kv(64, 576 * 3) == 64 * 4 * block  # linear in length, b at a time


def test_vllms_grouping_of_layers_of_other_ratios():
    """vLLM groups each kind's layers by the smaller count, or by the larger when it is below 1.5
    the smaller (4 full beside 5 GDN: one group each, the full one padded); the tiny preset's 1
    full and 3 GDN layers: four groups of one layer. Its states fit a 64-token page."""
    args = qwen35_args(layer_types=["linear_attention"] * 5 + ["full_attention"] * 4, layers=9)
    A, b = 4096, 576
    assert rl.hybrid_kv_cache_bytes(args, 10, 1024) == (10 * (2 + 1) + 1) * 5 * b * A
    tiny = qwen35_args(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=32, k_heads=2,
                       v_heads=4, k_dim=16, v_dim=8, inter=128)  # make_qwen35_checkpoint's
    state = (2 * 2 * 16 + 4 * 8) * 3 * 2 + 4 * 8 * 16 * 4  # 576 + 2048
    assert rl.gdn_state_bytes(tiny) == state == 2624
    A = 2 * 2 * 32 * 2  # 256: a 64-token page (16 KiB) holds a state
    assert rl.hybrid_kv_cache_bytes(tiny, 8, 200) == (8 * (4 + 3) + 1) * 64 * A


def test_a_qwen35_moes_block_holds_max_len_and_one_sample_passes_vllms_check():
    """A Qwen3.5-MoE keeps vLLM's prefix cache on for its routes (qwen35_engine_args): its
    block holds --max-model-len (a multiple of 128; vLLM's own 1,088 tokens at 35B-A3B's shapes
    where that is longer), and in that mode vLLM's start-up check counts two Gated DeltaNet
    pages for one request: one sample on a rank gets them."""
    args = qwen35_args("qwen3.5-35b-a3b", inter=512)  # 10 full, 30 GDN layers: groups of 10
    assert rl.hybrid_block_tokens(args, 4000) == 1088  # dense: vLLM's own
    args.sparse_layers = tuple(range(args.n_layers))
    assert rl.hybrid_block_tokens(args, 512) == 1088 and rl.hybrid_block_tokens(args, 4000) == 4096
    block = 10 * 4096 * 2048  # a page of 4,096 tokens x 2 kv heads x 256 x K, V for 10 layers
    assert rl.hybrid_kv_cache_bytes(args, 8, 4000) == (8 * (1 + 3) + 1) * block
    assert rl.hybrid_kv_cache_bytes(args, 1, 4000) == (1 + 3 + 3 + 1) * block  # not 1 + 3 + 1


def test_engine_memory_asks_vllm_for_the_hybrid_kv_cache(monkeypatch):
    """What engine_memory asks vLLM for at Qwen3.5-4B, the default 16 prompts x 8 samples: the
    hybrid KV cache kv_cache_bytes counts (641 pages); max_num_seqs holds every sample of the
    rank (128 in one process, 64 a rank of two), so every sample decodes in every step (fewer
    would queue samples, and a Qwen3.5 refuses the preemption that follows); the fraction vLLM
    checks is free is weights + KV cache + ENGINE_MARGIN over the card (6 GiB of margin: without
    it vLLM may start on a card without room for its activations); a sleeping LoRA engine keeps
    its weights, so a push maps its KV cache alone back (the weights too would make
    push_weights free the allocator's cache needlessly at every step)."""
    props = SimpleNamespace(total_memory=140 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    args = qwen35_args()
    weights, kv = 2 * 4_205_751_296, 12_098_469_888  # 2 bytes a parameter; 641 x 18,874,368
    assert 2 * rl.count_params(args) == weights and rl.kv_cache_bytes(rl.Config(), args, 1) == kv
    one, two = (rl.Ranks(0, world, torch.device("cpu")) for world in (1, 2))
    for lora, wake in ((False, weights + kv), (True, kv)):
        sizes, woken = rl.engine_memory(rl.Config(), args, one, lora)
        assert woken == wake and sizes["kv_cache_memory_bytes"] == kv
        assert sizes["max_num_seqs"] == 128 and sizes["max_num_batched_tokens"] == 8192
        assert sizes["gpu_memory_utilization"] == (weights + kv + 6 * GIB) / (140 * GIB)
    assert rl.engine_memory(rl.Config(), args, two, False)[0]["max_num_seqs"] == 64
    for gib, bound in ((16, 0.9), (1024, 0.05)):  # at most 0.9 of a card, at least 0.05
        props.total_memory = gib * GIB
        sizes, _ = rl.engine_memory(rl.Config(), args, one, False)
        assert sizes["gpu_memory_utilization"] == bound


# --- the trainer's activations ------------------------------------------------------------


def test_qwen35_layers_keep_what_their_formulas_count():
    """Qwen3.5-4B per token: a Gated DeltaNet layer keeps 2 (8 dim + 4 Hk Dk + 5 Hv Dv + 2 Hv)
    + 2 x 3 H bytes, a gated full-attention layer Qwen3's count with 3 q more; the mean over
    the 32 layers (24 GDN, 8 full)."""
    args = qwen35_args()
    dim, H, q, kv = 2560, 9216, 16 * 256, 4 * 256
    gdn = 2 * (8 * dim + 4 * 16 * 128 + 5 * 32 * 128 + 2 * 32) + 6 * H
    full = 2 * (8 * dim + 2 * q + 4 * kv + 3 * q) + 6 * H
    assert rl.token_layer_bytes(args) == (24 * gdn + 8 * full) / 32 == 151648


def saved_bytes_per_token(args, layer: int, lengths=((90, 60), (180, 120))) -> float:
    """Bytes a block's forward leaves for its backward a token, on CPU in bf16 with the GPU
    path's autograd Functions (custom backwards): every distinct storage the backward saves,
    its growth from one packed batch to a longer one (the weights' casts cancel)."""
    torch.manual_seed(0)
    ops = bib.custom_backward_kernels(bib.reference_forwards())
    model = rl.Qwen3(args, ops, torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.init_rope("cpu")
    held = []
    for n in lengths:
        batch = rl.pack([[1] * (k // 2) for k in n], [[2] * (k - k // 2) for k in n])
        T = len(batch.tokens)
        x = torch.randn(T, args.dim, dtype=torch.bfloat16, requires_grad=True)
        storages = {}  # data pointer -> bytes of each storage the backward keeps

        def pack(t, kept=storages):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with rl.weights_cast_once(model), torch.autograd.graph.saved_tensors_hooks(
                pack, lambda t: t):
            out = model.layers[layer](x, torch.randn_like(x), batch, model.rope)
        held.append((T, sum(storages.values())))
        del out
    (t0, b0), (t1, b1) = held
    return (b1 - b0) / (t1 - t0)


def test_a_qwen35_block_saves_about_what_its_formula_counts_as_qwen3s_does():
    """On CPU, in bf16, a Qwen3 block saves 84% of what token_layer_bytes counts for it (a count
    calibrated on H200s, where the peak holds more than the saved tensors); a Gated DeltaNet
    block and a gated attention block of the same width save less than theirs, and no less
    than a tenth below Qwen3's share (77% and 81%)."""
    from transformers import Qwen3Config

    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=512)
    qwen3 = rl.model_args_from_hf(Qwen3Config(num_hidden_layers=1, **shape))
    share = saved_bytes_per_token(qwen3, 0) / rl.token_layer_bytes(qwen3)
    assert 0.8 < share <= 1
    args = qwen35_args(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512,
                       k_heads=2, v_heads=4, k_dim=32, v_dim=32, vocab=512)
    assert rl.gdn_layers(args) == (0, 1, 2)
    gdn = rl.token_layer_bytes(SimpleNamespace(**{**vars(args), "n_layers": 1}))
    full = SimpleNamespace(**vars(args))
    full.qwen35 = rl.dataclasses.replace(args.qwen35, layer_types=("full_attention",) * 4)
    for layer, counted in ((0, gdn), (3, rl.token_layer_bytes(full))):
        measured = saved_bytes_per_token(args, layer)
        assert share - 0.1 < measured / counted <= 1, (layer, measured, counted)


def peak_bytes(fn) -> int:
    """The most bytes fn() had allocated at once on CPU beyond what it started with, from the
    profiler's record of every allocation and release."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("Hk, Hv, Dk, Dv, lengths", [
    (2, 4, 32, 32, [256]), (1, 3, 64, 32, [200, 64]), (2, 2, 32, 128, [130]),
    (2, 4, 128, 128, [128, 64, 64]), (16, 32, 128, 128, [64]), (16, 32, 128, 128, [192, 64]),
])
def test_gdn_backward_peak_is_at_most_its_bound(Hk, Hv, Dk, Dv, lengths):
    """GatedDeltaRuleFn's backward (the rule recomputed in fp32 through the chunked form, then
    differentiated) at its peak on CPU: 80 to 100% of gdn_backward_bytes over the padded rows
    (each sample rounded up to whole 64-token chunks: measured 0.85-0.99); the last two at
    Qwen3.5-4B's heads (16 k heads, 32 v heads, 128 dims)."""
    gen = torch.Generator().manual_seed(0)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def r(*shape):
        return torch.randn(*shape, generator=gen).bfloat16().requires_grad_()

    inputs = [r(T, Hk, Dk), r(T, Hk, Dk), r(T, Hv, Dv), r(T, Hv), r(T, Hv),
              torch.randn(Hv, generator=gen).requires_grad_(), r(Hv)]
    prefill = torch.tensor([max(1, n // 2) for n in lengths])
    o = bib.GatedDeltaRuleFn.apply(*inputs, cu, max(lengths), prefill,
                                   bib.reference_forwards().gated_delta_rule,
                                   bib.gated_delta_rule_backward)
    go = torch.randn(o.shape, generator=gen).bfloat16()
    peak = peak_bytes(lambda: torch.autograd.grad(o, inputs, go))
    padded = sum(-(-n // 64) * 64 for n in lengths)  # each sample in whole chunks
    shape = rl.Qwen35Args(layer_types=("linear_attention",), k_heads=Hk, v_heads=Hv, k_dim=Dk,
                          v_dim=Dv, conv_kernel=4, rotary_dim=0)
    bound = padded * rl.gdn_rule_bytes(shape, fla=False)
    assert 0.8 * bound < peak <= bound, (peak, bound)
    assert rl.gdn_backward_bytes(SimpleNamespace(qwen35=shape), padded, fla=False) >= bound


@pytest.mark.parametrize("Hk, Hv, D, lengths", [
    (2, 4, 32, [256]), (2, 4, 128, [256] + [8] * 31), (16, 32, 128, [64]), (2, 4, 64, [1, 1, 130]),
])
def test_conv_backward_peak_is_at_most_its_bound(Hk, Hv, D, lengths):
    """CausalConv1dFn's backward (the conv recomputed in fp32, each sample after its own K - 1
    zeros, then differentiated) at its peak on CPU: 80 to 100% of 4 x 7 channels a row over
    T + B (K - 1) rows (measured 6.3-6.5), and within gdn_backward_bytes over the padded rows:
    one long sample beside 31 short ones is not padded to the longest."""
    gen = torch.Generator().manual_seed(0)
    T, B, C = sum(lengths), len(lengths), (2 * Hk + Hv) * D
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(T, C, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(C, 4, generator=gen).requires_grad_()
    y = bib.CausalConv1dFn.apply(x, w, cu, max(lengths), bib.reference_forwards().causal_conv1d)
    gy = torch.randn(y.shape, generator=gen).bfloat16()
    peak = peak_bytes(lambda: torch.autograd.grad(y, (x, w), gy))
    assert 0.8 * 4 * 7 * C * (T + 3 * B) < peak <= 4 * 7 * C * (T + 3 * B), peak
    shape = rl.Qwen35Args(layer_types=("linear_attention",), k_heads=Hk, v_heads=Hv, k_dim=D,
                          v_dim=D, conv_kernel=4, rotary_dim=0)
    padded = sum(-(-n // 64) * 64 for n in lengths)
    assert peak <= rl.gdn_backward_bytes(SimpleNamespace(qwen35=shape), padded)


def test_one_micro_batch_counts_the_larger_end_of_the_backward():
    """One micro-batch a step (2 samples of 32 + 16 tokens, 48 < 4096): the gradients are
    counted with the activations, as the larger of the backward's two ends. Qwen3.5-4B with a
    tiny batch: the bottom end (every fp32 gradient, one layer's activations, one Gated DeltaNet
    layer's backward) is the larger; the top end (every activation, the head's gradient) at a
    batch of 32768 tokens."""
    args = qwen35_args()
    n = rl.count_params(args)
    small = rl.Config(num_prompts=1, group_size=2, max_new_tokens=16, max_model_len=64,
                      micro_batch_tokens=4096)
    est = rl.memory_estimate(small, args, 1, (32, 32))
    rows, _ = rl.trained_rows(small, 1, (32, 32))
    bottom = 4 * n + rows * rl.token_layer_bytes(args) + rl.gdn_backward_bytes(
        args, rl.padded_rows(small, 1, (32, 32)))
    assert rl.late_gradients(small, 1, (32, 32), 1, n) == 4 * n
    assert est["activations"] == bottom and est["trainer state"] == 12 * n
    large = rl.Config(num_prompts=16, group_size=8, max_new_tokens=128, max_model_len=256,
                      micro_batch_tokens=32768)
    est = rl.memory_estimate(large, args, 1, (100, 128))
    plain = rl.memory_estimate(rl.dataclasses.replace(large, micro_batch_tokens=16384), args, 1,
                               (100, 128))  # two micro-batches: the gradients apart
    rows, _ = rl.trained_rows(large, 1, (100, 128))
    assert est["activations"] > 4 * n + rows * rl.token_layer_bytes(args) + rl.gdn_backward_bytes(
        args, rl.padded_rows(large, 1, (100, 128)))  # the top end is the larger
    assert est["trainer state"] == 12 * n and plain["trainer state"] == 16 * n


def test_a_step_that_fills_its_micro_batch_exactly_is_one_micro_batch():
    """late_gradients' test is micro_batches' own: samples that add up to the budget exactly
    fit one micro-batch, one token more makes two."""
    cfg = rl.Config(num_prompts=4, group_size=2, max_new_tokens=32, max_model_len=64,
                    micro_batch_tokens=8 * 64)  # 8 samples of up to 32 + 32 tokens
    assert rl.late_gradients(cfg, 1, (32, 32), 1, 10) == 40
    assert len(rl.micro_batches([64] * 8, cfg.micro_batch_tokens)) == 1
    fuller = rl.dataclasses.replace(cfg, micro_batch_tokens=8 * 64 - 1)
    assert rl.late_gradients(fuller, 1, (32, 32), 1, 10) == 0
    assert len(rl.micro_batches([64] * 8, fuller.micro_batch_tokens)) == 2


def test_padded_rows_bound_what_the_gdn_backward_pads():
    """Each sample in whole 64-token chunks: at most 63 rows more a sample than the micro-batch
    holds, and no more than its samples padded to the longest. With short prompts every sample
    of a rank can share one micro-batch; long prompts leave fewer a micro-batch. Then the bound
    against what `plan_micro_batches` makes of random rollouts."""
    cfg = rl.Config(micro_batch_tokens=4096)  # 128 samples of up to 256 new tokens
    assert rl.padded_rows(cfg, 1, (20, 60)) == 4096 + 128 * 63  # was 128 x 320 padded
    assert rl.padded_rows(cfg, 1, (1000, 1000)) == 4 * 1024  # 4096 // 1000 samples
    assert rl.padded_rows(cfg, 1, rl.ANY_PROMPT) == 4096 + 128 * 63  # was 128 x 1024
    assert rl.padded_rows(cfg, 2, (20, 60)) == 4096 + 64 * 63
    rng = random.Random(0)
    for _ in range(300):
        c = rl.Config(num_prompts=rng.choice([2, 4, 8]), group_size=rng.choice([2, 4]),
                      max_new_tokens=rng.choice([8, 32, 96]), max_model_len=256,
                      micro_batch_tokens=rng.choice([256, 512, 1024, 4096]))
        world = rng.choice([1, 2])
        shortest = rng.randint(1, 100)
        longest = rng.randint(shortest, 256 - c.max_new_tokens)
        samples = rl.samples_per_rank(c, world)
        prompts = [[3] * rng.randint(shortest, longest) for _ in range(samples)]
        completions = [[1] * rng.randint(1, c.max_new_tokens) for _ in prompts]
        packed = rl.pack(prompts, completions)
        bound = rl.padded_rows(c, world, (shortest, longest))
        for part in rl.plan_micro_batches(packed, c):
            batch, _ = rl.sub_pack(packed, part)
            assert chunked_rows(batch) <= bound, (c, part)


def chunked_rows(batch) -> int:
    """The rows bib.chunk_rows cuts a packed micro-batch into."""
    rows, _ = bib.chunk_rows(batch.cu_seqlens)
    return rows.numel()


def test_a_qwen35s_episodes_packed_by_turn_stay_within_the_bounds():
    """A Qwen3.5 trains an episode of k turns as k samples (rl.pack_rollout), each its whole
    request: random episodes of 1-4 turns with tool messages, packed so, keep every micro-batch
    within trained_rows and padded_rows taken with turns = --max-turns."""
    rng = random.Random(1)

    def turn(ctx, n):
        return rl.Turn(ctx, rl.Completion([1] * n, [0.0] * n, True))

    for _ in range(300):
        c, world, shortest, longest = random_step(rng, turns=(1, 2, 4))
        turns = c.max_turns
        episodes = []
        for _ in range(rl.samples_per_rank(c, world)):
            ctx, used, played = [3] * rng.randint(shortest, longest), 0, []
            for k in range(rng.randint(1, turns)):
                used += len(ctx)
                n = min(rng.randint(1, c.max_new_tokens), c.max_model_len - used)
                played.append(turn(ctx, n))
                used += n
                ctx = [2] * min(rng.randint(0, 60), c.max_model_len - used - 1)
                if not ctx or c.max_model_len - used - len(ctx) < 1:
                    break
            episodes.append(rl.Episode(None, played))
        packed, _ = rl.pack_rollout(rl.episodes_rollout(episodes, False), by_turn=True)
        rows, generated = rl.trained_rows(c, world, (shortest, longest), turns)
        padded = rl.padded_rows(c, world, (shortest, longest), turns)
        for part in rl.plan_micro_batches(packed, c):
            batch, _ = rl.sub_pack(packed, part)
            assert len(batch.tokens) <= rows and len(batch.targets) <= generated, (c, part)
            assert chunked_rows(batch) <= padded, (c, part)


@pytest.mark.parametrize("qwen35", [False, True])
def test_the_estimate_counts_an_episode_as_the_samples_it_is_packed_into(qwen35):
    """samples_an_episode, the estimate's samples an episode of --max-turns 4, is what
    pack_rollout makes of one as the trainer calls it (by turn where the model has Gated DeltaNet
    layers, which replay each request as vLLM prefilled it): 4 for a Qwen3.5, 1 for a Qwen3."""
    from torchtitan.models.qwen3 import qwen3_args

    args = qwen35_args() if qwen35 else qwen3_args["1.7B"]
    turns = [rl.Turn([3] * 5 if k == 0 else [2] * 3, rl.Completion([1] * 4, [0.0] * 4, True))
             for k in range(4)]
    packed, _ = rl.pack_rollout(rl.episodes_rollout([rl.Episode(None, turns)], False),
                                by_turn=bool(rl.gdn_layers(args)))
    c = rl.Config(env="calc", max_turns=4)
    assert len(packed.prefill) == rl.samples_an_episode(c, args) == (4 if qwen35 else 1)


def test_qwen35_4b_at_the_defaults_picks_a_micro_batch_that_fits_an_h200():
    """Qwen3.5-4B at the defaults (16 prompts x 8 samples, 1024 tokens), prompts of 20 to 60
    tokens: 4096 tokens a micro-batch fit 140 GiB and 8192 do not. The activations are 32 layers
    of token_layer_bytes a row plus the larger transient: the head's logits, or one GDN layer's
    backward over 128 samples in whole chunks, 4096 + 128 x 63 rows. The latter is 224 KiB a
    row on fla's rule (the conv's: fla's rule needs 148.75), below the head's logits; 416 KiB
    a row on the fp32 reference's (--kernels reference), above them."""
    args = qwen35_args()
    h200, prompts = 140 * GIB, (20, 60)
    for kernels in ("auto", "reference"):
        cfg = rl.Config(kernels=kernels)
        size = rl.auto_micro_batch(cfg, args, 1, h200, prompts)
        assert size == 4096
        cfg = rl.dataclasses.replace(cfg, micro_batch_tokens=size)
        est = rl.memory_estimate(cfg, args, 1, prompts)
        assert est["peak"] <= h200
        grown = rl.dataclasses.replace(cfg, micro_batch_tokens=8192)
        assert rl.memory_estimate(grown, args, 1, prompts)["peak"] > h200
        padded = rl.padded_rows(cfg, 1, prompts)
        rows, generated = rl.trained_rows(cfg, 1, prompts)
        transient = max(generated * args.vocab_size * 4,
                        rl.gdn_backward_bytes(args, padded, fla=kernels == "auto"))
        assert est["activations"] == (rows * 32 * rl.token_layer_bytes(args) + transient
                                      + bib.LOGPROB_ROWS * args.vocab_size * 4)
    assert padded == 4096 + 128 * 63
    assert rl.gdn_backward_bytes(args, 1) == 4 * 7 * (2 * 16 * 128 + 32 * 128) == 224 * 1024
    assert rl.gdn_backward_bytes(args, 1, fla=False) == 4 * (
        32 * (9 * 128 + 7 * 128 + 9 * 64 + 2 * 128 * 128 // 64) + 3 * 16 * 128) == 416 * 1024
    fla = 2 * (2 * 32 * 128 * 128 // 64 + 4 * 32 * 128 + 7 * 32 * 128 + 6 * 16 * 128 + 32 * 64
               + 12 * 32)
    assert rl.gdn_rule_bytes(rl.qwen35(args), fla=True) == fla == 148.75 * 1024
    assert 224 * 1024 * padded < generated * args.vocab_size * 4 < 416 * 1024 * padded


def test_vllm_groups_by_the_smaller_count_at_exactly_one_and_a_half():
    """vLLM takes the larger count as the group size only while max < 1.5 min (strictly):
    2 full-attention layers beside 3 Gated DeltaNet ones group by 2 (one full group, two GDN
    groups, the second padded), not by 3."""
    args = qwen35_args(layer_types=["linear_attention"] * 3 + ["full_attention"] * 2, layers=5)
    A, b = 4096, 576  # the 4B preset's page: 2 x 4 kv heads x 256 x 2 bytes; 576-token blocks
    assert 2 * args.n_kv_heads * args.head_dim * 2 == A
    per_sequence = 1 * -(-1024 // b) + 2  # ceil(1024 / b) attention blocks + 2 GDN groups
    assert rl.hybrid_kv_cache_bytes(args, 10, 1024) == (10 * per_sequence + 1) * 2 * b * A


# --- the presets of tests/make_checkpoint.py against the published configs --------------
# The GPU tests call a run on a preset "the exact shape" of a model on these numbers alone.

# Qwen/Qwen3-*'s config.json on the hub (layers and heads as the model cards list them too):
# layers, hidden_size, attention heads, kv heads, intermediate_size, tie_word_embeddings
QWEN3_PUBLISHED = {
    "qwen3-0.6b": (28, 1024, 16, 8, 3072, True),
    "qwen3-1.7b": (28, 2048, 16, 8, 6144, True),
    "qwen3-4b": (36, 2560, 32, 8, 9728, True),
    "qwen3-8b": (36, 4096, 32, 8, 12288, False),
    "qwen3-14b": (40, 5120, 40, 8, 17408, False),
    "qwen3-32b": (64, 5120, 64, 8, 25600, False),
}
FIELDS = ("layers", "hidden", "heads", "kv_heads", "inter", "tied")


@pytest.mark.parametrize("name", sorted(QWEN3_PUBLISHED))
def test_qwen3_presets_are_the_published_configs(name):
    """Each Qwen3 preset is its hub config.json: the shape above, and the family's vocab 151936,
    head_dim 128 and 40960 positions (the comment above PRESETS says the same)."""
    p = PRESETS[name]
    assert tuple(p[k] for k in FIELDS) == QWEN3_PUBLISHED[name]
    assert (p["vocab"], p["head_dim"], p["max_pos"]) == (151936, 128, 40960)


def test_qwen35_9b_is_transformers_qwen3_5_text_config():
    """make_checkpoint.py names transformers' Qwen3_5TextConfig defaults as Qwen3.5-9B's shape:
    the preset must be those defaults, field by field (positions aside: the preset's 262144 are
    the hub's, the class's default 32768)."""
    p, c = QWEN35_PRESETS["qwen3.5-9b"], Qwen3_5TextConfig()
    assert (p["vocab"], p["hidden"], p["layers"], p["heads"], p["kv_heads"], p["inter"],
            p["head_dim"], p["k_heads"], p["v_heads"], p["k_dim"], p["v_dim"], p["tied"]) == (
        c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
        c.num_key_value_heads, c.intermediate_size, c.head_dim, c.linear_num_key_heads,
        c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
        c.tie_word_embeddings)
    assert (p["hidden"], p["layers"], p["inter"]) == (4096, 32, 12288)  # the class's, pinned


def test_qwen35_35b_a3b_is_transformers_qwen3_5_moe_text_config():
    """Likewise Qwen3_5MoeTextConfig's defaults for Qwen3.5-35B-A3B: 40 layers of hidden 2048,
    256 experts of 512 rows, 8 a token, a shared expert of 512 rows (the preset's comment)."""
    p, c = QWEN35_PRESETS["qwen3.5-35b-a3b"], Qwen3_5MoeTextConfig()
    assert (p["vocab"], p["hidden"], p["layers"], p["heads"], p["kv_heads"], p["head_dim"],
            p["k_heads"], p["v_heads"], p["experts"], p["top_k"], p["moe_inter"],
            p["shared_inter"], p["tied"]) == (
        c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
        c.num_key_value_heads, c.head_dim, c.linear_num_key_heads, c.linear_num_value_heads,
        c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
        c.shared_expert_intermediate_size, c.tie_word_embeddings)
    assert (p["experts"], p["top_k"], p["moe_inter"], p["shared_inter"]) == (256, 8, 512, 512)


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b",
                                  "qwen3.5-35b-a3b"])
def test_every_qwen35_preset_has_the_familys_shared_shape(name):
    """What the comment above QWEN35 says of every Qwen3.5 text model: head_dim 256, 16 linear
    key heads of 128 and value heads of 128, vocab 248320, 262144 positions, rope theta 1e7."""
    p = QWEN35_PRESETS[name]
    assert (p["head_dim"], p["k_heads"], p["k_dim"], p["v_dim"], p["vocab"], p["max_pos"],
            p["rope_theta"]) == (256, 16, 128, 128, 248320, 262144, 1e7)


def test_qwen35_27b_cut_to_8_layers_is_the_model_its_gpu_run_counted():
    """results/h100_q35_t07_27b_fla/README.md: this preset cut to 8 of 64 layers (6 Gated
    DeltaNet, 2 gated attention) was a model of 5.59B parameters, its 248320-row embedding and
    untied head included. Built from the preset on the meta device it must still be that
    model: 48 value heads or 24 query heads changed would move it by 0.1B or more."""
    p = {**QWEN35_PRESETS["qwen3.5-27b"], "layers": 8}
    hf = Qwen3_5TextConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"], intermediate_size=p["inter"], tie_word_embeddings=p["tied"],
        linear_num_key_heads=p["k_heads"], linear_num_value_heads=p["v_heads"],
        linear_key_head_dim=p["k_dim"], linear_value_head_dim=p["v_dim"])
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(hf)
    assert round(sum(t.numel() for t in model.parameters()) / 1e9, 2) == 5.59


def test_the_qwen35_builder_rotates_a_quarter_of_each_head_as_the_published_models(tmp_path):
    """helpers.make_qwen35_checkpoint (every preset's builder) writes what its docstring and
    make_checkpoint.py's comment say of the published Qwen3.5s: a quarter of each full-attention
    head rotated, rope theta 1e7, three linear-attention layers then a full one."""
    config = json.loads((make_qwen35_checkpoint(tmp_path / "q") / "config.json").read_text())
    rope = config["rope_parameters"]
    assert (rope["partial_rotary_factor"], rope["rope_theta"]) == (0.25, 1e7)
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
