"""The training loop end to end on CPU: a stand-in engine, reference kernels, TensorBoard tags."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import TorchEngine

TAGS = ["loss", "pg_loss", "kl_div", "entropy", "reward_mean", "reward_std", "ratio_mean", "ratio_clipped_frac",
        "determinism/mismatched_tokens", "determinism/max_abs_diff", "completion_len_mean",
        "time/rollout_s", "time/train_s", "time/push_s"]


def make_trainer(path, log_dir, **overrides):
    kw = dict(model=str(path), dtype="float32", num_prompts=2, group_size=3, max_new_tokens=6, max_model_len=128,
              micro_batch_tokens=128, lr=1e-2, entropy_coef=0.1, kl_coef=0.05, seed=1)
    cfg = rl.Config(**{**kw, **overrides})
    rl.validate(cfg)
    path, args, tok, eos = rl.load_model_files(cfg)
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), args)
    model = rl.build_model(args, state, bib.reference_kernels(), torch.float32, "cpu")
    ref = rl.build_model(args, state, bib.reference_kernels(), torch.float32, "cpu").requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engine = TorchEngine(cfg, path, eos)
    engine.push(model)
    return rl.Trainer(cfg, engine, tok, model, ref, opt, SummaryWriter(log_dir))


def test_two_steps_log_every_tag_and_push_weights(ckpt, tmp_path):
    tr = make_trainer(ckpt(), tmp_path / "tb")
    w0 = tr.model.layers[0].attention.wqkv.weight.detach().clone()
    for step in range(2):
        m, parity = rl.rl_step(tr, step)
        assert parity.n_tokens == m["determinism/tokens"] > 0
        assert parity.max_abs_diff < 1e-4  # the CPU stand-in recomputes prefixes in fp32: close, not bitwise
        assert m["kl_div"] >= 0 and m["entropy"] > 0 and 0 <= m["ratio_clipped_frac"] <= 1
        assert "step" in rl.format_step(step, m) and "mismatched" in rl.format_step(step, m)
    w1 = tr.model.layers[0].attention.wqkv.weight.detach()
    assert not torch.equal(w0, w1)  # the entropy bonus moves the weights
    assert torch.equal(tr.engine.model.layers[0].attention.wqkv.weight, w1)  # pushed into the engine
    assert m["kl_div"] > 0  # after one update the policy has left the frozen reference
    tr.writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for t in TAGS:
        assert t in tags, t
        assert [e.step for e in acc.Scalars(t)] == [0, 1]
    assert "weight_delta/layers.0.attention.wqkv.weight/magnitude" in tags
    assert "weight_delta/norm.weight/relative_change" in tags
    assert acc.Scalars("weight_delta/layers.0.attention.wqkv.weight/magnitude")[0].value > 0


def test_train_step_logprobs_equal_a_fresh_forward(ckpt, tmp_path):
    """The logprobs handed to the parity check are exactly the first update's forward (micro-batched)."""
    tr = make_trainer(ckpt(), tmp_path / "tb", updates_per_batch=2)
    prompts = [[5, 6, 7], [8, 9]]
    ro = tr.engine.rollout(prompts, 0)
    p = rl.pack(ro.prompts, ro.completions)
    with torch.no_grad():
        h = tr.model(p.tokens, p.positions, p.cu_seqlens, p.max_seqlen)
        want, _ = tr.model.token_logprobs(h[p.gen_index], p.targets, tr.cfg.temperature)
    adv = torch.linspace(-1, 1, len(ro.completions))
    cfg = tr.cfg
    metrics, got = rl.train_step(tr.model, tr.ref_model, tr.optimizer, p, ro.logprobs, adv, cfg)
    assert len(rl.micro_batches((p.cu_seqlens[1:] - p.cu_seqlens[:-1]).tolist(), cfg.micro_batch_tokens)) >= 1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert metrics["grad_norm"] > 0


def test_micro_batching_does_not_change_the_gradient(ckpt, tmp_path):
    grads = []
    for mbt in (32, 4096):
        tr = make_trainer(ckpt(), tmp_path / f"tb{mbt}", micro_batch_tokens=mbt, max_model_len=32)
        ro = tr.engine.rollout([[5, 6, 7, 8, 9, 10, 11, 12]] * 2, 0)
        p = rl.pack(ro.prompts, ro.completions)
        n_groups = len(rl.micro_batches((p.cu_seqlens[1:] - p.cu_seqlens[:-1]).tolist(), mbt))
        assert n_groups == (1 if mbt == 4096 else 3)  # 6 samples of 14 tokens
        tr.optimizer = torch.optim.SGD(tr.model.parameters(), lr=0.0)
        rl.train_step(tr.model, tr.ref_model, tr.optimizer, p, ro.logprobs, torch.linspace(-1, 1, 6), tr.cfg)
        grads.append(torch.cat([q.grad.flatten() for q in tr.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("bad", [float("nan")])
def test_parity_report_flags_nan(bad):
    rep = rl.parity_report(torch.tensor([-1.0]), torch.tensor([bad]), torch.tensor([3]), rows=1)
    assert rep.n_mismatch == 1
