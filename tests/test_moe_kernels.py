"""The MoE ops (Kernels.moe_topk, Kernels.moe_experts) on CPU: the hand-written backwards against
autograd through the reference forwards (fp64), the math against a per-token loop, the dtype
contracts, and bitwise repeatability. The GPU side (vLLM's kernels) is test_moe_kernels_gpu.py.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import batch_invariant_backward as bib

F64 = dict(dtype=torch.float64)
CUSTOM = bib.custom_backward_kernels(bib.reference_forwards())
REF = bib.reference_kernels()


def moe_inputs(T=5, D=8, E=6, inter=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype)
    w13 = torch.randn(E, 2 * inter, D, generator=g, dtype=dtype) / D**0.5
    w2 = torch.randn(E, D, inter, generator=g, dtype=dtype) / inter**0.5
    return x, w13, w2


def grads_of(fn, inputs, seed=1):
    """Gradients of sum(out * fixed random weights) w.r.t. every input (all floating)."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), **F64)
    g = g.to(out.dtype)  # the same numbers whatever the dtype
    return out, torch.autograd.grad((out * g).sum(), inputs)


def assert_grads_close(custom_fn, ref_fn, inputs, **tol):
    (out_c, got), (out_r, want) = grads_of(custom_fn, inputs), grads_of(ref_fn, inputs)
    assert torch.equal(out_c, out_r)  # the same forward: only the backward differs
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **(tol or dict(atol=1e-10, rtol=1e-8)))


# --------------------------------------------------------------------------- router


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_topk_backward(renormalize):
    z = torch.randn(9, 16, **F64) * 2
    assert_grads_close(lambda z: CUSTOM.moe_topk(z, 4, renormalize)[0],
                       lambda z: REF.moe_topk(z, 4, renormalize)[0], [z])


def test_moe_topk_contract():
    z = torch.randn(11, 128).bfloat16()  # the gate's output dtype in a bf16 model
    for renormalize in (True, False):
        w, ids = CUSTOM.moe_topk(z, 8, renormalize)
        assert w.shape == ids.shape == (11, 8)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32
        assert (w[:, :-1] >= w[:, 1:]).all()  # descending, as topk_softmax writes them
        assert all(len(set(r.tolist())) == 8 for r in ids)  # k distinct experts per token
        p = torch.softmax(z.float(), -1)
        want = p.gather(-1, ids.long())
        if renormalize:
            want = want / want.sum(-1, keepdim=True)
            torch.testing.assert_close(w.sum(-1), torch.ones(11))
        torch.testing.assert_close(w, want)


def test_moe_topk_gradient_is_zero_off_the_chosen_experts_when_renormalised():
    z = torch.randn(4, 10, **F64, requires_grad=True)
    w, ids = CUSTOM.moe_topk(z, 3, True)
    (gz,) = torch.autograd.grad((w * torch.randn(4, 3, **F64)).sum(), z)
    off = torch.ones_like(gz, dtype=torch.bool).scatter(-1, ids.long(), False)
    assert (gz[off] == 0).all() and (gz[~off] != 0).all()
    torch.testing.assert_close(gz.sum(-1), torch.zeros(4, **F64))  # softmax: shift-invariant


# --------------------------------------------------------------------------- experts


def naive_moe(x, w13, w2, weights, ids):
    """Per token, per slot, with the gate rows first in w13 (HF gate_proj, then up_proj)."""
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


# ids: token 0 and 2 share experts, expert 4 appears for three tokens, experts 1 and 5 get none
IDS = torch.tensor([[0, 4], [3, 2], [4, 0], [2, 4], [3, 0]], dtype=torch.int32)


def test_moe_experts_reference_is_the_naive_sum():
    x, w13, w2 = moe_inputs()
    weights = torch.rand(5, 2, **F64)
    torch.testing.assert_close(REF.moe_experts(x, w13, w2, weights, IDS),
                               naive_moe(x, w13, w2, weights, IDS))


@pytest.mark.parametrize("T", [5, 1])
def test_moe_experts_backward(T):
    x, w13, w2 = moe_inputs()
    x, ids = x[:T], IDS[:T]
    weights = torch.rand(T, 2, **F64)
    assert_grads_close(lambda *a: CUSTOM.moe_experts(*a, ids),
                       lambda *a: REF.moe_experts(*a, ids), [x, w13, w2, weights])


def test_moe_experts_backward_experts_without_tokens_get_zero_gradient():
    x, w13, w2 = moe_inputs()
    _, (_, dw13, dw2, _) = grads_of(lambda *a: CUSTOM.moe_experts(*a, IDS),
                                    [x, w13, w2, torch.rand(5, 2, **F64)])
    for e in (1, 5):
        assert (dw13[e] == 0).all() and (dw2[e] == 0).all()
    assert (dw13[4] != 0).any()


