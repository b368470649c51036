"""Write a random Qwen3 checkpoint (+ tiny tokenizer) to a directory, e.g. the exact Qwen3-1.7B shape:

    python tests/make_checkpoint.py OUT --preset qwen3-1.7b --device cuda
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import make_checkpoint  # noqa: E402

PRESETS = {
    # published Qwen/Qwen3-1.7B config.json: 2048 hidden, 28 layers, 16 heads, 8 KV heads, head_dim 128, 6144 MLP
    "qwen3-1.7b": dict(tied=True, layers=28, vocab=151936, hidden=2048, heads=16, kv_heads=8, head_dim=128, inter=6144, max_pos=40960),
    "tiny": dict(tied=True, layers=2, vocab=384, hidden=256, heads=4, kv_heads=2, head_dim=128, inter=512),
}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    make_checkpoint(Path(a.out), **PRESETS[a.preset], dtype=torch.bfloat16, device=a.device, seed=a.seed)
    print(f"wrote {a.out}")
