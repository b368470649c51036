"""A checkpoint is data: a crafted pickle, a path out of the checkpoint or code the checkpoint
names is refused before anything of it runs or is opened; a damaged checkpoint is refused in one
sentence (exit 2); and what Python 3.10-3.13 or another stack wrote still loads."""

import enum
import io
import json
import os
import pathlib
import pickle
import random
import sys
from pathlib import Path

import pytest
import torch

import simple_rl as rl
from helpers import (copy_checkpoint, cpu_trainer_of_run, edit_json, latest, main_cpu,
                     metrics_rows, one_sentence, refuse)


# ---------------------------------------------------------------- a checkpoint is data


class Boom:
    """A pickle that runs code when loaded: writes a marker file."""

    marker = None

    def __reduce__(self):
        return (open, (str(Boom.marker), "w"))


def test_crafted_dcp_metadata_is_refused_and_runs_nothing(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    Boom.marker = tmp_path / "pwned"
    (ckpt / "trainer" / ".metadata").write_bytes(pickle.dumps(Boom()))
    err = one_sentence(capsys, main_cpu(["--resume", str(ckpt), "--steps", "3"]), 2,
                       last_line=True)
    assert "cannot be restored (" in err and "io.open is not allowed in a checkpoint" in err
    assert not Boom.marker.exists()


def test_crafted_rng_and_tensor_files_are_refused_and_run_nothing(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    Boom.marker = tmp_path / "pwned"
    torch.save({"torch": Boom()}, ckpt / "rng_rank0.pt")
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 2
    assert "cannot be restored" in capsys.readouterr().err and not Boom.marker.exists()
    ckpt = copy_checkpoint(saved, tmp_path / "b")
    shard = ckpt / "trainer" / "__0_0.distcp"
    torch.save(Boom(), shard)  # DCP reads tensors with torch.load: forced weights_only
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 2
    assert "cannot be restored" in capsys.readouterr().err and not Boom.marker.exists()


def test_real_checkpoints_load_with_the_data_only_readers(saved):
    with rl.data_only_loading():
        rng = torch.load(saved / "rng_rank0.pt", weights_only=True)
        meta = rl.CheckpointUnpickler(open(saved / "trainer" / ".metadata", "rb")).load()
    assert rng["torch"].dtype == torch.uint8 and len(meta.state_dict_metadata) > 10


@pytest.mark.parametrize("content", ["none", "code", "garbage", "truncated"])
def test_16_a_crafted_metadata_is_one_sentence_and_no_traceback(saved, tmp_path, capsys, caplog,
                                                               content):
    ckpt = copy_checkpoint(saved, tmp_path)
    file = ckpt / "trainer" / ".metadata"
    Boom.marker = tmp_path / "pwned"
    data = {"none": pickle.dumps(None), "code": pickle.dumps(Boom()),
            "garbage": b"\x80\x04not a pickle", "truncated": file.read_bytes()[:100]}[content]
    file.write_bytes(data)
    err = refuse(["--resume", str(ckpt), "--steps", "3"], capsys)
    assert f"{ckpt} cannot be restored (" in err
    assert not [r for r in caplog.records if r.exc_info]  # DCP logs its fallbacks' tracebacks
    assert not Boom.marker.exists()


class Getattr:
    """A pickle that asks builtins.getattr for `target`."""

    def __init__(self, *target):
        self.target = target

    def __reduce__(self):
        return getattr, self.target


@pytest.mark.parametrize("target", [
    (pathlib.PosixPath, "write_text"),  # an allowed class, but not an enum
    (rl.CheckpointUnpickler, "find_class"),
    ("TORCH_CONTIGUOUS_FORMAT", "upper"),
])
def test_10_getattr_fetches_enum_members_and_nothing_else(target):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as Encoding

    member = pickle.dumps(Getattr(Encoding, "TORCH_CHANNELS_LAST"))
    assert rl.CheckpointUnpickler(io.BytesIO(member)).load() is Encoding.TORCH_CHANNELS_LAST
    for bad in (Getattr(*target), Getattr(Encoding, "__class__"), Getattr(Encoding, "_missing_")):
        with pytest.raises(pickle.UnpicklingError, match="not allowed in a checkpoint"):
            rl.CheckpointUnpickler(io.BytesIO(pickle.dumps(bad))).load()


OPENED: list = []  # while not empty: every path opened since
OPENED_HOOK: list = []


def record_opens(event, args):
    if OPENED and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


@pytest.mark.parametrize("how", ["climbs out", "links out"])
def test_7_9_a_metadata_path_out_of_the_checkpoint_is_refused_before_it_is_opened(
        saved, tmp_path, capsys, how):
    ckpt = copy_checkpoint(saved, tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 4096)
    file = ckpt / "trainer" / ".metadata"
    meta = pickle.loads(file.read_bytes())  # the test's own file: a plain load is fine here
    if how == "climbs out":
        named = os.path.relpath(outside, ckpt / "trainer")
        for info in meta.storage_data.values():
            info.relative_path = named
        file.write_bytes(pickle.dumps(meta))
    else:  # the shard DCP would open is a link to a file elsewhere
        named = next(iter(meta.storage_data.values())).relative_path
        (ckpt / "trainer" / named).unlink()
        (ckpt / "trainer" / named).symlink_to(outside)
    OPENED.clear()
    if not OPENED_HOOK:
        sys.addaudithook(record_opens)  # for the process's life: it records only while asked
        OPENED_HOOK.append(True)
    OPENED.append(None)  # recording
    try:
        err = refuse(["--resume", str(ckpt), "--steps", "3"], capsys)
    finally:
        opened = OPENED[1:]
        OPENED.clear()
    assert f"{ckpt} cannot be restored (trainer/.metadata names '{named}', not a file of " \
           "trainer/)" in err
    assert not [p for p in opened if Path(p).name == "outside.bin"]


# ---------------------------------------------------------------- no code from a checkpoint


EVIL = ("from pathlib import Path\nPath({marker!r}).write_text('ran')\n"  # runs when imported
        "def f(c, a):\n    return 0.0\n")


@pytest.mark.parametrize("given", ["nothing", "mine", "mine, allowed"])
def test_1_a_checkpoints_reward_is_never_imported(saved, tmp_path, capsys, given):
    ckpt = copy_checkpoint(saved, tmp_path)
    marker = tmp_path / "pwned"
    (tmp_path / "evil.py").write_text(EVIL.format(marker=str(marker)))
    edit_json(ckpt / "run_config.json", reward=f"{tmp_path / 'evil.py'}:f")
    mine = tmp_path / "mine.py"
    mine.write_text("def f(completion, answer):\n    return 1.0\n")
    argv = latest(tmp_path)
    if given == "nothing":
        err = refuse(argv, capsys)
        assert "a resume imports no code its checkpoint names: pass --reward FILE.py:NAME " \
               "again." in err
    elif given == "mine":  # the run used another reward (none): a change, refused
        err = refuse(argv + ["--reward", f"{mine}:f"], capsys)
        assert f"{mine} is not what the run read when {ckpt} was saved" in err
        assert "pass --allow-changed-files to resume with it." in err
    else:
        assert main_cpu(argv + ["--reward", f"{mine}:f", "--allow-changed-files"]) == 0
        assert "resuming with it (--allow-changed-files)" in capsys.readouterr().out
        assert metrics_rows(ckpt.parent.parent)[-2]["reward_mean"] == 1.0  # mine ran
    assert not marker.exists()


def test_1_a_checkpoints_env_is_never_imported_even_with_its_sha256_recorded(saved, tmp_path,
                                                                           capsys):
    """The checkpoint names an env file and records that file's own sha256 (both files are the
    checkpoint's to craft): the resume is refused before anything is imported."""
    ckpt = copy_checkpoint(saved, tmp_path)
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL.format(marker=str(marker)))
    edit_json(ckpt / "run_config.json", env=f"{evil}:f")
    state = json.loads((ckpt / "state.json").read_text())
    state["inputs"]["env"] = {"f": rl.sha256_file(evil)}
    (ckpt / "state.json").write_text(json.dumps(state))
    err = refuse(latest(tmp_path), capsys)
    assert "a resume imports no code its checkpoint names: pass --env FILE.py:NAME again." in err
    assert not marker.exists()


# ---------------------------------------------------------------- a damaged checkpoint


def test_a_truncated_trainer_shard_is_one_sentence(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    shard = ckpt / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    err = one_sentence(capsys, main_cpu(["--resume", str(ckpt), "--steps", "3"]), 2,
                       last_line=True)
    assert f"{ckpt} cannot be restored" in err and "resume from an earlier checkpoint" in err


@pytest.mark.parametrize("rng", [
    {"torch": torch.zeros(7, dtype=torch.uint8), "python": random.getstate(), "cuda": []},
    {"x": 1},
    {"torch": torch.get_rng_state(), "python": (3, (1, 2), None), "cuda": []},
    {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": [1.5]},
])
def test_12_rng_states_of_the_wrong_shape_are_one_sentence(saved, tmp_path, capsys, rng):
    ckpt = copy_checkpoint(saved, tmp_path)
    torch.save(rng, ckpt / "rng_rank0.pt")
    err = refuse(["--resume", str(ckpt), "--steps", "3"], capsys)
    assert f"{ckpt} cannot be restored (rng_rank0.pt is damaged: " in err


@pytest.mark.parametrize("text,needle", [
    ("{oops", "run_config.json is damaged or from another version"),
    ('{"no_such_field": 1}', "run_config.json is damaged or from another version"),
    ('{"lr": -1.0}', "holds an invalid config: --lr must be > 0"),
])
def test_a_bad_run_config_is_refused(saved, tmp_path, capsys, text, needle):
    ckpt = copy_checkpoint(saved, tmp_path)
    if text.startswith('{"lr"'):
        config = json.loads((ckpt / "run_config.json").read_text())
        text = json.dumps(dict(config, lr=-1.0))
    (ckpt / "run_config.json").write_text(text)
    assert needle in one_sentence(capsys, main_cpu(["--resume", str(ckpt), "--steps", "3"]), 2,
                                  last_line=True)


def test_a_damaged_state_json_is_refused(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    (ckpt / "state.json").write_text('{"next_step": "two"}')
    assert "state.json is damaged" in one_sentence(
        capsys, main_cpu(["--resume", str(ckpt), "--steps", "3"]), 2, last_line=True)


# ---------------------------------------------------------------- other Pythons, other stacks


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "dcp_metadata"


@pytest.mark.parametrize("version", ["3.10.13", "3.11.2", "3.11.7", "3.12.1", "3.13.0"])
def test_10_dcp_metadata_written_by_each_python_loads(version):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    with (FIXTURES / f"py{version}.metadata").open("rb") as f:
        meta = rl.CheckpointUnpickler(f).load()
    assert isinstance(meta, Metadata) and meta.version == "1.0.0"
    weight = meta.state_dict_metadata["weight"]
    assert weight.properties.memory_format == torch.contiguous_format
    assert weight.properties.dtype == torch.float32 and weight.properties.layout == torch.strided
    assert weight.size == torch.Size([2, 3]) and weight.chunks[0].offsets == torch.Size([0, 0])
    assert isinstance(meta.state_dict_metadata["extra.epoch"], BytesStorageMetadata)
    assert sorted(s.length for s in meta.storage_data.values()) == [1261, 1577]
    assert meta.storage_meta.checkpoint_id == Path("/ckpt/trainer")


class Python3112Pickler(pickle.Pickler):
    """Pickles an enum member as Python 3.11.2 does: builtins.getattr(EnumClass, 'NAME')."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_10_a_checkpoint_whose_metadata_python_3_11_2_wrote_resumes(saved, tmp_path):
    ckpt = copy_checkpoint(saved, tmp_path)
    file = ckpt / "trainer" / ".metadata"
    meta = pickle.loads(file.read_bytes())  # the test's own file: a plain load is fine here
    buf = io.BytesIO()
    Python3112Pickler(buf).dump(meta)
    file.write_bytes(buf.getvalue())
    assert b"getattr" in file.read_bytes()
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 0


def test_a_checkpoint_of_another_stack_says_so_in_one_line_and_goes_on(saved, tmp_path, capsys):
    """Checkpoints record the versions whose kernels decide the samples; one written before they
    did (vLLM 0.26 / torch 2.11) resumes with one sentence: the weights go on, the samples not
    bit for bit."""
    ckpt = copy_checkpoint(saved, tmp_path)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["stack"] == rl.stack_versions() == {"torch": torch.__version__}  # no vLLM here
    assert rl.stack_change(state["stack"]) is None
    assert rl.stack_change({"vllm": "0.34.0", "torch": "2.14.0"}) == \
        f"vLLM 0.34.0 / torch 2.14.0 (now torch {torch.__version__})"
    del state["stack"]
    (ckpt / "state.json").write_text(json.dumps(state))
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "was made with" in line]
    assert said == [f"step_000002 was made with vLLM 0.26 / torch 2.11 (now torch "
                    f"{torch.__version__}): its weights and optimizer state go on exactly, its "
                    "samples will not continue bit for bit."]


def test_a_checkpoint_whose_sampler_seeds_differ_says_so_in_one_line_and_goes_on(saved, tmp_path,
                                                                                 capsys):
    """A checkpoint records the next step's sampler seeds; one whose seeds request_seed no
    longer gives (an earlier formula) resumes with one sentence, as another stack does."""
    ckpt = copy_checkpoint(saved, tmp_path)
    state = json.loads((ckpt / "state.json").read_text())
    run_cfg = rl.Config(**json.loads((ckpt / "run_config.json").read_text()))
    assert rl.samples_change(state, run_cfg) is None
    unrecorded = {k: v for k, v in state.items() if k != "sampler_seeds"}
    assert rl.samples_change(unrecorded, run_cfg) is None  # nothing to compare
    state["sampler_seeds"][1] += 1
    (ckpt / "state.json").write_text(json.dumps(state))
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "otherwise" in line]
    assert said == ["step_000002 seeded its samples otherwise (an earlier simple_rl's "
                    "request_seed): its weights and optimizer state go on exactly, its samples "
                    "will not continue bit for bit."]


def test_a_checkpoint_of_zero_steps_done_reads_as_whole(tmp_path):
    """A stop in the first step's tool or reward calls saves step_000000 (next_step 0): its
    state.json is valid, not 'damaged'."""
    ckpt = tmp_path / "step_000000"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"next_step": 0, "world_size": 1, "shapes": {}}))
    assert rl.read_checkpoint_state(ckpt)["next_step"] == 0
    (ckpt / "state.json").write_text(json.dumps({"next_step": -1, "world_size": 1, "shapes": {}}))
    with pytest.raises(rl.ConfigError, match="wrong field types"):
        rl.read_checkpoint_state(ckpt)


def test_cuda_rng_states_must_be_byte_tensors(tmp_path):
    """read_rng refuses a CUDA state that is a tensor of another dtype (a float tensor would
    reach torch.cuda.set_rng_state_all on a GPU resume)."""
    good = {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": [torch.zeros(16, dtype=torch.uint8)]}
    torch.save(good, tmp_path / "rng_rank0.pt")
    assert torch.equal(rl.read_rng(tmp_path, 0)["cuda"][0], good["cuda"][0])
    torch.save({**good, "cuda": [torch.zeros(16)]}, tmp_path / "rng_rank0.pt")
    with pytest.raises(rl.ConfigError, match="rng_rank0.pt is damaged: TypeError"):
        rl.read_rng(tmp_path, 0)


def test_a_save_removes_what_a_save_killed_mid_way_left(ckpt, tmp_path):
    """A kill inside remove_dir or replace_dir leaves checkpoints/.old_step_N; a kill while
    writing leaves .tmp_step_N. The next save removes both and keeps the complete ones."""
    trainer = cpu_trainer_of_run(ckpt(), tmp_path)
    run_dir = tmp_path / "r"
    root = run_dir / "checkpoints"
    for leftover in (".old_step_000002", ".tmp_step_000003"):
        (root / leftover / "trainer").mkdir(parents=True)
        (root / leftover / "trainer" / "__0_0.distcp").write_bytes(b"half")
    final = rl.save_checkpoint(run_dir, trainer, 4, ckpt())
    assert final == root / "step_000004" and rl.is_complete(final)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004"]
