"""Faults mid-run: a disk that fills, turns read-only or fails a write exits 6 in one sentence,
the last checkpoint whole and no temporary directory left; a non-finite value stops the run
(exit 3) before it is applied or saved; out of GPU memory (the engine's start, a wake-up that
finds its memory taken) exits 5 in one sentence; a signal after the last step still saves that
step.
(Ctrl-C and SIGTERM mid-run, and the exact resume after them: test_resume.py.)"""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import simple_rl as rl
from helpers import (CountingEngine, TorchEngine, copy_checkpoint, cpu_argv, cpu_trainer_of_run,
                     exits, main_cpu, one_sentence, run_cpu)


FULL_DISK_DCP = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # as seen
FULL_DISK_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


# ---------------------------------------------------------------- a full disk


def test_a_save_that_fails_keeps_the_previous_checkpoint_and_no_temp_dir(ckpt, tmp_path,
                                                                        monkeypatch, capsys):
    from safetensors import torch as st

    real = st.save_file
    calls = {"n": 0}

    def full_disk(tensors, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint's model export
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(st, "save_file", full_disk)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=6, run_name="c"))
    err = capsys.readouterr().err.strip()
    assert code == 6 and err.startswith("simple_rl: no space left on the device holding ")
    assert "lower --keep-last" in err and "\n" not in err
    root = tmp_path / "runs" / "c" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no .tmp_step_000004
    assert rl.is_complete(root / "step_000002")
    monkeypatch.setattr(st, "save_file", real)
    assert run_cpu(["--resume", str(root / "step_000002"), "--steps", "3"])  # still resumable


def test_7_a_full_disk_in_dcp_save_exits_6(ckpt, tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    real_save = dcp.save
    root = tmp_path / "runs" / "c" / "checkpoints"

    def full_disk(state, storage_writer):
        if (root / "step_000002").exists():  # the second checkpoint: the disk is full now
            (root / ".tmp_step_000004" / "trainer").mkdir(parents=True, exist_ok=True)
            (root / ".tmp_step_000004" / "trainer" / "__0_0.distcp").write_bytes(b"PK partial")
            failure = RuntimeError(FULL_DISK_DCP)
            raise CheckpointException("CheckpointException ranks:dict_keys([0])",
                                      {0: (failure, [])})
        return real_save(state, storage_writer=storage_writer)

    monkeypatch.setattr(dcp, "save", full_disk)
    err = one_sentence(capsys, main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=6,
                                                 run_name="c")), 6)
    assert err.startswith(f"simple_rl: no space left on the device holding {root}")
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no temp dir left
    assert rl.is_complete(root / "step_000002")


def test_final_export_is_atomic(ckpt, tmp_path, monkeypatch, capsys):
    from safetensors import torch as st

    def fail(tensors, filename, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(st, "save_file", fail)
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=1, save_every=0,
                             run_name="f")) == 6
    run_dir = tmp_path / "runs" / "f"
    assert not (run_dir / "final").exists() and not (run_dir / ".tmp_final").exists()
    assert "no space left" in capsys.readouterr().err


def test_7_a_full_disk_in_the_final_export_exits_6(ckpt, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError
    from safetensors import torch as st

    real = st.save_file
    run_dir = tmp_path / "runs" / "f"

    def full_disk(tensors, filename, *a, **k):
        if (run_dir / "checkpoints" / "step_000002").exists():  # the export after the save
            Path(filename).write_bytes(b"partial")
            raise SafetensorError(FULL_DISK_SAFETENSORS)
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(st, "save_file", full_disk)
    err = one_sentence(capsys, main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2,
                                                 run_name="f")), 6)
    assert f"no space left on the device holding {run_dir / 'final'}" in err
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("events")) == [
        "checkpoints", "metrics.jsonl", "simple_rl.lock"]  # no final, no temp dir
    assert rl.is_complete(run_dir / "checkpoints" / "step_000002")


