"""The engine's linear layers on cuBLASLt give the bits of vLLM's Triton matmul (pytest -m gpu).

simple_rl routes vLLM's unquantized linear layers and LM head to `F.linear` (cuBLASLt, split-K
off by batch-invariant mode) instead of vLLM's Triton persistent matmul. That is only allowed if
every output row is bitwise what the Triton kernel gives, whatever the number of rows; a layer
of fewer than bib.NARROW_LINEAR output columns stays on the Triton kernel (on an H100 cuBLASLt's
one-column GEMM gave other rows at M = 239, 241-247, 249, 250, ...), so F.linear is only
reported there. This checks every decode batch size M = 1..1024, nine prefill sizes up to 8192
and six of the trainer's micro-batch sizes to 24576 (not for the LM head), at the linear shapes
of the dense Qwen3 models (q/k/v, o, gate/up, down, LM head), of Qwen3-30B-A3B (attention,
router), of Qwen3.5-0.8B, 4B, 9B, 27B and 35B-A3B (gated attention, the Gated DeltaNet's
projections, the MLP, the LM head; the router, the shared expert and its one-column gate) and of
the shards a TP = 2 engine's ranks hold for Qwen3-1.7B and 8B, against Triton calls of 8192
rows.
On vLLM 0.26 the Triton kernel's tiles did not depend on N, so a column slice of its GEMM had
the full GEMM's bits; 0.34 picks them by (N, K), so whether a shard's GEMM equals the full
GEMM's columns is a check of its own (docs/tensor_parallel.md).

cuBLASLt reads its workspace size once per process, so the check runs in a fresh process
(`python tests/test_gemm_gpu.py` prints its JSON) in which batch-invariant mode is set before
the first GEMM, as in simple_rl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")

VOCAB = 151936
# name: (hidden, q heads x 128, kv heads x 128, FFN) of the dense Qwen3 models
MODELS = {"0.6b": (1024, 2048, 1024, 3072), "1.7b": (2048, 2048, 1024, 6144),
          "4b": (2560, 4096, 1024, 9728), "8b": (4096, 4096, 1024, 12288),
          "14b": (5120, 5120, 1024, 17408), "32b": (5120, 8192, 1024, 25600)}
DECODE = range(1, 1025)
# Qwen3.5's (hidden, heads, kv heads, Gated DeltaNet v heads, FFN or 0 for the MoE; head dim
# 256, the rule's 128)
QWEN35 = {"0.8b": (1024, 8, 2, 16, 3584), "4b": (2560, 16, 4, 32, 9216),
          "9b": (4096, 16, 4, 32, 12288), "27b": (5120, 24, 4, 48, 17408),
          "35b-a3b": (2048, 16, 2, 32, 0)}
# prefill chunks (max_num_batched_tokens is 8192) and the trainer's micro-batches, whose sizes
# follow the samples' lengths (and a step's early stops): round ones and odd ones
PREFILL = [1031, 1500, 2047, 2048, 3001, 4096, 5000, 6143, 8192]
TRAIN = [9999, 12289, 16300, 16384, 20001, 24576]


def shapes() -> list[tuple[str, int, int, bool]]:
    """(name, N, K, every_m) of each linear layer; the LM head skips the trainer's sizes (its
    logits are 5-7 GB there, and the trainer's head sees the same K loop as at 8192 rows)."""
    out = []
    for m, (hidden, q, kv, ffn) in MODELS.items():
        out += [(f"{m}/qkv", q + 2 * kv, hidden, True), (f"{m}/o", hidden, q, True),
                (f"{m}/gate_up", 2 * ffn, hidden, True), (f"{m}/down", hidden, ffn, True)]
    out += [(f"{m}/lm_head", VOCAB, h, False) for m, (h, *_) in MODELS.items() if m != "32b"]
    out += [("30b-a3b/qkv", 4096 + 2 * 512, 2048, True), ("30b-a3b/o", 2048, 4096, True),
            ("30b-a3b/router", 128, 2048, True)]
    for m, (hidden, heads, kv, v, ffn) in QWEN35.items():  # gated attention: q and its gate
        out += [(f"q3.5-{m}/qkv", 2 * heads * 256 + 2 * kv * 256, hidden, True),
                (f"q3.5-{m}/o", hidden, heads * 256, True),
                (f"q3.5-{m}/qkvz", 2 * 16 * 128 + 2 * v * 128, hidden, True),
                (f"q3.5-{m}/ba", 2 * v, hidden, True), (f"q3.5-{m}/gdn_out", hidden, v * 128, True),
                (f"q3.5-{m}/lm_head", 248320, hidden, False)]
        out += [(f"q3.5-{m}/gate_up", 2 * ffn, hidden, True),
                (f"q3.5-{m}/down", hidden, ffn, True)] if ffn else []
    out += [("q3.5-35b-a3b/router", 256, 2048, True),  # and its shared expert, gated by a GEMV
            ("q3.5-35b-a3b/shared_gate", 1, 2048, True),
            ("q3.5-35b-a3b/shared_gate_up", 1024, 2048, True),
            ("q3.5-35b-a3b/shared_down", 2048, 512, True)]
    for m in ("1.7b", "8b"):  # a TP = 2 rank's shards: half the rows, or half of K
        hidden, q, kv, ffn = MODELS[m]
        out += [(f"{m}/tp2/qkv", (q + 2 * kv) // 2, hidden, True),
                (f"{m}/tp2/o", hidden, q // 2, True), (f"{m}/tp2/gate_up", ffn, hidden, True),
                (f"{m}/tp2/down", hidden, ffn // 2, True),
                (f"{m}/tp2/lm_head", VOCAB // 2, hidden, False)]
    assert len({name for name, *_ in out}) == len(out)
    return out


def check() -> dict:
    """For each shape: the row counts whose F.linear rows differ from the Triton kernel's, and
    those whose rows of the GEMM simple_rl runs there (bib.vllm_linear) do."""
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.determinism import batch_invariant as bi

    import batch_invariant_backward as bib

    bi.init_batch_invariance()  # before the first GEMM: split-K off, as in simple_rl
    g = torch.Generator(device="cuda").manual_seed(0)
    report = {}
    for name, n, k, every_m in shapes():
        rows = [*DECODE, *PREFILL, *(TRAIN if every_m else [])]
        x = torch.randn(max(rows), k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        chunk = 8192  # Triton rows are the same in any call (vLLM's invariance): fewer bytes
        want = torch.cat([bi.matmul_persistent(x[i:i + chunk], w.t())
                          for i in range(0, max(rows), chunk)])
        bad = [m for m in rows if not torch.equal(F.linear(x[:m], w), want[:m])]
        ours = bad if n >= bib.NARROW_LINEAR else [  # a narrow layer's GEMM is the Triton one
            m for m in rows if not torch.equal(bib.vllm_linear(x[:m], w), want[:m])]
        report[name] = {"n": n, "k": k, "rows_checked": len(rows), "differ_at": bad,
                        "ours_differ_at": ours}
        del x, w, want
    return report


@pytest.mark.gpu
def test_cublaslt_linear_equals_vllm_triton_matmul_at_every_row_count():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("simple_rl routes vLLM's linear layers to cuBLASLt on Hopper only")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          timeout=1200, env=dict(os.environ, VLLM_BATCH_INVARIANT="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == len(shapes())
    assert sum(r["rows_checked"] for r in report.values()) > 32000
    # a narrow layer runs the Triton kernel on both sides (bib.vllm_linear): F.linear's rows
    # there are reported (why), the GEMM simple_rl runs is asserted at every shape
    print("F.linear differs from vLLM's Triton matmul at row counts:",
          {k: r["differ_at"] for k, r in report.items() if r["differ_at"]})
    differ = {k: r["ours_differ_at"][:10] for k, r in report.items() if r["ours_differ_at"]}
    assert not differ, f"simple_rl's GEMM differs from vLLM's Triton matmul at rows: {differ}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(check()))
