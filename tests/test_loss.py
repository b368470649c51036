"""The update, pinned: the gradient update applies is the gradient of the GRPO objective
written out here by hand, term by term (PPO clip against the frozen rollout logprobs, k3 KL to
the reference, entropy bonus, one token mean, logprobs of softmax(logits / T)), at the first
optimizer step and at a second one; then two short runs: --kl-coef pulls a policy that has left
the reference back toward it, and a second optimizer step clips what the first one moved."""

import copy

import pytest
import torch

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import ExactEngine, cpu_argv, cpu_trainer_of_run, main_cpu

# A temperature other than 1, all three terms on, no grad clip (the gradient is compared raw);
# 24-token micro-batches split the batch in two of unequal size (offsets and token mean).
LOSS = dict(temperature=0.7, clip_eps=0.2, kl_coef=0.5, entropy_coef=1.0, updates_per_batch=2,
            grad_clip=0.0, micro_batch_tokens=24)


def build(path, noise: float = 0.0):
    """The checkpoint as a trainer model (fp32, reference kernels), each weight moved by
    `noise` times its mean magnitude in a random direction if asked."""
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), args)
    g = torch.Generator().manual_seed(1)
    state = {k: v + noise * v.abs().mean() * torch.randn(v.shape, generator=g)
             for k, v in state.items()}
    return rl.build_model(args, state, bib.reference_kernels(), torch.float32, "cpu")


def objective(model, ref, packed, old, adv, cfg):
    """The loss by hand, from the logits up: per token (N,) its three terms and what feeds them.

        lp = log softmax(z / T)[y],  H = -sum p log p,  rho = exp(lp - old),
        pg = -min(rho A, clip(rho, 1 - eps, 1 + eps) A),  q = lp_ref - lp,  kl = e^q - q - 1,
        L = sum_t (pg + beta kl - c_H H) / N
    """
    def logprobs(m):
        z = m.logits(m.hidden(packed)[packed.gen_index]) / cfg.temperature  # (N, V)
        return torch.log_softmax(z, -1)

    lps = logprobs(model)
    lp = lps.gather(-1, packed.targets[:, None])[:, 0]  # (N,)
    ent = -(lps.exp() * lps).sum(-1)
    with torch.no_grad():
        ref_lp = logprobs(ref).gather(-1, packed.targets[:, None])[:, 0]
    a = adv[packed.seq]  # each token: its sequence's advantage
    rho = torch.exp(lp - old)
    unclipped, clipped = rho * a, rho.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a
    pg = -torch.minimum(unclipped, clipped)
    q = ref_lp - lp
    kl = q.exp() - q - 1
    terms = {"pg": pg, "kl": cfg.kl_coef * kl, "entropy": -cfg.entropy_coef * ent}
    seen = dict(lp=lp, pg=pg, kl=kl, ent=ent, ratio=rho, clipped=(clipped < unclipped).float())
    return terms, seen