def test_8_a_full_output_dir_is_not_advised_to_lower_keep_last(ckpt, tmp_path, monkeypatch,
                                                               capsys):
    from safetensors import torch as st

    real = st.save_file
    out = tmp_path / "exports" / "out"

    def full(tensors, filename, *a, **k):
        if str(filename).startswith(str(out.parent)):
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(st, "save_file", full)
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=1, run_name="f", output_dir=out)
    err = exits(capsys, argv, 6)
    assert "no space left on the device holding" in err and "--keep-last" not in err
    assert "free space there, or point --output-dir at a larger disk." in err
    assert not out.exists() and not list(out.parent.glob(".tmp_*"))


def mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


class FillDiskAtStep1(TorchEngine):
    """Another program fills the disk while step 1's rollout runs."""

    disk: Path = None

    def first_turn(self, prompts, indices, step):
        if step == 1:
            with open(FillDiskAtStep1.disk / "filler", "wb", buffering=0) as f:
                with pytest.raises(OSError):
                    while True:
                        f.write(b"x" * 2**16)
        return super().first_turn(prompts, indices, step)


def test_3_a_real_disk_filled_mid_run_exits_6(ckpt, tmp_path, capsys):
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "96m"):
        pytest.skip("mounting a tmpfs needs root on Linux")
    try:
        FillDiskAtStep1.disk = disk
        err = exits(capsys, cpu_argv(ckpt(), disk / "runs", steps=3, run_name="t",
                                     save_every=1), 6, FillDiskAtStep1)
        assert f"no space left on the device holding {disk / 'runs' / 't'}" in err
        assert rl.is_complete(disk / "runs" / "t" / "checkpoints" / "step_000001")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---------------------------------------------------------------- a read-only disk


@pytest.mark.parametrize("code,words", [(errno.EROFS, "read-only file system"),
                                        (errno.EACCES, "no permission to write")])
def test_file_system_errors_are_one_sentence(tmp_path, code, words):
    stop = rl.disk_error(tmp_path / "x", OSError(code, os.strerror(code), str(tmp_path / "x")))
    assert stop.code == 6 and words in str(stop) and str(tmp_path / "x") in str(stop)


@pytest.mark.parametrize("code,words", [(errno.EROFS, "is on a read-only file system"),
                                        (errno.EACCES, "no permission to write")])
def test_8_checkpoints_turning_unwritable_mid_run_exit_6(ckpt, tmp_path, monkeypatch, capsys,
                                                         code, words):
    real_mkdir = Path.mkdir

    def unwritable(self, *a, **k):
        if self.name == ".tmp_step_000004":
            raise OSError(code, os.strerror(code), str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", unwritable)
    err = one_sentence(capsys, main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=6,
                                                 run_name="ro")), 6)
    root = tmp_path / "runs" / "ro" / "checkpoints"
    assert words in err and str(root / ".tmp_step_000004") in err
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
    assert rl.is_complete(root / "step_000002")


@pytest.mark.parametrize("where", ["tensorboard", "lock file"])
def test_9_resuming_on_a_read_only_log_dir_exits_6(saved, tmp_path, monkeypatch, capsys, where):
    ckpt = copy_checkpoint(saved, tmp_path)
    run_dir = tmp_path / "runs" / "r"

    def read_only(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    if where == "tensorboard":
        import torch.utils.tensorboard as tb

        monkeypatch.setattr(tb, "SummaryWriter", lambda log_dir, **k: read_only(log_dir))
    else:
        real_open = os.open

        def open_read_only(path, flags, *a, **k):
            if Path(path).name == "simple_rl.lock" and flags & os.O_CREAT:
                read_only(path)
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", open_read_only)
    err = one_sentence(capsys, main_cpu(["--resume", str(ckpt), "--steps", "3"]), 6)
    assert f"{run_dir}" in err and "is on a read-only file system" in err


def read_only(where) -> bool:
    """`where` made read-only: a read-only tmpfs as root (root writes through modes), else
    mode 0555."""
    where.mkdir()
    if os.geteuid() != 0:
        where.chmod(0o555)
        return True
    if sys.platform != "linux":
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


def test_8_a_read_only_output_dir_is_found_before_the_first_step(ckpt, tmp_path, capsys):
    frozen = tmp_path / "frozen"
    if not read_only(frozen):
        pytest.skip("no way to make a read-only directory here")
    try:
        capsys.readouterr()
        CountingEngine.made = 0
        argv = cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="ro",
                        output_dir=frozen / "out")
        err = one_sentence(capsys, main_cpu(argv, CountingEngine), 6)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(frozen)], check=False)
        else:
            frozen.chmod(0o755)
    assert str(frozen) in err and ("read-only" in err or "no permission" in err), err
    assert CountingEngine.made == 0 and not (tmp_path / "runs" / "ro" / "checkpoints").exists()


