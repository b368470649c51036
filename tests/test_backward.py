"""Every hand-written backward in batch_invariant_backward.py against autograd of the reference op.

On CPU the custom Functions run the reference forwards, so what is tested is the
backward itself. The GPU variants run vLLM's kernels in the forward, in batch-invariant mode
as the trainer does (vLLM's CUDA kernels read VLLM_BATCH_INVARIANT from the environment).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import batch_invariant_backward as bib

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")

torch.manual_seed(0)
F64 = dict(dtype=torch.float64)
ROOT = Path(__file__).resolve().parents[1]


def grads(fn, inputs):
    """Gradients of sum(out * fixed random weights) w.r.t. every floating input."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(1)
    loss = sum(
        (o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum() for o in outs
    )
    return torch.autograd.grad(loss, [x for x in inputs if x.requires_grad])


def check(custom_fn, ref_fn, inputs, atol=1e-10):
    got, want = grads(custom_fn, inputs), grads(ref_fn, inputs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-8)


CUSTOM = bib.custom_backward_kernels(bib.reference_forwards())
REF = bib.reference_kernels()


def packed_qkv(lens, hq=4, hk=2, d=16, dtype=torch.float64):
    t = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return (
        torch.randn(t, hq, d, dtype=dtype),
        torch.randn(t, hk, d, dtype=dtype),
        torch.randn(t, hk, d, dtype=dtype),
        cu,
    )


def test_rms_norm_backward():
    x, w = torch.randn(7, 3, 32, **F64), torch.rand(32, **F64) + 0.5
    check(lambda x, w: CUSTOM.rms_norm(x, w, 1e-6), lambda x, w: REF.rms_norm(x, w, 1e-6), [x, w])


def test_add_rms_norm_backward_both_outputs():
    x, r, w = torch.randn(9, 32, **F64), torch.randn(9, 32, **F64), torch.rand(32, **F64) + 0.5
    check(
        lambda *a: CUSTOM.add_rms_norm(*a, 1e-6), lambda *a: REF.add_rms_norm(*a, 1e-6), [x, r, w]
    )


def test_rotary_backward():
    q, k, _, _ = packed_qkv([5, 3])
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    cs = bib.rope_cos_sin_cache(16, 10000.0, 32, "cpu", torch.float64)
    check(
        lambda q, k, p: CUSTOM.rotary(q, k, p, cs),
        lambda q, k, p: REF.rotary(q, k, p, cs),
        [q, k, pos],
    )


def test_partial_rotary_turns_the_first_dims_and_passes_the_rest():
    """Qwen3.5: a cache of R < D columns rotates the first R dims of a head, as a cache of a
    head of R dims would, and leaves the others; the backward too."""
    q, k, _, _ = packed_qkv([5, 3])
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    cs = bib.rope_cos_sin_cache(4, 10000.0, 32, "cpu", torch.float64)  # R = 4 of D = 16
    rq, rk = bib.ref_rotary(q, k, pos, cs)
    alone = bib.ref_rotary(q[..., :4].contiguous(), k[..., :4].contiguous(), pos, cs)
    assert torch.equal(rq[..., :4], alone[0]) and torch.equal(rk[..., :4], alone[1])
    assert torch.equal(rq[..., 4:], q[..., 4:]) and torch.equal(rk[..., 4:], k[..., 4:])
    assert not torch.equal(rq[1:5, :, :4], q[1:5, :, :4])
    check(lambda q, k: CUSTOM.rotary(q, k, pos, cs), lambda q, k: REF.rotary(q, k, pos, cs),
          [q, k])


def test_gemma_rms_norm_backward_and_forward():
    """Qwen3.5's norms: y = x_hat (1 + w), the weight zero-centred; with a residual too."""
    x, r, w = torch.randn(7, 3, 32, **F64), torch.randn(7, 3, 32, **F64), torch.randn(32, **F64)
    y = bib.ref_gemma_rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, bib.ref_rms_norm(x, w + 1, 1e-6), atol=1e-15, rtol=0)
    check(lambda x, w: CUSTOM.gemma_rms_norm(x, w, 1e-6),
          lambda x, w: REF.gemma_rms_norm(x, w, 1e-6), [x, w])
    check(lambda *a: CUSTOM.gemma_add_rms_norm(*a, 1e-6),
          lambda *a: REF.gemma_add_rms_norm(*a, 1e-6), [x, r, w])


