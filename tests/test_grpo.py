"""GRPO math against hand-computed values."""

import math

import pytest
import torch

import simple_rl as rl
from helpers import two_ranks


def test_group_advantages_std_normalised():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0])
    a = rl.group_advantages(r, 4, std_normalize=True, eps=0.0)
    std1 = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # unbiased
    want1 = [0.75 / std1, -0.25 / std1, -0.25 / std1, -0.25 / std1]
    std2 = math.sqrt((9 + 1 + 1 + 9) / 3)
    want2 = [-3 / std2, -1 / std2, 1 / std2, 3 / std2]
    torch.testing.assert_close(a, torch.tensor(want1 + want2))


def test_group_advantages_mean_only_and_equal_rewards():
    r = torch.tensor([3.0, 3.0, 3.0, 1.0, 0.0, 2.0])
    torch.testing.assert_close(
        rl.group_advantages(r, 3, std_normalize=False, eps=1e-6),
        torch.tensor([0.0, 0, 0, 0, -1, 1]),
    )
    a = rl.group_advantages(r, 3, std_normalize=True, eps=1e-6)
    assert torch.equal(a[:3], torch.zeros(3))  # all equal: no signal, no NaN
    assert torch.isfinite(a).all()


def test_ppo_clip_loss_hand_values():
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.5, 0.5]))
    old = torch.zeros(5)
    adv = torch.tensor([2.0, 1.0, 1.0, -1.0, -1.0])
    pg, ratio, clipped = rl.ppo_clip_loss(logp, old, adv, 0.2)
    torch.testing.assert_close(ratio, torch.tensor([1.0, 1.5, 0.5, 1.5, 0.5]))
    # A>0: min(rho A, clip A) -> 1.2 at rho=1.5 (clipped), 0.5 at rho=0.5 (unclipped, pessimistic)
    # A<0: min(-1.5, -1.2) = -1.5 (unclipped); min(-0.5, -0.8) = -0.8 (clipped)
    torch.testing.assert_close(pg, torch.tensor([-2.0, -1.2, -0.5, 1.5, 0.8]))
    assert clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]


def test_ppo_ratio_one_is_plain_policy_gradient():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([0.5, -2.0])
    pg, ratio, clipped = rl.ppo_clip_loss(logp, logp.detach(), adv, 0.2)
    pg.sum().backward()
    assert torch.equal(ratio, torch.ones(2)) and clipped.sum() == 0
    torch.testing.assert_close(logp.grad, -adv)  # d(-rho A)/d logp at rho = 1


def test_kl_k3_hand_values():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -1.5])
    q = ref - logp
    want = torch.exp(q) - q - 1
    torch.testing.assert_close(rl.kl_k3(logp, ref), want)
    assert rl.kl_k3(logp, ref)[0] == 0 and (rl.kl_k3(logp, ref) >= 0).all()
    torch.testing.assert_close(
        rl.kl_k3(torch.tensor([0.0]), torch.tensor([math.log(2)])), torch.tensor([1 - math.log(2)])
    )


def test_parity_report_compares_bits():
    a = torch.tensor([-1.0, -2.5, 0.0, -3.0])
    b = torch.tensor(
        [-1.0, -2.5, -0.0, float(torch.nextafter(torch.tensor(-3.0), torch.tensor(0.0)))]
    )
    rep = rl.parity_report(a, b, torch.tensor([7, 8, 9, 10]), [2, 1, 1], rows=4)
    assert rep.n_tokens == 4 and rep.n_mismatch == 2  # -0.0 vs 0.0 differs in bits; one ulp differs
    assert 0 < rep.max_abs_diff < 1e-6
    lines = rep.table.splitlines()
    assert len(lines) == 3  # with differences, the table shows where each differing sample starts
    assert lines[1].split()[:4] == ["1", "0/1", "1", "9"] and "80000000" in lines[1]
    assert lines[2].split()[:4] == ["2", "0/1", "1", "10"]
    assert "c0400000" in lines[2] and "c03fffff" in lines[2]
    same = rl.parity_report(a, a.clone(), torch.arange(4), [4], rows=2)
    assert same.n_mismatch == 0 and same.max_abs_diff == 0.0
    assert [row.split()[:4] for row in same.table.splitlines()[1:]] == [
        ["0", "0/4", "0", "0"], ["0", "1/4", "0", "1"]]  # none differ: the first tokens


def test_the_table_shows_where_each_differing_sample_first_differs():
    """Samples of 3, 2 and 4 tokens; the first differs at its 2nd and 3rd, the last from its
    2nd on, the middle nowhere: the table shows each differing sample's first differing token
    and its count, --parity-rows 1 the first such sample only, 0 only the header. A logprob of
    0.0 against -0.0 (a certain token) differs in its bits though |delta| is 0: the line says
    identical=no. A NaN delta on a rank is the largest over the ranks."""
    a = -torch.arange(1.0, 10.0)
    b = a + torch.tensor([0, 1e-3, 2e-3, 0, 0, 0, 3e-3, 4e-3, 5e-3])
    rep = rl.parity_report(a, b, torch.arange(11, 20), [3, 2, 4], rows=8)
    head, *rows = rep.table.splitlines()
    assert rep.n_mismatch == 5
    assert [row.split()[:4] for row in rows] == [["0", "1/3", "2", "12"], ["2", "1/4", "3", "17"]]
    one = rl.parity_report(a, b, torch.arange(11, 20), [3, 2, 4], rows=1).table.splitlines()
    assert one == [head, rows[0]]
    assert rl.parity_report(a, b, torch.arange(9), [3, 2, 4], rows=0).table.splitlines() == [head]
    zero = rl.parity_report(torch.tensor([0.0, -1.0]), torch.tensor([-0.0, -1.0]),
                            torch.arange(2), [2], rows=2)
    assert (zero.n_mismatch, zero.max_abs_diff) == (1, 0.0)
    assert rl.parity_line(zero) == "parity: identical=no | 1/2 tokens differ | max |delta| 0"
    nan = rl.parity_over_ranks(rl.Parity(4, 1, math.nan, "t"), torch.device("cpu"))
    assert (nan.n_tokens, nan.n_mismatch, nan.max_abs_diff, nan.table) == (4, 1, math.inf, "t")