class Recorder(torch.optim.SGD):
    """SGD that keeps, at each step, the weights it starts from and the gradient it applies."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        ps = [p for group in self.param_groups for p in group["params"]]
        self.seen.append(([p.detach().clone() for p in ps], [p.grad.clone() for p in ps]))
        return super().step(closure)


def flat(ts) -> torch.Tensor:
    return torch.cat([t.flatten() for t in ts])


def test_each_update_descends_the_hand_written_objective(ckpt):
    """At both updates (the second from moved weights, against the same frozen logprobs), the
    gradient is the hand objective's within fp32 rounding, and each term's own gradient is
    large next to that tolerance: a term with the wrong sign, size, temperature, advantage
    or old logprob fails. The first pass's token sums and logprobs are the hand values."""
    path = ckpt()
    cfg = rl.Config(**LOSS)
    model, ref = build(path), build(path, noise=0.3)
    ref.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (7, 4, 9, 5)]
    comps = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 3, 6, 4)]
    packed = rl.pack(prompts, comps)
    assert [len(r) for r in rl.plan_micro_batches(packed, cfg)] == [2, 2]  # 20 + 24 tokens
    adv = torch.tensor([0.2, -0.1, 0.4, -0.3])  # (B,)
    with torch.no_grad():
        lp0, _ = model(packed, cfg.temperature)
    # frozen "rollout" logprobs off the policy's by up to 0.5 nats: ratios in and out of the clip
    old = lp0 + torch.linspace(-0.5, 0.5, len(lp0))
    opt = Recorder(model.parameters(), lr=0.01)
    first = rl.update(model, ref, opt, packed, old, adv, cfg)
    sums, first_lp = first.sums, first.logprobs
    assert len(opt.seen) == 2
    N = len(packed.targets)
    for update, (weights, got) in enumerate(opt.seen):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for p, w in zip(m.parameters(), weights):
                p.copy_(w)
        terms, seen = objective(m, ref, packed, old, adv, cfg)
        grads = {k: flat(torch.autograd.grad(t.sum() / N, list(m.parameters()),
                                             retain_graph=True)) for k, t in terms.items()}
        want = sum(grads.values())
        err = (flat(got) - want).norm() / want.norm()
        assert err < 1e-4, (update, float(err))
        share = {k: float(v.norm() / want.norm()) for k, v in grads.items()}
        assert min(share.values()) > 0.05, (update, share)  # every term weighs in the gradient
        assert seen["clipped"].sum() > 0 and (seen["ratio"] - 1).abs().max() > cfg.clip_eps
        if update == 0:
            torch.testing.assert_close(first_lp, seen["lp"], atol=1e-5, rtol=0)
            want_sums = torch.stack([seen[k].sum() for k in ("pg", "kl", "ent", "ratio",
                                                             "clipped")]).detach()
            torch.testing.assert_close(sums, want_sums, atol=1e-4, rtol=1e-5)
        else:
            assert not torch.equal(flat(weights), flat(opt.seen[0][0]))  # it starts moved


def test_kl_pulls_a_policy_that_left_the_reference_back(ckpt, tmp_path):
    """Rewards all 0 (A = 0) and no entropy bonus: the KL is the only force. The policy starts
    off the frozen reference; each step logs the hand-computed KL of its rollout's tokens, and
    its update leaves them a smaller KL than it found."""
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, kl_coef=1.0, entropy_coef=0.0, lr=1e-4,
                                 temperature=0.7, eval_size=0, save_every=0)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())  # frozen
    trainer.reward_fn = lambda completion, answer: 0.0
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in trainer.model.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    trainer.engine.push(rl.hf_weights(trainer.model))
    rollouts = []
    rollout = trainer.engine.first_turn

    def recorded(prompts, indices, step):  # each step's samples, as the trainer packs them
        outs = rollout(prompts, indices, step)
        episodes = rl.start_episodes([None] * sum(map(len, outs)), prompts, outs, trainer.cfg)
        rollouts.append(rl.episodes_rollout(episodes, routes=False))
        return outs

    trainer.engine.first_turn = recorded

    def kl(model, ro) -> float:  # the token mean of k3 on the rollout's tokens
        packed = rl.pack(ro.prompts, ro.completions)
        zeros = torch.zeros(len(packed.targets))
        with torch.no_grad():
            _, seen = objective(model, trainer.ref_model, packed, zeros, zeros, trainer.cfg)
        return seen["kl"].mean().item()

    for step in range(3):
        before = copy.deepcopy(trainer.model)
        m, _ = rl.rl_step(trainer, step)
        found, left = kl(before, rollouts[-1]), kl(trainer.model, rollouts[-1])
        assert m["kl_div"] == pytest.approx(found, rel=1e-4)  # the logged KL: the hand's
        assert m["pg_loss"] == 0 and m["loss"] == pytest.approx(m["kl_div"], rel=1e-6)
        assert found > 0.02 and left < 0.95 * found, (step, found, left)


