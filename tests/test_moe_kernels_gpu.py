"""The MoE ops on the GPU (pytest -m gpu; skip without CUDA or vLLM), at Qwen3-30B-A3B's shape.

  1. the vLLM forward set's moe_experts gives the bits of vLLM's own functional entry point to
     the same kernels, `fused_experts` (its Triton experts, as `TritonExperts.apply` calls them),
     at many token counts; its moe_topk is vLLM's `fused_topk`, checked against fp32 softmax;
  2. batch invariance: rows computed in calls of 1, 7, 256, 257 and 1000 tokens equal the rows of
     one 3000-token call (the router's and the experts');
  3. the custom backward against the fp64 gradients, and bitwise repeatable;
  4. Qwen3.5-35B-A3B's sparse MLP (256 experts, a gated shared expert): decode rows keep their
     bits beside a padding row of garbage and in smaller calls.

Its time is a benchmark: benchmarks/bench_moe_layer.py.

VLLM_BATCH_INVARIANT=1 is set before vLLM is imported: vLLM reads it when the kernels are
configured (the fused MoE tile config is fixed only in that mode).
"""

import os

import pytest
import torch

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")

import batch_invariant_backward as bib  # noqa: E402

pytestmark = pytest.mark.gpu

D, E, K, INTER = 2048, 128, 8, 768  # Qwen3-30B-A3B: hidden, experts, experts per token, moe I
TOKENS = [1, 3, 64, 255, 256, 257, 1000, 3000]


def _need_vllm():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    assert os.environ.get("VLLM_BATCH_INVARIANT") == "1", "run with VLLM_BATCH_INVARIANT=1"


def _diff(name, got, want):
    """'' when bit-equal, else a line with the max abs diff and the first differing index."""
    if torch.equal(got, want):
        return ""
    bad = (got != want).nonzero()
    first = tuple(bad[0].tolist())
    return (f"{name}: {len(bad)} of {got.numel()} differ, max abs diff "
            f"{(got.double() - want.double()).abs().max().item():.3g}, first at {first}: "
            f"{got[first].item()!r} vs {want[first].item()!r}")


@pytest.fixture(scope="module")
def layer():
    """Random bf16 weights of one Qwen3-30B-A3B MoE layer and 3000 tokens' hidden states."""
    _need_vllm()
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3000, D, device="cuda", generator=g).to(torch.bfloat16)
    gate = (torch.randn(E, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * INTER, D, device="cuda", generator=g) * 0.02).to(**bf)
    w2 = (torch.randn(E, D, INTER, device="cuda", generator=g) * 0.02).to(**bf)
    logits = torch.nn.functional.linear(x, gate)  # what the gate (ReplicatedLinear) gives: bf16
    return x, logits, w13, w2


def test_gpu_moe_forward_is_vllms_fused_experts(layer):
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    x, logits, w13, w2 = layer
    vf = bib.vllm_forwards()
    problems = []
    for T in TOKENS:
        w, ids = vf.moe_topk(logits[:T], K, True)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (T, K)
        p = torch.softmax(logits[:T].float(), -1)
        chosen = p.gather(-1, ids.long())  # robust to ties among bf16 logits
        torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(chosen[:, 0], p.max(-1).values, rtol=0, atol=0)
        got = vf.moe_experts(x[:T], w13, w2, w, ids)
        want = fused_experts(x[:T].contiguous(), w13, w2, w, ids)
        assert got.dtype == torch.bfloat16 and got.shape == (T, D)
        line = _diff(f"T={T}", got, want)
        print(line or f"T={T}: bit-equal to fused_experts")
        if line:
            problems.append(line)
    assert not problems, "\n".join(problems)
    # and the math is the reference's (catches a gate/up swap, a missing routing weight)
    w, ids = vf.moe_topk(logits[:64], K, True)
    ref = bib.ref_moe_experts(x[:64], w13, w2, w, ids)
    got = vf.moe_experts(x[:64], w13, w2, w, ids)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"vLLM vs reference (bf16 torch) relative error {err:.2e}")
    assert err < 1e-2