def test_debugger_names_the_first_differing_op():
    x = torch.randn(5, 8)
    y = x.clone()
    y[3, 2] = torch.nextafter(y[3, 2], torch.tensor(1e9))
    ours = {"a": [x], "b": [x, x], "c": [y]}
    theirs = {"a": [x.clone()], "b": [x.clone(), x.clone()], "c": [x.clone()]}
    rows = rl.compare_traces(ours, theirs, ["a", "b", "c"])
    assert [r["n_diff"] for r in rows] == [0, 0, 1] and rows[2]["rows"] == [3]
    assert rl.first_divergence(rows) == "c"
    assert "first divergence: c" in rl.format_debug(rows)
    bad = rl.compare_traces({"a": [x]}, {"a": [x[:2]]}, ["a"])
    assert bad[0]["n_diff"] == -1 and rl.first_divergence(bad) == "a"
    assert rl.trace_names(2)[0] == ("layers.0.attention_norm", "model.layers.0.input_layernorm")
    assert rl.trace_names(2)[8] == ("layers.0.feed_forward.act_fn", "model.layers.0.mlp.act_fn")
    assert rl.trace_names(2)[-1] == ("norm", "model.norm")


def test_adv_eps_is_added_to_the_groups_std():
    """A = (r - mean) / (std + eps): a large eps shrinks the advantages, never inflates them."""
    r = torch.tensor([0.0, 2.0, 1.0, 1.0])
    a = rl.group_advantages(r, 2, std_normalize=True, eps=0.5)
    d = math.sqrt(2) + 0.5  # unbiased std of (0, 2) is sqrt(2)
    torch.testing.assert_close(a, torch.tensor([-1 / d, 1 / d, 0.0, 0.0]))
    assert not a[2:].signbit().any()  # an equal group's 0 is +0: (0) / (0 + eps)


def test_the_steps_advantages_follow_the_configs_std_normalize_and_adv_eps():
    """finite_advantages (the step's) reads --std-normalize and --adv-eps: rewards (1, 0) give
    A = +-0.5 mean-only, +-0.5 / (sqrt(1/2) + 0.5) normalised with eps 0.5."""
    r = torch.tensor([1.0, 0.0, 2.0, 2.0])
    plain = rl.finite_advantages(r, rl.Config(group_size=2, std_normalize=False), str)
    torch.testing.assert_close(plain, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    d = 0.5 / (math.sqrt(0.5) + 0.5)  # unbiased std of (1, 0) is sqrt(1/2)
    normed = rl.finite_advantages(r, rl.Config(group_size=2, adv_eps=0.5), str)
    torch.testing.assert_close(normed, torch.tensor([d, -d, 0.0, 0.0]))


def test_parity_over_two_ranks_sums_the_counts_and_takes_the_larger_delta(monkeypatch):
    two_ranks(monkeypatch, [6, 2, 5, 1], [0.25])
    p = rl.parity_over_ranks(rl.Parity(4, 1, 0.5, "t", True, 4, 0), torch.device("cpu"))
    assert (p.n_tokens, p.n_mismatch, p.routing_tokens, p.routing_mismatch) == (10, 3, 9, 1)
    assert (p.max_abs_diff, p.table, p.routes_checked) == (0.5, "t", True)


def test_step_metrics_are_token_means_and_sample_statistics():
    """The logged step: (pg, kl, entropy, ratio, clipped) are token means (their sums over the
    step's 10 generated tokens, divided by 10); rewards, generated lengths (a tool's token is
    not one) and stops are over its 4 samples (2 prompts x G = 2); the KL is shown only where
    it is used."""
    generated = [[True], [True] * 2, [True] * 3, [True, True, False, True, True]]
    rollout = rl.Rollout(prompts=[[0]] * 4, completions=[[1] * len(g) for g in generated],
                         generated=generated, logprobs=torch.zeros(10),
                         completed=[True, True, True, False], routed=None, episodes=[])
    sums = torch.tensor([1.0, 2.0, 5.0, 10.4, 4.0])

    def metrics(cfg):
        return rl.step_metrics(cfg, rollout, torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, sums, 10,
                               torch.tensor(0.5), rl.Parity(10, 0, 0.0, ""), (1.0, 2.0, 3.0))

    m = metrics(rl.Config(group_size=2, kl_coef=0.1, entropy_coef=0.01))
    want = {"pg_loss": 0.1, "kl_div": 0.2, "entropy": 0.5, "ratio_mean": 1.04,
            "ratio_clipped_frac": 0.4, "loss": 0.115,  # 0.1 + 0.1 x 0.2 - 0.01 x 0.5
            "reward_mean": 0.75, "reward_std": 0.5, "completion_len_mean": 2.5,
            "completion_stopped_frac": 0.75, "grad_norm": 0.5, "time/rollout_s": 1.0,
            "time/train_s": 2.0, "time/push_s": 3.0, "time/step_s": 6.0}
    assert {k: m[k] for k in want} == pytest.approx(want, rel=1e-6)
    assert "kl_div" not in metrics(rl.Config(group_size=2))