def test_a_second_optimizer_step_clips_what_the_first_moved(ckpt, tmp_path, monkeypatch):
    """--updates-per-batch 2 with the exact stand-in engine: the first optimizer step's ratio is
    1 for every token (its old logprobs are the rollout's, equal bit for bit); the second one's,
    against those same frozen logprobs, is not, and the clip acts on some tokens. The update
    gets each group's rewards normalised within the group."""
    updates, rewards, advantages = [], [], []
    accumulate, clip, with_parity = rl.accumulate_gradients, rl.ppo_clip_loss, rl.update_with_parity
    optimize = rl.update

    def each_update(*a, **k):
        updates.append([])
        return accumulate(*a, **k)

    def recorded(logp, old_logp, adv, clip_eps):
        pg, ratio, clipped = clip(logp, old_logp, adv, clip_eps)
        updates[-1].append((ratio.detach(), clipped))
        return pg, ratio, clipped

    def step_advantages(model, ref_model, optimizer, packed, old_logp, adv, *a, **k):
        advantages.append(adv.clone())
        return optimize(model, ref_model, optimizer, packed, old_logp, adv, *a, **k)

    monkeypatch.setattr(rl, "accumulate_gradients", each_update)
    monkeypatch.setattr(rl, "ppo_clip_loss", recorded)
    def step_rewards(trainer, rollout, *a):  # each episode's reward, as the step scored it
        rewards.append(torch.tensor([e.reward for e in rollout.episodes]))
        return with_parity(trainer, rollout, *a)

    monkeypatch.setattr(rl, "update_with_parity", step_rewards)
    monkeypatch.setattr(rl, "update", step_advantages)
    reward = tmp_path / "varied.py"  # rewards that differ within a group: A != 0
    reward.write_text("def score(completion, answer):\n"
                      "    return float(sum(map(ord, completion)) % 5)\n")
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=2, updates_per_batch=2, kl_coef=0.0,
                    eval_size=0, save_every=0, reward=f"{reward}:score")
    assert main_cpu(argv, ExactEngine) == 0
    assert len(updates) == 4 and len(advantages) == 2  # 2 steps x 2 updates
    for first, second in zip(updates[::2], updates[1::2]):
        ratio1 = torch.cat([r for r, _ in first])
        ratio2, clipped2 = (torch.cat(x) for x in zip(*second))
        assert torch.equal(ratio1, torch.ones_like(ratio1))
        assert (ratio2 - 1).abs().max() > 0.2 and clipped2.sum() > 0, (ratio2, clipped2)
    assert len(rewards) == 2
    for r, adv in zip(rewards, advantages):
        groups = r.view(-1, 3)  # --group-size 3
        want = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
        assert (groups.std(1) > 0).any()
        torch.testing.assert_close(adv, want.flatten())


def test_a_gradient_above_grad_clip_is_applied_at_exactly_that_norm(ckpt):
    """--grad-clip c on a batch whose raw gradient norm is far above c: the optimizer gets
    the raw gradient scaled to norm c (same direction), and the step reports the raw norm;
    one far below c passes unchanged. With clipping off (max_norm = inf), the first fails."""
    path = ckpt()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (7, 4, 9, 5)]
    comps = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 3, 6, 4)]
    packed = rl.pack(prompts, comps)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0])  # (B,)

    def first_gradient(grad_clip: float):
        cfg = rl.Config(**{**LOSS, "updates_per_batch": 1, "kl_coef": 0.0,
                           "grad_clip": grad_clip})
        model = build(path)
        with torch.no_grad():
            old, _ = model(packed, cfg.temperature)
        opt = Recorder(model.parameters(), lr=0.0)
        norm = rl.update(model, None, opt, packed, old, adv, cfg).grad_norm
        return flat(opt.seen[0][1]).double(), float(norm)  # fp64: a 1M-term fp32 sum drifts

    raw, raw_norm = first_gradient(0.0)
    assert raw_norm == pytest.approx(float(raw.norm()), rel=1e-5) and raw_norm > 1.0
    clip = raw_norm / 100
    got, reported = first_gradient(clip)
    assert reported == pytest.approx(raw_norm, rel=1e-6)  # the norm before clipping
    assert float(got.norm()) == pytest.approx(clip, rel=1e-5)
    # clip_grad_norm_ scales by c / (norm + 1e-6)
    torch.testing.assert_close(got, raw * (clip / (raw_norm + 1e-6)), atol=1e-9, rtol=1e-5)
    unclipped, _ = first_gradient(raw_norm * 100)
    torch.testing.assert_close(unclipped, raw, atol=0, rtol=0)