def test_gpu_moe_forward_is_batch_invariant(layer):
    x, logits, w13, w2 = layer
    vf = bib.vllm_forwards()
    w_all, ids_all = vf.moe_topk(logits, K, True)
    out_all = vf.moe_experts(x, w13, w2, w_all, ids_all)
    problems = []
    for n in (1, 7, 256, 257, 1000):
        rows = 64 if n == 1 else 3000  # 64 single-token calls are enough
        parts = [vf.moe_topk(z, K, True) for z in logits[:rows].split(n)]
        w, ids = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        out = torch.cat([vf.moe_experts(xs, w13, w2, ws, i) for xs, ws, i in
                         zip(x[:rows].split(n), w.split(n), ids.split(n))])
        lines = [_diff(f"calls of {n}: ids", ids, ids_all[:rows]),
                 _diff(f"calls of {n}: weights", w, w_all[:rows]),
                 # the experts on the big call's routing, so a routing difference is not
                 # counted twice
                 _diff(f"calls of {n}: experts", torch.cat([
                     vf.moe_experts(xs, w13, w2, ws, i) for xs, ws, i in
                     zip(x[:rows].split(n), w_all[:rows].split(n), ids_all[:rows].split(n))]),
                     out_all[:rows]),
                 _diff(f"calls of {n}: block", out, out_all[:rows])]
        lines = [s for s in lines if s]
        print("\n".join(lines) or f"calls of {n}: rows bit-equal to the 3000-token call")
        problems += lines
    assert not problems, "\n".join(problems)


def _fp64_grads(z, x, w13, w2, ids, gy):
    """Exact gradients (fp64) of <gy, experts(x, router weights(z))> at the given routing."""
    leaves = [t.detach().double().requires_grad_() for t in (z, x, w13, w2)]
    z64, x64, w1364, w264 = leaves
    chosen = torch.softmax(z64, -1).gather(-1, ids.long())
    w = chosen / chosen.sum(-1, keepdim=True)
    out = bib.ref_moe_experts(x64, w1364, w264, w, ids)
    return torch.autograd.grad((out * gy.double()).sum(), leaves)


def test_gpu_moe_backward_matches_fp64_and_is_bitwise_repeatable(layer):
    """The grouped backward (the GPU path) against fp64, within the loop over experts' error
    (the backward it replaced: same roundings), and bitwise repeatable."""
    x, logits, w13, w2 = layer
    T = 300
    vk = bib.vllm_kernels()
    loop = bib.custom_backward_kernels(bib.vllm_forwards(), dict(
        bib.TRITON_BACKWARDS, moe_experts=bib.moe_experts_backward))
    g = torch.Generator(device="cuda").manual_seed(1)
    gy = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w13m, w2m = w13.float(), w2.float()  # fp32 masters, as the trainer may hold them

    def run(kernels):
        leaves = [t.detach().clone().requires_grad_() for t in (logits[:T], x[:T], w13m, w2m)]
        z, xs, a, b = leaves
        w, ids = kernels.moe_topk(z, K, True)
        out = kernels.moe_experts(xs, a, b, w, ids)
        return ids, torch.autograd.grad((out * gy).sum(), leaves)

    ids, got = run(vk)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32,
                                      torch.float32]
    exact = _fp64_grads(logits[:T], x[:T], w13, w2, ids, gy)
    _, looped = run(loop)
    problems = []
    for name, a, b, c in zip(("router logits", "x", "w13", "w2"), got, exact, looped):
        err = ((a.double() - b).norm() / b.norm()).item()
        err_loop = ((c.double() - b).norm() / b.norm()).item()
        print(f"d{name}: relative error vs fp64 {err:.2e} (the loop's: {err_loop:.2e})")
        if not (err < 2e-2 and err <= 1.25 * err_loop + 1e-6):
            problems.append(f"d{name}: relative error {err:.2e}, the loop's {err_loop:.2e}")
    _, again = run(vk)
    for name, a, b in zip(("router logits", "x", "w13", "w2"), got, again):
        line = _diff(f"d{name} run to run", a, b)
        print(line or f"d{name}: bitwise repeatable")
        if line:
            problems.append(line)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("load", ["idle experts", "one expert in every row"])
