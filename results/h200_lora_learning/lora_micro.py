"""Old vs new LoRA backward at Qwen3-1.7B's layer shapes: the code that wrote lora_micro.log.

Run from the repository root at f3f44ed, with the LoRA backward before it beside it as
.gpu/bib_old.py (`git show 3620ceb:batch_invariant_backward.py > .gpu/bib_old.py`):

    python results/h200_lora_learning/lora_micro.py 32768 > lora_micro.log

Per linear layer of a block (qkv, o, gate_up, down: rank 16, T tokens of random bf16), the
milliseconds of: the adapters' forward (vLLM's lora_shrink/expand, on a clone of y: the clone is
timed too), the old and the new LoRA backward (dA, dB, the adapters' share of dx), and the
base's forward, dx and fp32 dW GEMMs; whether the new backward repeats its bits, and its
largest relative difference from the old one (printed to 3 decimals: 0.0 is < 5e-4). The last
line multiplies the layer's sum by 28 layers x 3 micro-batches (98,304 trained tokens a step).
The script ran as it is here; only this docstring is new.
"""
import json, os, sys, time
os.environ["VLLM_BATCH_INVARIANT"] = "1"
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".gpu"))
import torch
from vllm.model_executor.layers.batch_invariant import init_batch_invariance
init_batch_invariance()
import batch_invariant_backward as bib
import bib_old

def timeit(f, n=10):
    f(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

res = {}
T, r = int(sys.argv[1]) if len(sys.argv) > 1 else 32768, 16
dev, bf = "cuda", torch.bfloat16
layers = {"qkv": (2048, (2048, 1024, 1024)), "o": (2048, (2048,)), "gate_up": (2048, (6144, 6144)),
          "down": (6144, (2048,))}
tot = {"old": 0.0, "new": 0.0, "fwd_lora": 0.0, "base_fwd": 0.0, "base_dx": 0.0, "base_dw": 0.0}
for name, (K, ns) in layers.items():
    x = torch.randn(T, K, device=dev, dtype=bf)
    a = [torch.randn(1, 1, r, K, device=dev, dtype=bf) * 0.02 for _ in ns]
    b = [torch.randn(1, 1, n, r, device=dev, dtype=bf) * 0.02 for n in ns]
    W = torch.randn(sum(ns), K, device=dev, dtype=bf) * 0.02
    y = x @ W.t()
    gy = torch.randn_like(y)
    u = bib.vllm_lora(x, y.clone(), a, b)
    row = dict(
        fwd_lora=timeit(lambda: bib.vllm_lora(x, y.clone(), a, b)),
        old=timeit(lambda: bib_old.lora_backward(x, u, a, b, gy, 2.0)),
        new=timeit(lambda: bib.lora_backward(x, u, a, b, gy, 2.0)),
        base_fwd=timeit(lambda: x @ W.t()), base_dx=timeit(lambda: gy @ W),
        base_dw=timeit(lambda: torch.mm(gy.t(), x, out_dtype=torch.float32)))
    o1 = bib.lora_backward(x, u, a, b, gy, 2.0); o2 = bib_old.lora_backward(x, u, a, b, gy, 2.0)
    o3 = bib.lora_backward(x, u, a, b, gy, 2.0)
    row["new_repeatable"] = all(torch.equal(p, q) for p, q in zip([o1[0], *o1[1], *o1[2]], [o3[0], *o3[1], *o3[2]]))
    row["max_rel_da"] = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(o1[1], o2[1]))
    row["max_rel_db"] = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(o1[2], o2[2]))
    res[name] = row
    for k in tot:
        tot[k] += row[k]
    print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
print("per layer (ms) at T =", T, json.dumps({k: round(v, 3) for k, v in tot.items()}))
print("28 layers x (32768-token micro-batches per step 3) ->", {k: round(v * 28 * 3 / 1e3, 3) for k, v in tot.items()}, "s")