@pytest.mark.parametrize("gate_shape", [(6, 3, 16), (6, 1)])
def test_sigmoid_gate_mul_backward(gate_shape):
    """The attention output gate (one gate per output) and the shared expert's (one per token,
    broadcast over the row)."""
    o = torch.randn(6, 3, 16, **F64) if len(gate_shape) == 3 else torch.randn(6, 40, **F64)
    gate = torch.randn(gate_shape, **F64)
    torch.testing.assert_close(bib.ref_sigmoid_gate_mul(o, gate), o * torch.sigmoid(gate))
    check(CUSTOM.sigmoid_gate_mul, REF.sigmoid_gate_mul, [o, gate])


def test_rms_norm_gated_backward():
    x, z, w = torch.randn(9, 4, 16, **F64), torch.randn(9, 4, 16, **F64), torch.randn(16, **F64)
    check(lambda *a: CUSTOM.rms_norm_gated(*a, 1e-6), lambda *a: REF.rms_norm_gated(*a, 1e-6),
          [x, z, w])


def test_qwen35s_bf16_norms_and_gates_compute_in_fp32_and_round_once():
    """In bf16, as vLLM's kernels, the Gemma norm (with a residual too: s = x + r rounded to
    bf16 first), the gated norm and the sigmoid gate compute in fp32 and round once: every
    output within 2^-8 of the float64 value of its bf16 inputs (x 1.001 for the fp32 steps),
    the bound of one rounding to bf16; 1 + w, silu(z) or sigmoid(gate) rounded on the way
    ends up to twice that off."""
    g = torch.Generator().manual_seed(5)
    x, r, z, gate = (torch.randn(64, 4, 32, generator=g).bfloat16() for _ in range(4))
    w = (torch.randn(32, generator=g) / 8).bfloat16()  # zero-centred, as Gemma's

    def normed(t):  # float64 x_hat
        t = t.double()
        return t * (t.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()

    silu, sigmoid = torch.nn.functional.silu(z.double()), torch.sigmoid(gate.double())
    cases = {"gemma_rms_norm": (bib.ref_gemma_rms_norm(x, w, 1e-6), normed(x) * (1 + w.double())),
             "gemma_add_rms_norm": (bib.ref_gemma_add_rms_norm(x, r, w, 1e-6)[0],
                                    normed(x + r) * (1 + w.double())),
             "rms_norm_gated": (bib.ref_rms_norm_gated(x, z, w, 1e-6),
                                normed(x) * w.double() * silu),
             "sigmoid_gate_mul": (bib.ref_sigmoid_gate_mul(x, gate), x.double() * sigmoid)}
    for name, (got, want) in cases.items():
        assert got.dtype == torch.bfloat16, name
        assert ((got.double() - want).abs() <= 2**-8 * 1.001 * want.abs()).all(), name


def test_qwen3s_bf16_add_rms_norm_rounds_the_normed_value_then_scales():
    """In bf16, as vLLM's CUDA fused_add_rms_norm: s = x + r rounded to bf16, x_hat = s /
    rms(s) computed in fp32 and rounded to bf16, then times w in bf16 (a second rounding);
    against that computed from the float64 x_hat, all agree but the few whose fp32 x_hat
    rounds across a bf16 boundary from the float64 one (rounding x_hat w once instead leaves
    about a quarter of them one bf16 ulp off)."""
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(64, 4, 32, generator=g).bfloat16() for _ in range(2))
    w = (torch.rand(32, generator=g) + 0.5).bfloat16()
    y, s = bib.ref_add_rms_norm(x, r, w, 1e-6)
    assert s.dtype == y.dtype == torch.bfloat16
    assert torch.equal(s, (x.double() + r.double()).bfloat16())
    t = s.double()
    x_hat = t * (t.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    agree = (y == x_hat.bfloat16() * w).double().mean()
    assert agree > 0.99, agree


def test_rotary_is_a_rotation():
    q, k, _, _ = packed_qkv([6])
    cs = bib.rope_cos_sin_cache(16, 10000.0, 32, "cpu", torch.float64)
    rq, rk = bib.ref_rotary(q, k, torch.arange(6), cs)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # norms kept
    torch.testing.assert_close(rq[0], q[0])  # position 0 is the identity


def test_silu_and_mul_backward():
    check(CUSTOM.silu_and_mul, REF.silu_and_mul, [torch.randn(6, 40, **F64)])


def test_linear_backward():
    check(CUSTOM.linear, REF.linear, [torch.randn(6, 24, **F64), torch.randn(10, 24, **F64)])


def test_an_fp32_masters_gradient_of_bf16_compute_is_summed_in_fp32():
    """A bf16 forward on an fp32 master: dW = gy^T x in fp32 (the GEMM widened), not a bf16
    GEMM's output (rounded to bf16) cast up afterwards."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 24, generator=g).bfloat16()
    gy = torch.randn(512, 10, generator=g).bfloat16()
    w = torch.randn(10, 24, generator=g).requires_grad_()  # the fp32 master
    y = CUSTOM.linear(x, w)
    assert y.dtype == torch.bfloat16
    y.backward(gy)
    assert w.grad.dtype == torch.float32
    assert torch.equal(w.grad, gy.float().t() @ x.float())
    assert not torch.equal(w.grad, (gy.t() @ x).float())  # what a bf16 GEMM would give


@pytest.mark.parametrize("rows", [1024, 2])
def test_logprobs_entropy_backward(monkeypatch, rows):
    """Both outputs carry gradient: the sampled token's logprob and the entropy; computed whole,
    and in chunks of 2 rows (no (N, V) fp32 tensor alive)."""
    monkeypatch.setattr(bib, "LOGPROB_ROWS", rows)
    targets = torch.tensor([3, 0, 49, 7, 7])
    check(
        lambda z: CUSTOM.logprobs_entropy(z, targets, 0.7),
        lambda z: REF.logprobs_entropy(z, targets, 0.7),
        [torch.randn(5, 50, **F64) * 3],
    )
    z = torch.randn(5, 50) * 3
    whole = CUSTOM.logprobs_entropy(z, targets, 0.7)
    monkeypatch.setattr(bib, "LOGPROB_ROWS", 1)
    chunked = CUSTOM.logprobs_entropy(z, targets, 0.7)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))  # row-wise: the same bits


def test_add_rms_norm_backward_without_the_residual_gradient():
    x, r, w = torch.randn(4, 16, **F64), torch.randn(4, 16, **F64), torch.rand(16, **F64) + 0.5
    check(
        lambda *a: CUSTOM.add_rms_norm(*a, 1e-6)[0],
        lambda *a: REF.add_rms_norm(*a, 1e-6)[0],
        [x, r, w],
    )


@pytest.mark.parametrize("lens", [[7], [1, 9, 4], [16, 2, 11, 5]])
def test_attention_backward_varlen_gqa(lens):
    q, k, v, cu = packed_qkv(lens)
    L = max(lens)
    check(
        lambda q, k, v: CUSTOM.attention(q, k, v, cu, L, 0.25),
        lambda q, k, v: REF.attention(q, k, v, cu, L, 0.25),
        [q, k, v],
    )


def test_reference_attention_matches_sdpa_per_sequence():
    q, k, v, cu = packed_qkv([5, 12, 1], dtype=torch.float32)
    o, lse = bib.ref_attention(q, k, v, cu, 12, 16**-0.5)
    assert lse.shape == (4, 18)
    for b in range(3):
        s, e = int(cu[b]), int(cu[b + 1])
        want = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1),
            k[s:e].transpose(0, 1).repeat_interleave(2, 0),
            v[s:e].transpose(0, 1).repeat_interleave(2, 0),
            is_causal=True,
        ).transpose(0, 1)
        torch.testing.assert_close(o[s:e], want, atol=1e-5, rtol=1e-5)


TRITON_CHECK = """
import json, torch, batch_invariant_backward as bib
torch.manual_seed(0)
out = []
# head_dim 256 (Qwen3.5's gated attention) takes 32-row tiles
for lens, hq, hk, d in [([70, 1, 5, 130], 4, 2, 16), ([64, 128, 3], 4, 4, 16), ([9, 65], 8, 2, 16),
                        ([40, 33], 2, 1, 256)]:
    t, L = sum(lens), max(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, go = torch.randn(t, hq, d), torch.randn(t, hq, d)
    k, v = torch.randn(t, hk, d), torch.randn(t, hk, d)
    o, lse = bib.ref_attention(q, k, v, cu, L, 0.3)
    got = bib.attention_backward_tiled(q, k, v, o, lse, go, cu, L, 0.3)
    again = bib.attention_backward_tiled(q, k, v, o, lse, go, cu, L, 0.3)
    want = bib.attention_backward(*(x.double() for x in (q, k, v, o, lse, go)), cu, L, 0.3)
    err = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]
    out.append(dict(err=err, same=all(torch.equal(a, b) for a, b in zip(got, again))))
torch.manual_seed(1)
rel = lambda a, b: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
checks = {}
for d, rows in [(128, (37, 3)), (48, (5,)), (256, (70,))]:
    x, gy, gs = torch.randn(*rows, d), torch.randn(*rows, d), torch.randn(*rows, d)
    w = torch.rand(d) + 0.5
    for name, extra in [("", None), ("+gs", gs)]:
        got = bib.rms_norm_backward_triton(x, w, gy, 1e-6, extra)
        want = bib.rms_norm_backward(x, w, gy, 1e-6, extra)
        checks[f"rms_norm d={d}{name}"] = max(rel(a, b) for a, b in zip(got, want))
gq, gk = torch.randn(9, 4, 32), torch.randn(9, 2, 32)
pos = torch.tensor([0, 1, 2, 3, 0, 1, 5, 6, 7])
cs = bib.rope_cos_sin_cache(32, 10000.0, 16, "cpu", torch.float32)
got, want = bib.rotary_backward_triton(gq, gk, pos, cs), bib.rotary_backward(gq, gk, pos, cs)
checks["rotary"] = max(rel(a, b) for a, b in zip(got, want))
x, gy = torch.randn(7, 2 * 300), torch.randn(7, 300)
got, want = bib.silu_and_mul_backward_triton(x, gy), bib.silu_and_mul_backward(x, gy)
checks["silu_and_mul"] = rel(got, want)
x, tg = torch.randn(6, 5000) * 4, torch.tensor([0, 4999, 17, 17, 4096, 3])
got, want = bib.logprobs_entropy_triton(x, tg, 0.7), bib.ref_logprobs_entropy_stats(x, tg, 0.7)
checks["logprobs_entropy forward"] = max(rel(a, b) for a, b in zip(got, want))
g1, g2 = torch.randn(6), torch.randn(6)
checks["logprobs_entropy"] = rel(bib.logprobs_entropy_backward_triton(x, tg, *want[2:], want[1],
                                                                      g1, g2, 0.7),
                                 bib.logprobs_entropy_backward(x, tg, *want[2:], want[1], g1, g2,
                                                               0.7))
print(json.dumps(dict(attention=out, others=checks)))
"""


def test_triton_backwards_match_the_pytorch_ones():
    """The GPU backwards (Triton), run by Triton's CPU interpreter in fp32, against PyTorch's.

    Attention against the fp64 padded backward: a 1-token sequence, lengths on and off the
    64-row tile, GQA groups of 1, 2 and 4, head_dim 16 and 256 (32-row tiles). RMSNorm with and
    without the residual's gradient, at a hidden size that is not a power of two; rotary;
    SiluAndMul; logprob + entropy, forward (with the row statistics) and backward.
    """
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = json.loads(
        subprocess.run(
            [sys.executable, "-c", TRITON_CHECK],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()[-1]
    )
    assert len(out["attention"]) == 4
    for case in out["attention"]:
        assert max(case["err"]) < 1e-5, case  # fp32 tiles vs fp64
        assert case["same"]
    assert len(out["others"]) == 10
    for name, err in out["others"].items():
        assert err < 1e-5, (name, err)


def test_fused_add_rms_norm_rows_pads_small_calls_and_writes_through_views(monkeypatch):
    """The padding logic, with vLLM's in-place kernel played by the reference op: a call of
    fewer than 256 rows reaches the kernel as 256 rows, a larger one as itself, and the results
    land in the caller's tensors (here views of a larger batch)."""
    import types

    seen = []

    def kernel(x, residual, w, eps):  # in place, like vLLM's: residual <- x + r, x <- norm
        seen.append(x.shape[0])
        y, s = REF.add_rms_norm(x, residual, w, eps)
        residual.copy_(s)
        x.copy_(y)

    fake = types.ModuleType("vllm")
    fake._custom_ops = types.SimpleNamespace(fused_add_rms_norm=kernel)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    x, r, w = torch.randn(600, 8, **F64), torch.randn(600, 8, **F64), torch.rand(8, **F64) + 0.5
    want_y, want_s = REF.add_rms_norm(x, r, w, 1e-6)
    got_x, got_r = x.clone(), r.clone()
    for xs, rs in zip(got_x.split(300), got_r.split(300)):  # 300 + 300 rows
        bib.fused_add_rms_norm_rows(xs, rs, w, 1e-6)
    small_x, small_r = x[:7].clone(), r[:7].clone()
    bib.fused_add_rms_norm_rows(small_x, small_r, w, 1e-6)
    assert seen == [300, 300, bib.ADD_RMS_NORM_MIN_ROWS]
    assert torch.equal(got_x, want_y) and torch.equal(got_r, want_s)
    assert torch.equal(small_x, want_y[:7]) and torch.equal(small_r, want_s[:7])


def test_backward_is_deterministic():
    q, k, v, cu = packed_qkv([9, 4, 13], dtype=torch.float32)
    a = grads(lambda q, k, v: CUSTOM.attention(q, k, v, cu, 13, 0.25), [q, k, v])
    b = grads(lambda q, k, v: CUSTOM.attention(q, k, v, cu, 13, 0.25), [q, k, v])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- GPU


def _vllm_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    return bib.vllm_kernels()


@pytest.mark.gpu
def test_gpu_custom_backwards_match_reference_gradients():
    """vLLM forward + custom backward vs autograd through the reference ops, in bf16 on the GPU.

    Tolerance: both sides round to bf16 at different places, so gradients agree to about
    bf16 resolution (rtol 2e-2, atol 2e-2 on O(1) values).
    """
    vk = _vllm_or_skip()
    dev, bf = "cuda", torch.bfloat16
    q, k, v, cu = (
        t.to(dev) for t in packed_qkv([37, 5, 120], hq=4, hk=2, d=128, dtype=torch.float32)
    )
    q, k, v = q.to(bf), k.to(bf), v.to(bf)
    tol = dict(atol=2e-2, rtol=2e-2)
    cs = bib.rope_cos_sin_cache(128, 1e6, 64, dev, bf)
    for a, b in zip(
        grads(lambda q, k, v: vk.attention(q, k, v, cu, 120, 128**-0.5), [q, k, v]),
        grads(lambda q, k, v: REF.attention(q, k, v, cu, 120, 128**-0.5), [q, k, v]),
    ):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    x, r, w = (
        torch.randn(300, 512, device=dev, dtype=bf),
        torch.randn(300, 512, device=dev, dtype=bf),
        torch.rand(512, device=dev, dtype=bf) + 0.5,
    )
    # an fp32 master under bf16 compute: dW leaves the GEMM in fp32, without a bf16 rounding
    xs, master = torch.randn(300, 512, device=dev, dtype=bf), torch.randn(256, 512, device=dev)
    (_, dw), (_, dw_ref) = grads(vk.linear, [xs, master]), grads(REF.linear, [xs, master])
    gy = torch.randn(300, 256, generator=torch.Generator().manual_seed(1), dtype=bf)  # as grads
    exact = gy.double().t() @ xs.double().cpu()  # (256, 512)
    error = [(g.double().cpu() - exact).norm() / exact.norm() for g in (dw, dw_ref)]
    assert dw.dtype == torch.float32 and error[0] < error[1] / 10 and error[1] < 1e-2, error
    for a, b in zip(
        grads(lambda *t: vk.add_rms_norm(*t, 1e-6), [x, r, w]),
        grads(lambda *t: REF.add_rms_norm(*t, 1e-6), [x, r, w]),
    ):
        torch.testing.assert_close(a.float(), b.float(), atol=0.5, rtol=2e-2)  # dw sums 300 rows
    for fv, fr, ins in [
        (vk.silu_and_mul, REF.silu_and_mul, [torch.randn(64, 256, device=dev, dtype=bf)]),
        (
            vk.linear,
            REF.linear,
            [
                torch.randn(64, 256, device=dev, dtype=bf),
                torch.randn(128, 256, device=dev, dtype=bf),
            ],
        ),
        (
            lambda z: vk.logprobs_entropy(z, torch.arange(16, device=dev) * 7, 0.7),
            lambda z: REF.logprobs_entropy(z, torch.arange(16, device=dev) * 7, 0.7),
            [(torch.randn(16, 1000, device=dev) * 3).to(bf)],
        ),
        (
            lambda q, k: vk.rotary(q, k, torch.arange(64, device=dev), cs),
            lambda q, k: REF.rotary(q, k, torch.arange(64, device=dev), cs),
            [
                torch.randn(64, 4, 128, device=dev, dtype=bf),
                torch.randn(64, 2, 128, device=dev, dtype=bf),
            ],
        ),
        (
            lambda x, w: vk.rms_norm(x, w, 1e-6),
            lambda x, w: REF.rms_norm(x, w, 1e-6),
            [
                torch.randn(64, 4, 128, device=dev, dtype=bf),
                torch.rand(128, device=dev, dtype=bf) + 0.5,
            ],
        ),
    ]:
        for a, b in zip(grads(fv, ins), grads(fr, ins)):
            torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_backward_is_bitwise_deterministic():
    vk = _vllm_or_skip()
    q, k, v, cu = (
        t.to("cuda") for t in packed_qkv([200, 33, 90], hq=8, hk=2, d=128, dtype=torch.float32)
    )
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    run = lambda: grads(
        lambda q, k, v: vk.attention(q, k, v, cu, 200, 128**-0.5), [q, k, v]
    )  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(run(), run()))