# ---------------------------------------------------------------- a write that fails


class FailingFile:
    """metrics.jsonl, failing at its n-th write or at close with a real OSError."""

    def __init__(self, file, code: int, at: str):
        self.file, self.code, self.at, self.name = file, code, at, file.name

    def fail(self):
        raise OSError(self.code, os.strerror(self.code), self.name)

    def write(self, text):
        if self.at == "write" and '"step": 1' in text:
            self.fail()
        return self.file.write(text)

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()
        if self.at == "close":
            self.fail()


WRITES = [("metrics write", errno.ENOSPC), ("metrics close", errno.EIO),
          ("tensorboard step", errno.EROFS), ("tensorboard eval", errno.EACCES),
          ("tensorboard flush", errno.ENOSPC), ("tensorboard close", errno.EIO)]
WORDS = {errno.ENOSPC: "no space left on the device holding", errno.EIO: "could not write",
         errno.EROFS: "is on a read-only file system", errno.EACCES: "no permission to write"}


@pytest.mark.parametrize("where,code", WRITES)
def test_3_a_write_failing_mid_run_exits_6(ckpt, tmp_path, monkeypatch, capsys, where, code):
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "runs" / "w"

    def fail(*a, **k):
        raise OSError(code, os.strerror(code), str(run_dir / "events.out.tfevents"))

    if where.startswith("metrics"):
        real_open = Path.open

        def open_failing(self, *a, **k):
            f = real_open(self, *a, **k)
            return FailingFile(f, code, where.split()[1]) if self.name == "metrics.jsonl" else f

        monkeypatch.setattr(Path, "open", open_failing)
    else:
        real = {n: getattr(SummaryWriter, n) for n in ("add_scalar", "flush", "close")}

        def add_scalar(self, tag, *a, **k):
            if (where == "tensorboard step" and tag == "loss") or \
                    (where == "tensorboard eval" and tag == "eval/accuracy" and a[1] > 0):
                fail()
            return real["add_scalar"](self, tag, *a, **k)

        monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
        if where in ("tensorboard flush", "tensorboard close"):
            name = where.split()[1]
            monkeypatch.setattr(SummaryWriter, name, lambda self: (real[name](self), fail()))
    err = exits(capsys, cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="w"), 6,
                TorchEngine)
    assert WORDS[code] in err and str(run_dir) in err


# ---------------------------------------------------------------- non-finite values


class PoisonAtStep2(TorchEngine):
    """Turns one trainer weight into NaN before step 2's rollout (a stand-in for a blow-up)."""

    trainer_model = None

    def first_turn(self, prompts, indices, step):
        if step == 2:
            with torch.no_grad():
                PoisonAtStep2.trainer_model.norm.weight[0] = float("nan")
        return super().first_turn(prompts, indices, step)


def test_nan_guard_stops_before_the_optimizer_step(ckpt, tmp_path, monkeypatch, capsys):
    real_build = rl.build_model

    def keep(*a, **k):
        model = real_build(*a, **k)
        PoisonAtStep2.trainer_model = PoisonAtStep2.trainer_model or model
        return model

    PoisonAtStep2.trainer_model = None
    monkeypatch.setattr(rl, "build_model", keep)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=4, run_name="nan"), PoisonAtStep2)
    err = capsys.readouterr().err
    assert code == 3
    assert "step 3/4: non-finite logprobs; nothing was applied" in err and "step_000002" in err
    run_dir = tmp_path / "runs" / "nan"
    diag = json.loads((run_dir / "nonfinite_step_000002.json").read_text())
    assert diag["step"] == 2 and diag["quantity"] == "logprobs" and diag["prompts"] == [0, 1]
    assert diag["samples"] == list(range(6)) and diag["optimizer_step"] == 0
    good = rl.read_checkpoint_state(run_dir / "checkpoints" / "step_000002")
    assert good["next_step"] == 2  # the last good checkpoint is untouched
    assert not (run_dir / "final").exists()


