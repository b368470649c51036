import faulthandler
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT / "examples"))  # warm_start, envs: imported by name

import pytest  # noqa: E402


# A CPU test that hangs (a tool's thread, a loop whose count went wrong) ends the whole run with
# every thread's traceback after this long, not at CI's limit (the longest takes under 30 s).
# (pytest's own faulthandler_timeout would time the GPU tests too.)
CPU_TEST_LIMIT_S = 600
_stderr = None


def pytest_configure(config):
    global _stderr
    _stderr = os.fdopen(os.dup(2), "w")  # the terminal's, not the capture of a test's output


def pytest_unconfigure(config):
    _stderr.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A CPU test's setup, call and teardown under CPU_TEST_LIMIT_S."""
    if item.get_closest_marker("gpu") is not None:
        return (yield)
    pid = os.getpid()
    faulthandler.dump_traceback_later(CPU_TEST_LIMIT_S, exit=True, file=_stderr)
    try:
        return (yield)
    finally:
        if os.getpid() != pid:  # a child a test forked came back here: it must not go on
            os._exit(1)
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """Tiny random Qwen3 checkpoints (fp32, GQA, head_dim 128), built once per session. The
    default one is built here, before any test's body (a test that patches safetensors' writer
    or reads its stderr must not be the one that builds it)."""
    from helpers import make_checkpoint

    made = {}

    def get(tied=True, shard=None, layers=2, chat=False):
        key = (tied, shard, layers, chat)
        if key not in made:
            made[key] = make_checkpoint(
                tmp_path_factory.mktemp("ckpt"), tied=tied, shard=shard, layers=layers, chat=chat
            )
        return made[key]

    get()
    return get


@pytest.fixture(scope="session")
def q35(tmp_path_factory):
    """Tiny random Qwen3.5 checkpoints (make_qwen35_checkpoint's shape: 4 layers, 0-2 Gated
    DeltaNet and 3 full attention; 2 k heads of 16 dims, 4 v heads of 8; each head's dt_bias
    its own), built once per session for the keyword arguments given."""
    from helpers import make_qwen35_checkpoint

    made = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = make_qwen35_checkpoint(tmp_path_factory.mktemp("q35"),
                                               **{"random_dt_bias": True, **kw})
        return made[key]

    return get


@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory):
    """A 2-step CPU run with its checkpoint at step 2 (copy it before damaging it:
    helpers.copy_checkpoint)."""
    from helpers import cpu_argv, run_cpu

    tmp = tmp_path_factory.mktemp("saved")
    run_cpu(cpu_argv(ckpt(), tmp / "runs", steps=2, run_name="r"))
    return tmp / "runs" / "r" / "checkpoints" / "step_000002"


@pytest.fixture(scope="module")
def four(ckpt, tmp_path_factory):
    """A finished 4-step run: checkpoints at steps 2 and 4, and its final export (copy it before
    changing it: helpers.copy_run)."""
    from helpers import cpu_argv, run_cpu

    tmp = tmp_path_factory.mktemp("four")
    run_cpu(cpu_argv(ckpt(), tmp / "runs", steps=4, run_name="r"))
    return tmp / "runs" / "r"