@pytest.mark.gpu
def test_gpu_whole_model_backward_is_bitwise_deterministic(ckpt):
    """Two forward + backward passes of the vLLM-kernel model over one batch: equal gradients."""
    import simple_rl as rl

    vk = _vllm_or_skip()
    path = ckpt(tied=False)
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    model = rl.build_model(
        args,
        rl.hf_to_trainer(rl.load_hf_state_dict(path), args),
        vk,
        torch.bfloat16,
        torch.device("cuda"),
    )
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (3, 130, 47, 260)]
    p = rl.pack([s[:2] for s in seqs], [s[2:] for s in seqs]).to("cuda")

    def grads():
        model.zero_grad(set_to_none=True)
        lp, ent = model(p, 0.7)
        (lp.sum() + 0.01 * ent.sum()).backward()
        return [q.grad.clone() for q in model.parameters()]

    a, b = grads(), grads()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(x.abs().sum() > 0 for x in a)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, 2048, 2560])
def test_gpu_fused_add_rms_norm_rows_is_batch_invariant(d):
    """Every one of 4096 rows gets the same bits from the fused add+RMSNorm whether the rows come
    in calls of 1, 100, 255, 256, 257 or all 4096 (vLLM #48271: the kernel alone changes its
    reduction at 256 rows, and ~2% of rows then differ by an ulp)."""
    _vllm_or_skip()
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(4096, d, device="cuda", generator=g).bfloat16() * 4 for _ in range(2))
    w = torch.rand(d, device="cuda", generator=g).bfloat16() + 0.5
    full_x, full_r = x.clone(), r.clone()
    bib.fused_add_rms_norm_rows(full_x, full_r, w, 1e-6)
    assert not torch.equal(full_x, x)  # it did run, in place
    for n in (1, 100, 255, 256, 257):
        part_x, part_r = x.clone(), r.clone()
        for xs, rs in zip(part_x.split(n), part_r.split(n)):  # views: the kernel writes through
            bib.fused_add_rms_norm_rows(xs, rs, w, 1e-6)
        assert torch.equal(part_r, full_r), n  # the sums x + r
        assert torch.equal(part_x, full_x), n  # the normalised rows


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_logprobs_kernel_gives_vllms_sampler_bits(temperature):
    """Our logprob head against vLLM's sampler (its temperature kernel, then its logprob kernel)
    at Qwen3's vocabulary: lp[target] bit for bit on every one of 2048 rows, and the row
    statistics rebuild vLLM's lp of every token of 64 rows bit for bit (what the backward
    recomputes); the entropy and the logits' gradient agree with PyTorch's to fp32 rounding."""
    vk = _vllm_or_skip()
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    n, v = 2048, 151936
    scale = torch.rand(n, 1, device="cuda", generator=g) * 12  # near-uniform to very peaked rows
    x = (torch.randn(n, v, device="cuda", generator=g) * scale).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    lp_t, entropy, m, log_s = bib.logprobs_entropy_triton(x, targets, temperature)
    z = bib.sampler_logits(x, temperature)  # what vLLM's sampler hands its logprob kernel
    assert z.dtype == (torch.bfloat16 if temperature == 1.0 else torch.float32)
    assert torch.equal(lp_t, compute_token_logprobs(z, targets[:, None])[:, 0])
    every = torch.arange(v, device="cuda").expand(64, v)
    vllm_lp = compute_token_logprobs(z[:64], every)  # (64, V): vLLM's lp of every token
    assert torch.equal(z[:64].float() - m[:64, None] - log_s[:64, None], vllm_lp)
    if temperature != 1.0:  # Triton's division, within an ulp of PyTorch's
        torch.testing.assert_close(z, bib.tempered(x, temperature), rtol=2.4e-7, atol=0)
    lp = torch.log_softmax(z.float(), -1)
    torch.testing.assert_close(entropy, -(lp.exp() * lp).sum(-1), rtol=1e-5, atol=1e-4)
    del lp, vllm_lp
    g_lp, g_ent = torch.randn(2, n, device="cuda", generator=g)
    got = bib.logprobs_entropy_backward_triton(x, targets, m, log_s, entropy, g_lp, g_ent,
                                               temperature)
    want = bib.logprobs_entropy_backward(x, targets, m, log_s, entropy, g_lp, g_ent, temperature)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-6)
    assert torch.equal(got, bib.logprobs_entropy_backward_triton(x, targets, m, log_s, entropy,
                                                                 g_lp, g_ent, temperature))
    chunk = vk.logprobs_entropy(x[:1000], targets[:1000], temperature)  # through the Function
    assert torch.equal(chunk[0], lp_t[:1000]) and torch.equal(chunk[1], entropy[:1000])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tempered_bf16_logits_are_divided_in_fp32(temperature):
    """The reference kernels' tempered logits (--kernels reference, the CPU): bf16 logits
    divided in fp32 by an fp32 T, as vLLM's sampler divides them; a T held in bf16 would be
    0.6992 for 0.7. Their logprobs and entropy fp32, within 1e-5 of float64."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 64, generator=g) * 4).bfloat16()
    z = bib.tempered(x, temperature)
    assert z.dtype == torch.float32
    assert torch.equal(z, x.float() / torch.tensor(temperature, dtype=torch.float32))
    targets = torch.arange(8)
    lp, ent = bib.ref_logprobs_entropy(x, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    want = torch.log_softmax(x.double() / temperature, -1)
    torch.testing.assert_close(lp.double(), want[torch.arange(8), targets], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(want.exp() * want).sum(-1), rtol=0, atol=1e-5)