def test_moe_experts_backward_many_tokens_and_k():
    """More tokens than experts, k = 4: several slots of one expert in a row."""
    x, w13, w2 = moe_inputs(T=40, D=16, E=8, inter=4)
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:4]
                       for t in range(40)]).int()
    assert_grads_close(lambda *a: CUSTOM.moe_experts(*a, ids),
                       lambda *a: REF.moe_experts(*a, ids),
                       [x, w13, w2, torch.rand(40, 4, **F64)])


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_block_backward_through_router_and_experts(renormalize):
    """Router and experts together, as the model calls them: gradients reach the logits (through
    the routing weights), x, w13 and w2."""
    x, w13, w2 = moe_inputs(T=7, E=6)
    z = torch.randn(7, 6, **F64)

    def block(kernels):
        def fn(z, x, w13, w2):
            w, ids = kernels.moe_topk(z, 2, renormalize)
            return kernels.moe_experts(x, w13, w2, w, ids)
        return fn

    assert_grads_close(block(CUSTOM), block(REF), [z, x, w13, w2])


def test_moe_experts_bf16_with_fp32_masters():
    """bf16 compute, fp32 master weights: out and dx in bf16, dw13/dw2 in fp32, dweights in fp32,
    all close to the exact (fp64) gradients; run twice, the same bits."""
    x, w13, w2 = moe_inputs(T=33, D=64, E=8, inter=16, dtype=torch.float32)
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:3]
                       for t in range(33)]).int()
    weights = torch.rand(33, 3)
    inputs = [x.bfloat16(), w13, w2, weights]
    out, got = grads_of(lambda *a: CUSTOM.moe_experts(*a, ids), inputs)
    assert out.dtype == torch.bfloat16 and out.shape == (33, 64)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32,
                                      torch.float32]
    _, exact = grads_of(lambda *a: REF.moe_experts(*a, ids), [t.double() for t in inputs])
    for a, b in zip(got, exact):
        err = (a.double() - b).norm() / b.norm()
        assert err < 2e-2, err.item()  # bf16 operands and roundings
    _, again = grads_of(lambda *a: CUSTOM.moe_experts(*a, ids), inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_moe_experts_backward_is_bitwise_repeatable():
    x, w13, w2 = moe_inputs(T=50, D=32, E=8, inter=8, dtype=torch.float32)
    z = torch.randn(50, 8)
    runs = []
    for _ in range(2):
        _, g = grads_of(lambda z, x, w13, w2: CUSTOM.moe_experts(
            x, w13, w2, *CUSTOM.moe_topk(z, 3, True)), [z, x, w13, w2])
        runs.append(g)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_moe_backward_functions_directly():
    """moe_experts_backward's own contract: dtypes of the masters, shapes of the inputs."""
    x, w13, w2 = moe_inputs(dtype=torch.float32)
    xb, w13b, w2b = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    dx, dw13, dw2, dw = bib.moe_experts_backward(xb, w13b, w2b, torch.rand(5, 2), IDS,
                                                 torch.randn(5, 8).bfloat16(),
                                                 torch.float32, torch.bfloat16)
    assert (dx.dtype, dw13.dtype, dw2.dtype, dw.dtype) == (
        torch.bfloat16, torch.float32, torch.bfloat16, torch.float32)
    assert dx.shape == x.shape and dw13.shape == w13.shape and dw2.shape == w2.shape
    assert dw.shape == (5, 2)


# --------------------------------------------------------------------------- kernel sets


def test_kernel_sets_have_the_moe_ops():
    names = {f.name for f in dataclasses.fields(bib.Kernels)}
    assert {"moe_topk", "moe_experts"} <= names
    for ks in (REF, CUSTOM, bib.reference_forwards()):
        assert callable(ks.moe_topk) and callable(ks.moe_experts)
    assert bib.TORCH_BACKWARDS["moe_experts"] is bib.moe_experts_backward
    assert bib.TRITON_BACKWARDS["moe_experts"] is bib.moe_experts_backward_grouped


def test_moe_experts_backward_uses_the_activations_the_bf16_forward_computed():
    """dweights_tj = <a_tj, W2[e]^T g_t> with a_tj = silu_and_mul(h_tj) exactly as the forward
    rounded it (silu to bf16, then the product to bf16): against an fp64 sum over those very
    bf16 activations, only the fp32 sum's rounding is left (an activation with one rounding
    fewer is off by bf16 ulps, ~1e-3)."""
    x, w13, w2 = (t.bfloat16() for t in moe_inputs(T=5, D=64, E=6, inter=32))
    weights = torch.rand(5, 2)
    gy = torch.randn(5, 64).bfloat16()
    _, _, _, dweights = bib.moe_experts_backward(x, w13, w2, weights, IDS, gy, torch.float32,
                                                 torch.float32)
    want = torch.empty(5, 2, **F64)
    for t in range(5):
        for j in range(2):
            e = int(IDS[t, j])
            a = bib.ref_silu_and_mul(F.linear(x[t:t + 1], w13[e]))[0]  # the forward's rounding
            want[t, j] = a.double() @ (w2[e].double().t() @ gy[t].double())
    torch.testing.assert_close(dweights.double(), want, atol=0, rtol=1e-5)


# --------------------------------------------------------------------------- grouped (Triton)


def test_expert_tiles_cover_each_experts_rows_once():
    """Experts of 0, 5, 32, 0 and 3 sorted rows in tiles of 16: one tile per started block,
    none for an empty expert; the grid's spare tiles (its upper bound) carry expert E."""
    bounds = torch.tensor([0, 0, 5, 37, 37, 40])
    tile_e, start, b = bib.expert_tiles(bounds, 40, 16)
    live = tile_e < 5
    assert tile_e[live].tolist() == [1, 2, 2, 4] and start[live].tolist() == [0, 5, 21, 37]
    assert len(tile_e) == 3 + 5 and (~live).sum() == 4 and torch.equal(b, bounds.int())


# Run by Triton's CPU interpreter (fp32; it computes bf16 dots wrongly): every case against the
# PyTorch loop over experts and the fp64 reference; tiles of 16 so that experts span several.
GROUPED_CHECK = r"""
import json, torch
import batch_invariant_backward as bib
from test_moe_kernels import moe_inputs, REF

bib.GROUPED_BLOCK.update(BM=16, BN=16, BK=16)
out = []
for case, (T, k, E) in {"uneven": (37, 3, 6), "one expert in every row": (40, 2, 5),
                        "one token": (1, 2, 4), "big tiles": (9, 2, 3)}.items():
    if case == "big tiles":
        bib.GROUPED_BLOCK.update(BM=128, BN=128, BK=64)
    g = torch.Generator().manual_seed(T)
    x, w13, w2 = moe_inputs(T=T, D=24, E=E, inter=10, dtype=torch.float32, seed=T)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)]).int()
    if case == "one expert in every row":
        ids[:, 0] = E - 1  # which the other slots never draw
    w, gy = torch.rand(T, k, generator=g), torch.randn(T, 24, generator=g)
    grouped = [bib.moe_experts_backward_grouped(x, w13, w2, w, ids, gy, torch.float32,
                                                torch.float32) for _ in range(2)]
    loop = bib.moe_experts_backward(x, w13, w2, w, ids, gy, torch.float32, torch.float32)
    x64, w1364, w264 = (t.double().requires_grad_() for t in (x, w13, w2))
    w64 = w.double().requires_grad_()
    y = REF.moe_experts(x64, w1364, w264, w64, ids)
    exact = torch.autograd.grad((y * gy.double()).sum(), [x64, w1364, w264, w64])
    out.append(dict(
        case=case, counts=torch.bincount(ids.flatten().long(), minlength=E).tolist(),
        vs_loop=[float((a - b).abs().max() / b.abs().max()) for a, b in zip(grouped[0], loop)],
        vs_fp64=[float((a.double() - b).norm() / b.norm()) for a, b in zip(grouped[0], exact)],
        loop_vs_fp64=[float((a.double() - b).norm() / b.norm()) for a, b in zip(loop, exact)],
        dtypes=[str(a.dtype) for a in grouped[0]],
        empty_zero=all(float(d[e].abs().max()) == 0 for d in grouped[0][1:3] for e in range(E)
                       if not (ids == e).any()),
        repeatable=all(torch.equal(a, b) for a, b in zip(*grouped))))
print(json.dumps(out))
"""


def test_grouped_experts_backward_matches_the_loop_on_uneven_loads():
    """The GPU's grouped backward (Triton, by its CPU interpreter) against the loop over experts
    and fp64: an expert without tokens (its gradients exactly 0), one expert in every row,
    a single token, tiles larger than everything; two calls give the same bits."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
    run = subprocess.run([sys.executable, "-c", GROUPED_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(run.stdout.splitlines()[-1])
    assert [c["case"] for c in cases] == ["uneven", "one expert in every row", "one token",
                                          "big tiles"]
    assert cases[0]["counts"][-1] == 0 and cases[1]["counts"][-1] == 40
    for c in cases:
        assert c["dtypes"] == ["torch.float32"] * 4, c
        assert max(c["vs_loop"]) < 1e-5 and max(c["vs_fp64"]) < 1e-5, c
        assert c["empty_zero"] and c["repeatable"], c
