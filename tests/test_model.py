"""The trainer model on the reference kernels: logits vs transformers, packing, gradients."""

import pytest
import torch

import simple_rl as rl
from helpers import assert_custom_backwards_match_autograd, cast_once_changes_no_bit
from helpers import cpu_trainer as trainer
from helpers import random_ids as seqs




@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_fp32(ckpt, tied):
    from transformers import Qwen3ForCausalLM

    path = ckpt(tied=tied)
    model = trainer(path)
    ref = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (
        ref.config.head_dim == 128
        and ref.config.num_key_value_heads < ref.config.num_attention_heads
    )  # GQA
    ids = seqs([33, 7, 60])
    p = rl.pack(ids, [[] for _ in ids])
    with torch.no_grad():
        ours = model.logits(model.hidden(p))  # (T, V)
        for b, x in enumerate(ids):
            want = ref(torch.tensor([x])).logits[0]
            got = ours[p.cu_seqlens[b] : p.cu_seqlens[b + 1]]
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_packed_forward_equals_per_sequence_forwards(ckpt):
    model = trainer(ckpt())
    ids = seqs([1, 19, 5, 44])
    p = rl.pack(ids, [[] for _ in ids])
    with torch.no_grad():
        packed = model.hidden(p)
        for b, x in enumerate(ids):
            alone = model.hidden(rl.pack([x], [[]]))
            torch.testing.assert_close(
                packed[p.cu_seqlens[b] : p.cu_seqlens[b + 1]], alone, atol=1e-5, rtol=1e-5
            )


def test_pack_indexes_generated_tokens():
    p = rl.pack([[5, 6], [7]], [[8, 9, 10], [11]])
    assert p.tokens.tolist() == [5, 6, 8, 9, 10, 7, 11]
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert p.cu_seqlens.tolist() == [0, 5, 7] and p.max_seqlen == 5
    assert p.gen_index.tolist() == [1, 2, 3, 5]  # the hidden state before each generated token
    assert p.targets.tolist() == [8, 9, 10, 11]
    assert p.seq.tolist() == [0, 0, 0, 1]


def test_sub_pack_and_micro_batches_cover_every_token():
    p = rl.pack([[1] * 3, [2] * 4, [3] * 2], [[4] * 2, [5], [6] * 3])
    groups = rl.micro_batches([5, 5, 5], 10)
    assert groups == [range(0, 2), range(2, 3)]
    parts = [rl.sub_pack(p, g) for g in groups]
    assert torch.cat([mb.targets for mb, _ in parts]).tolist() == p.targets.tolist()
    assert [s for _, s in parts] == [slice(0, 3), slice(3, 6)]
    mb = parts[1][0]
    assert mb.tokens[mb.gen_index].tolist() == [3, 6, 6]  # rebased indices point at the right rows


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy(ckpt, temperature):
    model = trainer(ckpt())
    ids = seqs([12, 8])
    p = rl.pack([x[:6] for x in ids], [x[6:] for x in ids])
    with torch.no_grad():
        lp, ent = model(p, temperature)
        full = torch.log_softmax(model.logits(model.hidden(p)[p.gen_index]) / temperature, -1)
    torch.testing.assert_close(lp, full.gather(-1, p.targets[:, None])[:, 0])
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
    assert lp.shape == (8,) and (lp < 0).all() and (ent > 0).all()


def test_custom_backward_model_matches_autograd_model(ckpt):
    """The whole model with every hand-written backward vs plain autograd (same forwards)."""
    assert_custom_backwards_match_autograd(ckpt(tied=False), [17, 4, 29])


@pytest.mark.parametrize("tied", [True, False])
def test_weights_cast_once_is_what_the_gemms_use_and_changes_no_bit(ckpt, tied):
    """Two micro-batches under weights_cast_once give the bf16 forward's logprobs and the fp32
    gradients bit for bit; inside, every GEMM reads the cast made on entry (zeroing one changes
    the output), and on exit the casts are gone."""
    path = ckpt(tied=tied)
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), args)
    ids = seqs([11, 6, 23])
    parts = [rl.pack([x[:4] for x in ids[s]], [x[4:] for x in ids[s]]) for s in (slice(0, 2),
                                                                                slice(2, 3))]
    model = cast_once_changes_no_bit(args, state, parts)
    casts = [m for m in model.modules() if hasattr(m, "compute_weight")]  # embedding first
    head = model.tok_embeddings if tied else model.output
    with torch.no_grad(), rl.weights_cast_once(model):
        made = [m for m in casts if m.compute_weight is not None]
        assert len(made) == 4 * args.n_layers + 1  # wqkv, wo, w13, w2 per block; the head
        assert all(m.compute_weight.dtype == torch.bfloat16 for m in made)
        assert torch.equal(head.compute_weight, head.weight.to(torch.bfloat16))
        before = model(parts[0], 0.8)[0]
        model.layers[0].attention.wo.compute_weight.zero_()
        assert not torch.equal(model(parts[0], 0.8)[0], before)
    assert all(m.compute_weight is None for m in casts)


def test_a_bf16_embedding_sums_the_gradient_of_a_repeated_token_in_fp32():
    """The embedding gathers rows of its fp32 master, then casts (not the other way round): a
    token seen 300 times gets the sum of 300 gradients in fp32, 300 (bf16 stops counting ones
    at 256)."""
    emb = rl.Embedding(4, 8, torch.bfloat16)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    tokens = torch.tensor([1] * 300 + [2])
    y = emb(tokens)
    assert y.dtype == torch.bfloat16
    y.backward(torch.ones_like(y))
    assert emb.weight.grad.dtype == torch.float32
    assert torch.equal(emb.weight.grad[1], torch.full((8,), 300.0))
    assert torch.equal(emb.weight.grad[2], torch.ones(8))
    assert torch.equal(emb.weight.grad[[0, 3]], torch.zeros(2, 8))


def test_sub_pack_is_the_packing_of_its_sequences_alone():
    """Packed's worked example, [a b | x y] [c | z]: sequence 1 on its own is exactly
    pack([c], [z]), max_seqlen included (its own longest sequence, not the whole batch's)."""
    p = rl.pack([[1, 2], [5]], [[3, 4], [6]])
    part, owned = rl.sub_pack(p, range(1, 2))
    alone = rl.pack([[5]], [[6]])
    assert owned == slice(2, 3) and part.max_seqlen == alone.max_seqlen == 2
    for name in ("tokens", "positions", "cu_seqlens", "gen_index", "targets", "seq", "prefill"):
        assert getattr(part, name).tolist() == getattr(alone, name).tolist(), name


def test_the_rotary_cache_holds_every_position_the_config_allows(ckpt):
    """--max-model-len may equal max_position_embeddings (2048 here), so a sample may reach
    position 2047: the rotary cache has a row for each of positions 0-2047, the last cos and
    sin of 2047 theta^(-2i/D) (one row short, that position would read past its end)."""
    model = trainer(ckpt())
    P, D = model.args.max_seq_len, model.args.head_dim
    assert P == 2048 and model.rope.shape == (P, D)
    angle = (P - 1) * model.args.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    want = torch.cat([angle.cos(), angle.sin()])
    torch.testing.assert_close(model.rope[-1].double(), want, atol=1e-3, rtol=0)