def test_a_non_finite_update_on_rank_1_names_that_ranks_prompts(ckpt, tmp_path, monkeypatch):
    """update_with_parity on rank 1 of 2 (its prompts 1 and 3 of the step, G = 3): packed
    sequences 1 and 4 that the NaN check names are episodes 1 and 4, of the step's prompts 1
    and 3, not the rank's own indices 0 and 1."""
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, eval_size=0)
    assert trainer.cfg.group_size == 3

    def fails(*args, **kwargs):
        raise rl.NonFiniteError("logprobs", [1, 4], 0, 1)

    monkeypatch.setattr(rl, "update", fails)
    rollout = rl.Rollout(prompts=[[1, 2]] * 6, completions=[[3]] * 6, generated=[[True]] * 6,
                         logprobs=torch.zeros(6), completed=[True] * 6, routed=None,
                         episodes=[])
    with pytest.raises(rl.NonFiniteError) as e:
        rl.update_with_parity(trainer, rollout, torch.zeros(6), mine=[1, 3])
    trainer.writer.close()
    assert (e.value.episodes, e.value.prompts) == ([1, 4], [1, 3])


def test_nan_at_the_second_update_says_what_was_applied(ckpt, tmp_path, monkeypatch, capsys):
    real_loss = rl.ppo_clip_loss
    calls = {"n": 0}

    def nan_on_second_update(logp, old, adv, eps):
        calls["n"] += 1
        pg, ratio, clipped = real_loss(logp, old, adv, eps)
        return (pg * float("nan") if calls["n"] == 2 else pg), ratio, clipped

    monkeypatch.setattr(rl, "ppo_clip_loss", nan_on_second_update)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2, updates_per_batch=2,
                             micro_batch_tokens=1024, run_name="u2"))  # one micro-batch each
    err = capsys.readouterr().err
    assert code == 3 and "step 1/2: non-finite loss" in err
    assert "1 of 2 optimizer steps of this step were applied in memory, none saved" in err


def test_non_finite_weights_after_the_step_are_caught_before_saving(ckpt, tmp_path, monkeypatch,
                                                                    capsys):
    real_step = torch.optim.AdamW.step

    def step_to_nan(self, *a, **k):  # an update that overflows, as a huge --lr would
        out = real_step(self, *a, **k)
        with torch.no_grad():
            self.param_groups[0]["params"][-1].fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_to_nan)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=3, save_every=1, run_name="big"))
    err = capsys.readouterr().err
    assert code == 3 and "step 1/3: non-finite weights after the optimizer step" in err
    assert "optimizer step 1 of 1 produced them; nothing was saved" in err
    assert not (tmp_path / "runs" / "big" / "checkpoints").exists()  # nothing non-finite saved


def test_non_finite_logprobs_name_the_sequences_that_hold_them_and_a_loss_names_all():
    """check_finite on one rank: NaN or Inf logprobs name the packed sequences whose tokens
    hold them (the episodes and prompts a user is told to look at), a non-finite loss or
    gradient norm names every sequence of the batch (any of them may have caused it), with
    the optimizer step it was found at. Naming every sequence for a bad logprob would send the
    user through the whole batch to find one bad sample."""
    nan, inf = float("nan"), float("inf")
    packed = SimpleNamespace(seq=torch.tensor([0, 0, 1, 1, 1, 2, 3, 3]))
    logps, fine = torch.zeros(8), torch.tensor(1.0)
    logps[3], logps[6] = nan, -inf
    with pytest.raises(rl.NonFiniteError) as e:
        rl.check_finite(logps, fine, fine, packed, 0, 1)
    assert e.value.quantity == "logprobs" and e.value.seqs == [1, 3]
    for loss, norm, quantity in ((nan, 1.0, "loss"), (1.0, inf, "gradient norm")):
        with pytest.raises(rl.NonFiniteError) as e:
            rl.check_finite(torch.zeros(8), torch.tensor(loss), torch.tensor(norm), packed, 1, 2)
        assert e.value.quantity == quantity and e.value.seqs == [0, 1, 2, 3]
        assert (e.value.optimizer_step, e.value.optimizer_steps) == (1, 2)
    rl.check_finite(torch.zeros(8), fine, fine, packed, 0, 1)  # all finite: nothing raised


