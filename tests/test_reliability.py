"""Checkpoints, bit-exact resume, the NaN guard, Ctrl-C and run-directory safety (CPU stand-in engine)."""

import json
import signal
import sys
import time

import pytest
import torch

import simple_rl as rl
from helpers import TorchEngine

DEVICE = torch.device("cpu")


def config(path, tmp_path, **kw):
    base = dict(model=str(path), dtype="float32", num_prompts=2, group_size=3, max_new_tokens=5, max_model_len=128,
                micro_batch_tokens=128, lr=1e-2, entropy_coef=0.1, kl_coef=0.05, seed=3, log_dir=str(tmp_path / "runs"),
                save_every=2, keep_last=3)
    cfg = rl.Config(**{**base, **kw})
    rl.validate(cfg)
    return cfg


def run(cfg, engine=TorchEngine):
    tr, start, run_dir, source = rl.setup(cfg, engine_factory=engine, device=DEVICE)
    return rl.train(tr, start, run_dir, source), run_dir


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_resume_is_bit_exact(ckpt, tmp_path):
    path = ckpt()
    whole, whole_dir = run(config(path, tmp_path, steps=4, run_name="whole"))
    part, part_dir = run(config(path, tmp_path, steps=2, run_name="part"))
    assert part != whole
    saved = part_dir / "checkpoints" / "step_000002"
    assert {p.name for p in saved.iterdir()} == {"model", "trainer.pt", "run_config.json"}
    state = torch.load(saved / "trainer.pt", weights_only=False)
    assert state["next_step"] == 2 and state["data"] == {"task": "arithmetic", "seed": 3, "next_step": 2}
    assert state["sampler_seeds"] == [rl.sample_seed(rl.Config(seed=3), 2, i) for i in range(2)]
    assert state["config"]["lr"] == 1e-2 and state["optimizer"]["state"]
    resumed, resumed_dir = run(config(path, tmp_path, steps=4, resume=str(saved)))
    assert resumed_dir == part_dir
    assert resumed == whole  # same final weight sha256
    assert metrics(resumed_dir) == metrics(whole_dir)  # same per-step metrics, steps 0..3
    assert [m["step"] for m in metrics(resumed_dir)] == [0, 1, 2, 3]


def test_resume_latest_and_keep_last(ckpt, tmp_path):
    path = ckpt()
    run(config(path, tmp_path, steps=4, save_every=1, keep_last=2, run_name="r"))
    root = tmp_path / "runs" / "r" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]
    assert rl.find_checkpoint(config(path, tmp_path, resume="latest", run_name="r")) == root / "step_000004"
    assert rl.find_checkpoint(config(path, tmp_path, resume="latest")) == root / "step_000004"
    with pytest.raises(rl.ConfigError, match="not a checkpoint directory"):
        rl.find_checkpoint(config(path, tmp_path, resume=str(tmp_path)))
    with pytest.raises(rl.ConfigError, match="no checkpoint under"):
        rl.find_checkpoint(config(path, tmp_path, resume="latest", run_name="nothing"))