def test_gpu_grouped_backward_on_uneven_loads(layer, load):
    """4096 tokens routed to 16 of the 128 experts (112 without a token: their gradients are
    exactly 0), or with expert 127 in every row: the grouped backward against the loop, within
    bf16's rounding, and bitwise repeatable."""
    x, _, w13, w2 = layer
    T = 4096
    g = torch.Generator(device="cuda").manual_seed(2)
    xs = x[:1].repeat(T, 1) + (torch.randn(T, D, device="cuda", generator=g) * 0.5).bfloat16()
    if load == "idle experts":  # K distinct ones of experts 0, 8, ..., 120 per row
        ids = (torch.rand(T, 16, device="cuda", generator=g).argsort(-1)[:, :K] * 8).int()
    else:  # 127, and K - 1 distinct ones of the others
        ids = torch.rand(T, 127, device="cuda", generator=g).argsort(-1)[:, :K].int()
        ids[:, 0] = 127
    w = torch.rand(T, K, device="cuda", generator=g)
    gy = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    args = (xs, w13, w2, w, ids, gy, torch.float32, torch.float32)
    got, again = bib.moe_experts_backward_grouped(*args), bib.moe_experts_backward_grouped(*args)
    want = bib.moe_experts_backward(*args)
    used = torch.zeros(E, dtype=torch.bool, device="cuda").index_fill_(0, ids.flatten().long(),
                                                                       True)
    for name, a, b, c in zip(("x", "w13", "w2", "weights"), got, want, again):
        assert torch.equal(a, c), _diff(f"d{name} run to run", a, c)
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        print(f"{load}: d{name} grouped vs loop {err:.2e}")
        assert err < 1e-2, (name, err)
        if name in ("w2", "weights"):  # the same roundings of the same products: measured equal
            assert torch.equal(a, b), _diff(f"d{name} vs the loop", a, b)
    for d in got[1:3]:
        assert torch.all(d[~used] == 0) and d[used].abs().amax(dim=(1, 2)).min() > 0


@pytest.mark.parametrize("pad", ["nan", "inf", "huge"])
def test_gpu_qwen35_moe_block_rows_ignore_a_graphs_padding_rows(pad):
    """Qwen3.5-35B-A3B's sparse MLP as the trainer runs it on vLLM's ops (router GEMM, top 8 of
    256, the experts, the one-column gate of the 512-row shared expert): 127 decode rows alone,
    then with a 128th row of garbage appended (a CUDA graph's batch padded once a sample has
    stopped; vLLM leaves the Gated DeltaNet's output uninitialised there), then in calls of 1
    and 7 rows: the 127 rows keep their bits every time."""
    _need_vllm()
    d, e, k, inter = 2048, 256, 8, 512
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).bfloat16()
    x, router, shared_gate = r(127, d), r(e, d, scale=0.02), r(1, d, scale=0.02)
    w13, w2 = r(e, 2 * inter, d, scale=0.02), r(e, d, inter, scale=0.02)
    s13, s2 = r(2 * inter, d, scale=0.02), r(d, inter, scale=0.02)
    vf = bib.vllm_forwards()

    def block(h):
        w, ids = vf.moe_topk(vf.linear(h, router), k, True)
        shared = vf.linear(vf.silu_and_mul(vf.linear(h, s13)), s2)
        return vf.moe_experts(h, w13, w2, w, ids) + vf.sigmoid_gate_mul(
            shared, vf.linear(h, shared_gate))

    want = block(x)
    garbage = {"nan": float("nan"), "inf": float("inf"), "huge": 3e38}[pad]
    padded = torch.cat([x, torch.full((1, d), garbage, device="cuda").bfloat16()])
    lines = [_diff(f"padded with {pad}", block(padded)[:127], want)]
    lines += [_diff(f"calls of {n}", torch.cat([block(h) for h in x.split(n)]), want)
              for n in (1, 7)]
    lines = [s for s in lines if s]
    print("\n".join(lines) or f"{pad}: the 127 rows bit-equal alone, padded and split")
    assert not lines, "\n".join(lines)