# ---------------------------------------------------------------- a signal after the last step


class WakeFailsAtPush3(TorchEngine):
    """Its third push (step 2's) finds no room to wake in, as push_weights raises it."""

    def push(self, weights):
        self.pushes = getattr(self, "pushes", 0) + 1
        if self.pushes == 3:
            raise torch.OutOfMemoryError("waking vLLM's engine: CUDA Error: out of memory")
        return super().push(weights)


def test_out_of_memory_mid_run_exits_5_naming_the_last_good_checkpoint(ckpt, tmp_path, capsys):
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=4, save_every=1, run_name="m")
    capsys.readouterr()  # the checkpoint's making is not the run's
    err = one_sentence(capsys, main_cpu(argv, WakeFailsAtPush3), 5)
    good = tmp_path / "runs" / "m" / "checkpoints" / "step_000001"
    assert err.startswith("simple_rl: out of GPU memory in step 2/4 (estimate ")
    assert "for a GPU the run has to itself" in err and err.endswith(f"checkpoint: {good}.")


class NoRoomToStart(TorchEngine):
    """vLLM's start on a GPU that another process fills: its refusal, or PyTorch's error."""

    error: Exception = None

    def __init__(self, *a, **k):
        raise NoRoomToStart.error


@pytest.mark.parametrize("error,said", [
    (ValueError("Free memory on device cuda:0 (3.1/139.8 GiB) on startup is less than desired "
                "GPU memory utilization (0.12, 16.8 GiB). Decrease GPU memory utilization or "
                "reduce GPU memory used by other processes."), "Free memory on device cuda:0 "),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."),
     "CUDA out of memory. Tried to allocate 2.00 GiB."),
    (RuntimeError("CUDA error: out of memory"), "CUDA error: out of memory"),  # a CUDA call's
])
def test_out_of_memory_while_starting_exits_5_in_one_sentence(ckpt, tmp_path, capsys, error,
                                                              said):
    argv = cpu_argv(ckpt(), tmp_path / "runs", run_name="s")
    capsys.readouterr()
    NoRoomToStart.error = error
    err = one_sentence(capsys, main_cpu(argv, NoRoomToStart), 5)
    assert err.startswith(f"simple_rl: out of GPU memory while starting vLLM and the trainer "
                          f"({said}") and err.endswith(", or lower --micro-batch-tokens or "
                                                       "--kv-cache-gib."), err


def test_another_error_while_starting_is_not_called_out_of_memory(ckpt, tmp_path):
    for error in (ValueError("max_model_len is larger than the model's"),
                  RuntimeError("CUDA error: an illegal memory access was encountered")):
        NoRoomToStart.error = error
        with pytest.raises(type(error)) as raised:
            main_cpu(cpu_argv(ckpt(), tmp_path / "runs", run_name="s"), NoRoomToStart)
        assert raised.value is error


class SleepingEngine:
    """What push_weights reads of a VLLMEngine asleep, its wake-up raising `error`."""

    def __init__(self, error: Exception):
        self.asleep, self.wake_bytes, self.lora, self.error = True, 0, None, error
        self.llm = self

    def wake_up(self, tags):
        raise self.error