def test_crash_while_saving_keeps_the_previous_checkpoint(ckpt, tmp_path, monkeypatch):
    path = ckpt()
    cfg = config(path, tmp_path, steps=4, run_name="c")
    tr, start, run_dir, source = rl.setup(cfg, engine_factory=TorchEngine, device=DEVICE)
    real_save = torch.save
    calls = {"n": 0}

    def flaky(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", flaky)
    with pytest.raises(OSError):
        rl.train(tr, start, run_dir, source)
    done = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert done == ["step_000002"]
    assert torch.load(run_dir / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)["next_step"] == 2


class PoisonAtStep2(TorchEngine):
    """Turns one trainer weight into NaN before step 2's rollout (a stand-in for a blow-up)."""

    trainer_model = None

    def rollout(self, prompts, step):
        if step == 2:
            with torch.no_grad():
                self.trainer_model.norm.weight[0] = float("nan")
        return super().rollout(prompts, step)

    def push(self, model):
        type(self).trainer_model = model
        super().push(model)


def test_nan_guard_stops_before_the_optimizer_step(ckpt, tmp_path):
    cfg = config(ckpt(), tmp_path, steps=4, run_name="nan")
    tr, start, run_dir, source = rl.setup(cfg, engine_factory=PoisonAtStep2, device=DEVICE)
    with pytest.raises(rl.RunStopped) as err:
        rl.train(tr, start, run_dir, source)
    assert err.value.code == 3
    assert "step 2: non-finite logprobs; nothing was applied" in str(err.value) and "step_000002" in str(err.value)
    diag = json.loads((run_dir / "nonfinite_step_000002.json").read_text())
    assert diag["step"] == 2 and diag["quantity"] == "logprobs" and diag["prompts"] == [0, 1] and diag["samples"] == list(range(6))
    good = torch.load(run_dir / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)["model"]
    assert torch.equal(tr.model.layers[0].attention.wqkv.weight, good["layers.0.attention.wqkv.weight"])  # no step taken
    assert torch.isfinite(good["norm.weight"]).all()  # the last good checkpoint is untouched


class CtrlCAtStep1(TorchEngine):
    def rollout(self, prompts, step):
        if step == 1:
            signal.raise_signal(signal.SIGINT)
        return super().rollout(prompts, step)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_saves_a_checkpoint_and_closes_tensorboard(ckpt, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = ckpt()
    cfg = config(path, tmp_path, steps=4, save_every=0, run_name="int")
    tr, start, run_dir, source = rl.setup(cfg, engine_factory=CtrlCAtStep1, device=DEVICE)
    with pytest.raises(rl.RunStopped) as err:
        rl.train(tr, start, run_dir, source)
    assert err.value.code == 130 and "interrupted after step 1" in str(err.value)
    assert "Ctrl-C: finishing this step" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    ckpt_dir = run_dir / "checkpoints" / "step_000002"
    assert torch.load(ckpt_dir / "trainer.pt", weights_only=False)["next_step"] == 2
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [0, 1]  # flushed and closed
    resumed, _ = run(config(path, tmp_path, steps=4, resume=str(ckpt_dir)))
    whole, _ = run(config(path, tmp_path, steps=4, run_name="whole"))
    assert resumed == whole


def test_existing_run_dir_is_refused_and_untouched(ckpt, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "mine"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("precious")
    argv = ["--model", str(ckpt()), "--log-dir", str(tmp_path / "runs"), "--run-name", "mine"]
    assert rl.main(argv) == 2
    assert "already holds a run; pass --resume latest --run-name mine" in capsys.readouterr().err
    assert (run_dir / "notes.txt").read_text() == "precious"
    out = tmp_path / "final"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    assert rl.main(["--model", str(ckpt()), "--log-dir", str(tmp_path / "runs"), "--output-dir", str(out)]) == 2
    assert "is not empty; pick another or pass --overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_text() == "old"


def test_unset_env_is_set_and_said(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(rl.ConfigError, match="vLLM is not installed; run `pip install -r requirements.txt`"):
        rl.prepare_environment()
    assert "VLLM_BATCH_INVARIANT is not set; setting VLLM_BATCH_INVARIANT=1 before importing vLLM." in capsys.readouterr().out
    import os

    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"


def test_model_dir_without_weights_fails_before_anything_starts(ckpt, tmp_path, capsys):
    import shutil

    shutil.copytree(ckpt(), tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    assert rl.main(["--model", str(tmp_path / "m"), "--log-dir", str(tmp_path / "runs")]) == 2
    assert "has no *.safetensors weights" in capsys.readouterr().err


def test_resume_drops_what_was_logged_after_the_checkpoint(ckpt, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = ckpt()
    run(config(path, tmp_path, steps=3, run_name="x"))  # checkpoint at 2, but steps 0..2 logged
    time.sleep(1.1)  # TensorBoard orders event files by the second they were created in
    _, run_dir = run(config(path, tmp_path, steps=4, resume=str(tmp_path / "runs" / "x" / "checkpoints" / "step_000002")))
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2, 3]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2, 3]
