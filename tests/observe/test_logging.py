"""ax.get_logger: one "axonhpc" logger, the rank on every line, INFO from rank 0 only by default."""
import logging
import os
import re
import subprocess
import sys

import pytest

import axonhpc as ax
from axonhpc.settings import Settings


@pytest.fixture
def log_settings():
    saved = (ax.settings.log_level, ax.settings.log_ranks)
    yield ax.settings
    ax.settings.log_level, ax.settings.log_ranks = saved


STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # every line carries its time


def _lines(text, *wanted):
    """The lines of ``text`` that contain any of ``wanted``, with their timestamps checked and taken out."""
    out = []
    for line in text.splitlines():
        if any(w in line for w in wanted):
            assert re.match(r"\[axonhpc rank \S+\] " + STAMP + " ", line), line
            out.append(re.sub(" " + STAMP, "", line, count=1))
    return out


def _speak(world):
    log = ax.get_logger("myapp")
    log.info("step done")
    log.warning("disk nearly full")
    log.debug("details")


def test_info_from_rank_0_warnings_from_every_rank(capsys, log_settings):
    ax.run_local(_speak, world_size=3)
    err = capsys.readouterr().err
    assert _lines(err, "step done") == ["[axonhpc rank 0/3] INFO axonhpc.myapp: step done"]
    warnings = sorted(_lines(err, "disk nearly full"))
    assert warnings == [f"[axonhpc rank {r}/3] WARNING axonhpc.myapp: disk nearly full" for r in range(3)]
    assert not _lines(err, "details")  # DEBUG is below the default level


def test_log_ranks_and_level_settings_apply_at_once(capsys, log_settings):
    log_settings.log_ranks = "all"
    log_settings.log_level = "DEBUG"
    ax.run_local(_speak, world_size=2)
    err = "\n".join(_lines(capsys.readouterr().err, "step done", "details"))
    for r in range(2):
        assert f"[axonhpc rank {r}/2] INFO axonhpc.myapp: step done" in err
        assert f"[axonhpc rank {r}/2] DEBUG axonhpc.myapp: details" in err
    log_settings.log_ranks = "1"
    log_settings.log_level = "WARNING"
    ax.run_local(_speak, world_size=2)
    err = capsys.readouterr().err
    assert "step done" not in err and err.count("disk nearly full") == 2


def test_logger_names_live_under_axonhpc():
    assert ax.get_logger().name == "axonhpc"
    assert ax.get_logger("axonhpc.trainer").name == "axonhpc.trainer"
    assert ax.get_logger("myapp").name == "axonhpc.myapp"
    assert logging.getLogger("axonhpc").propagate is False


def test_settings_parse_and_refuse():
    s = Settings().load_environment({"AXONHPC_LOG_LEVEL": "debug", "AXONHPC_LOG_RANKS": "0, 3"})
    assert (s.log_level, s.log_ranks) == ("DEBUG", "0,3")
    with pytest.raises(ValueError, match="AXONHPC_LOG_LEVEL='loud'"):
        Settings().load_environment({"AXONHPC_LOG_LEVEL": "loud"})
    with pytest.raises(ValueError, match="AXONHPC_LOG_RANKS='first'"):
        Settings().load_environment({"AXONHPC_LOG_RANKS": "first"})


@pytest.mark.timeout(120)
def test_under_mpiexec_each_line_carries_its_rank():
    code = ("import axonhpc as ax\nax.init()\nlog = ax.get_logger('job')\n"
            "log.info('hello')\nlog.warning('careful')\n")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _lines(out.stderr, "hello") == ["[axonhpc rank 0/2] INFO axonhpc.job: hello"]
    assert sorted(_lines(out.stderr, "careful")) == [
        "[axonhpc rank 0/2] WARNING axonhpc.job: careful", "[axonhpc rank 1/2] WARNING axonhpc.job: careful"]