def test_an_engine_that_cannot_map_its_memory_back_is_out_of_memory(monkeypatch):
    """vLLM's sleep-mode allocator raises a plain RuntimeError when the GPU has no room left to
    wake in (another process took it): push_weights raises it as PyTorch's out-of-memory error,
    which stops the run with exit code 5; any other error passes unchanged."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine = SleepingEngine(RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:62"))
    with pytest.raises(torch.OutOfMemoryError, match="waking vLLM's engine: CUDA Error: out of"):
        rl.push_weights(engine, [])
    engine = SleepingEngine(RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:62"))
    with pytest.raises(RuntimeError) as other:
        rl.push_weights(engine, [])
    assert other.value is engine.error


class Signalled(Exception):
    """What the test's own handler raises when no handler of simple_rl's is installed."""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("during", ["last eval", "export"])
def test_5_a_signal_during_the_last_eval_or_export_saves_the_last_step(
        ckpt, tmp_path, monkeypatch, capsys, sig, during):
    def unhandled(*a):  # simple_rl's own handler must be the one called
        raise Signalled

    previous = {s: signal.signal(s, unhandled) for s in (signal.SIGTERM, signal.SIGINT)}

    class SignalAtLastEval(TorchEngine):
        evals = 0

        def generate(self, prompts, n, seeds, max_tokens, temperature):
            if temperature == 0:  # a held-out eval's (single-turn) episodes
                self.evals += 1
                if self.evals == 2:  # the second eval: after the last step
                    os.kill(os.getpid(), sig)
            return super().generate(prompts, n, seeds, max_tokens, temperature)

    real_save = rl.save_hf_checkpoint

    def signal_in_export(out, *a, **k):
        real_save(out, *a, **k)
        if out.name.startswith(".tmp_final"):
            os.kill(os.getpid(), sig)

    if during == "export":
        monkeypatch.setattr(rl, "save_hf_checkpoint", signal_in_export)
    run_dir = tmp_path / "runs" / "s"
    try:
        err = exits(capsys, cpu_argv(ckpt(), tmp_path / "runs", steps=1, run_name="s"),
                    143 if sig == signal.SIGTERM else 130,
                    SignalAtLastEval if during == "last eval" else TorchEngine)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    ckpt_dir = run_dir / "checkpoints" / "step_000001"
    assert f"checkpoint {ckpt_dir}; continue with --resume {ckpt_dir}" in err
    assert rl.is_complete(ckpt_dir)
    if during == "last eval":
        assert "before the final export" in err and not (run_dir / "final").exists()
    else:
        assert "after the final export" in err and rl.is_earlier_export(run_dir / "final")
    assert not list(run_dir.glob(".tmp_*"))


def test_sigterm_asks_to_stop_and_only_a_second_ctrl_c_aborts():
    """StopRequest's handlers: SIGTERM (a scheduler's stop) asks for a stop and leaves Ctrl-C
    asking too; the first Ctrl-C asks and arms the next one to abort at once
    (KeyboardInterrupt); leaving the block restores the handlers it found. A SIGTERM that armed
    the abort would turn the Ctrl-C that follows into a kill without a checkpoint, and a Ctrl-C
    that did not leave a user no way to end a hung step from the keyboard. So a
    KeyboardInterrupt a --reward call raises in the main thread (user_errors) is the reward's
    failure until a first Ctrl-C, SIGTERM or not; after one, it is the second, and aborts."""

    def a_rewards_keyboard_interrupt():
        with pytest.raises((KeyboardInterrupt, rl.RewardError)) as e:
            with rl.user_errors(3, "the completion"):
                raise KeyboardInterrupt
        return e.value

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with rl.StopRequest() as stop:
        assert rl.StopRequest.asked() == 0
        failed = a_rewards_keyboard_interrupt()
        assert isinstance(failed, rl.RewardError) and failed.sample == 3
        assert str(failed) == "raised KeyboardInterrupt"
        stop.handle(signal.SIGTERM, None)
        assert rl.StopRequest.asked() == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) == stop.handle  # still asks, does not abort
        assert isinstance(a_rewards_keyboard_interrupt(), rl.RewardError)
        stop.handle(signal.SIGINT, None)
        assert rl.StopRequest.asked() == signal.SIGINT
        assert type(a_rewards_keyboard_interrupt()) is KeyboardInterrupt
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == stop.handle
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert rl.StopRequest.asked() == 0


def test_a_fault_in_the_eval_after_the_last_step_is_named_so_not_a_step_past_the_last():
    """step_label numbers a step as the console does (0-based step 3 of 4 is 'step 4/4'); a
    fault in the held-out eval after the last step (step == --steps) is in 'the eval after
    step 4', not in a 'step 5/4' that never ran."""
    assert [rl.step_label(s, 4) for s in (0, 3, 4)] == ["step 1/4", "step 4/4",
                                                         "the eval after step 4"]
