"""Write a random Qwen3 checkpoint (+ tiny tokenizer) to a directory, e.g. the exact
Qwen3-1.7B shape:

    python tests/make_checkpoint.py OUT --preset qwen3-1.7b --device cuda
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import make_checkpoint  # noqa: E402

# Published Qwen/Qwen3-* config.json shapes (head_dim 128, GQA, vocab 151936, 40960 positions).
QWEN3 = dict(vocab=151936, head_dim=128, max_pos=40960)
PRESETS = {
    "qwen3-0.6b": dict(QWEN3, tied=True, layers=28, hidden=1024, heads=16, kv_heads=8, inter=3072),
    "qwen3-1.7b": dict(QWEN3, tied=True, layers=28, hidden=2048, heads=16, kv_heads=8, inter=6144),
    "qwen3-4b": dict(QWEN3, tied=True, layers=36, hidden=2560, heads=32, kv_heads=8, inter=9728),
    "qwen3-8b": dict(QWEN3, tied=False, layers=36, hidden=4096, heads=32, kv_heads=8, inter=12288),
    "qwen3-14b": dict(QWEN3, tied=False, layers=40, hidden=5120, heads=40, kv_heads=8,
                      inter=17408),
    "qwen3-32b": dict(QWEN3, tied=False, layers=64, hidden=5120, heads=64, kv_heads=8,
                      inter=25600),
    "tiny": dict(
        tied=True, layers=2, vocab=384, hidden=256, heads=4, kv_heads=2, head_dim=128, inter=512
    ),
}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="the preset's layers cut to this many")
    a = p.parse_args()
    shape = {**PRESETS[a.preset], **({"layers": a.layers} if a.layers else {})}
    from transformers.utils import logging

    logging.disable_progress_bar()  # its bars, off a terminal, are lines of carriage returns
    print(f"making a random {a.preset} ({shape['layers']} layers, bf16) on {a.device} and "
          f"saving it to {a.out} with a tokenizer (a 1.7B on CPU: about 30 s)", flush=True)
    make_checkpoint(Path(a.out), **shape, dtype=torch.bfloat16, device=a.device, seed=a.seed)
    print(f"wrote {a.out}")
