"""The settings object and the launcher variables it reads."""
import os
import subprocess
import sys

import pytest

from axonhpc.errors import AxonError, ConfigurationError
from axonhpc.settings import BACKENDS, MPI_INT_MAX, Settings, launcher_env


def test_defaults():
    s = Settings()
    # abort_on_exception is on by default: an uncaught exception on one rank of an MPI world ends the job
    assert (s.debug, s.timeout, s.abort_on_exception, s.backend) == (False, None, True, "auto")
    assert s.max_message_elements == MPI_INT_MAX == 2**31 - 1


def test_environment_fills_fields():
    s = Settings().load_environment({
        "AXONHPC_DEBUG": "1", "AXONHPC_TIMEOUT": "2.5", "AXONHPC_ABORT_ON_EXCEPTION": "yes",
        "AXONHPC_FAULT_TOLERANT": "on", "AXONHPC_BACKEND": "MPI", "AXONHPC_MAX_MESSAGE_ELEMENTS": "1024", "AXONHPC_ALLREDUCE_ALGORITHM": "Hierarchical",
        "UNRELATED": "x",
    })
    assert s.as_dict() == {"debug": True, "timeout": 2.5, "abort_on_exception": True, "fault_tolerant": True,
                           "backend": "mpi",
                           "max_message_elements": 1024, "allreduce_algorithm": "hierarchical",
                           "stall_report": 30.0, "flight_recorder": 256, "straggler_every": 1000,
                           "straggler_margin": 0.001, "flight_dir": "axonhpc-flight",
                           "flight_signal": "SIGUSR1", "skip_nonfinite_steps": False, "cuda_aware_mpi": "auto",
                           "staging_chunk_bytes": 4194304,
                           "timeline_dir": "", "log_level": "INFO", "log_ranks": "0",
                           "shm_collectives": "auto", "shm_min_bytes": 0, "shm_allgather_max_bytes": 262144,
                           "shm_slot_bytes": 262144,
                           "shm_slots": 4, "deterministic": False, "bucket_size_mb": "auto",
                          "check_collectives": True, "allow_tf32": False,
                          "fused_kernels": True, "size_thread_pools": True,
                          "stall_timeout": 600.0, "watchdog": True}


def test_revision_counts_every_assignment():
    """The hot paths cache what they derive from the settings, keyed on this one number."""
    s = Settings()
    first = s.revision
    s.timeout = 3.0
    s.shm_collectives = "off"
    assert s.revision == first + 2
    s.load_environment({"AXONHPC_DEBUG": "1"})
    assert s.revision == first + 3 and "revision" not in s.as_dict()


@pytest.mark.parametrize("text", ["0", "off", "none", ""])
def test_timeout_off(text):
    assert Settings().load_environment({"AXONHPC_TIMEOUT": text}).timeout is None


@pytest.mark.parametrize("var,value,match", [
    ("AXONHPC_DEBUG", "maybe", "AXONHPC_DEBUG='maybe' is not a boolean"),
    ("AXONHPC_TIMEOUT", "-3", "AXONHPC_TIMEOUT='-3' must be a positive"),
    ("AXONHPC_TIMEOUT", "abc", "AXONHPC_TIMEOUT='abc' is not a number: it must be a positive number of seconds"),
    ("AXONHPC_TIMEOUT", "nan", "AXONHPC_TIMEOUT='nan' must be a positive number of seconds"),
    ("AXONHPC_MAX_MESSAGE_ELEMENTS", "0", "AXONHPC_MAX_MESSAGE_ELEMENTS='0' must be a positive integer"),
    ("AXONHPC_MAX_MESSAGE_ELEMENTS", "1e3", "AXONHPC_MAX_MESSAGE_ELEMENTS='1e3' is not a number"),
    ("AXONHPC_FLIGHT_RECORDER", "lots", "AXONHPC_FLIGHT_RECORDER='lots' is not a number"),
    ("AXONHPC_STALL_REPORT", "soon", "AXONHPC_STALL_REPORT='soon' is not a number"),
    ("AXONHPC_SHM_SLOT_BYTES", "4k", "AXONHPC_SHM_SLOT_BYTES='4k' is not a number"),
    ("AXONHPC_BACKEND", "gloo", "AXONHPC_BACKEND='gloo' must be one of auto, mpi, nccl, local"),
])
def test_bad_values_name_the_variable(var, value, match):
    with pytest.raises(ConfigurationError, match=match) as info:
        Settings().load_environment({var: value})
    assert isinstance(info.value, ValueError) and isinstance(info.value, AxonError)


def test_every_bad_variable_is_named_at_once_and_nothing_changes():
    s = Settings()
    with pytest.raises(ConfigurationError) as info:
        s.load_environment({"AXONHPC_TIMEOUT": "abc", "AXONHPC_BACKEND": "gloo", "AXONHPC_DEBUG": "1"})
    text = str(info.value)
    assert "AXONHPC_TIMEOUT='abc'" in text and "AXONHPC_BACKEND='gloo'" in text
    assert (s.timeout, s.backend, s.debug) == (None, "auto", False)  # all or nothing


def test_zero_timeout_in_any_spelling_means_none():
    assert Settings().load_environment({"AXONHPC_TIMEOUT": "0.0"}).timeout is None


def test_abort_on_exception_opt_out():
    assert Settings().load_environment({"AXONHPC_ABORT_ON_EXCEPTION": "0"}).abort_on_exception is False


@pytest.mark.parametrize("var,value", [("AXONHPC_TIMEOUT", "abc"), ("AXONHPC_BACKEND", "gloo")])
def test_a_bad_variable_stops_import_with_its_name_and_value(var, value):
    """Decided: ``import axonhpc`` fails (every later use would otherwise run on a silent default)."""
    env = dict(os.environ, **{var: value})
    out = subprocess.run([sys.executable, "-c", "import axonhpc"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("axonhpc.errors.ConfigurationError: ") and f"{var}={value!r}" in last, out.stderr


def test_backend_set_by_assignment_is_named_by_init():
    import axonhpc as ax
    from axonhpc.groups import runtime

    saved = runtime._global_world
    runtime._global_world = None
    try:
        # The assignment itself is refused now, as AXONHPC_BACKEND=gloo is (init named it only later)
        with pytest.raises(ConfigurationError, match=r"ax.settings.backend='gloo' must be one of auto, mpi, nccl, "
                                                     r"local \(AXONHPC_BACKEND takes the same\)"):
            ax.settings.backend = "gloo"
        assert ax.settings.backend in BACKENDS
        with pytest.raises(ConfigurationError, match=r"unknown backend 'tcp' from init\(backend=...\)"):
            ax.init(backend="tcp")
    finally:
        runtime._global_world = saved
    assert BACKENDS == ("auto", "mpi", "nccl", "local")


def test_launcher_env_slurm_wins():
    env = launcher_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                        "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "42", "PMI_RANK": "0", "PMI_SIZE": "1"})
    assert (env.source, env.rank, env.size, env.local_rank, env.node_rank, env.num_nodes, env.slurm_job_id) == \
        ("slurm", 3, 8, 1, 1, 2, "42")


def test_launcher_env_openmpi_and_pmi():
    ompi = launcher_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (ompi.source, ompi.rank, ompi.size, ompi.local_rank) == ("openmpi", 2, 4, 0)
    pmi = launcher_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (pmi.source, pmi.rank, pmi.size) == ("pmi", 1, 2)
    none = launcher_env({})
    assert none.source is None and none.size is None


def test_bucket_size_and_deterministic_settings():
    s = Settings().load_environment({"AXONHPC_BUCKET_SIZE_MB": "Auto", "AXONHPC_DETERMINISTIC": "1"})
    assert (s.bucket_size_mb, s.deterministic) == ("auto", True)
    assert Settings().load_environment({"AXONHPC_BUCKET_SIZE_MB": "12.5"}).bucket_size_mb == "12.5"
    with pytest.raises(ValueError, match="AXONHPC_BUCKET_SIZE_MB='-1' must be 'auto' or a positive number"):
        Settings().load_environment({"AXONHPC_BUCKET_SIZE_MB": "-1"})


def test_collective_checks_and_slot_count_settings():
    s = Settings().load_environment({"AXONHPC_CHECK_COLLECTIVES": "0", "AXONHPC_SHM_SLOTS": "63"})
    assert (s.check_collectives, s.shm_slots) == (False, 63)
    # The engine keeps one call descriptor per slot in a 4 KiB control block: 63 at most.
    with pytest.raises(ConfigurationError, match="AXONHPC_SHM_SLOTS='64' must be an integer from 1 to 63"):
        Settings().load_environment({"AXONHPC_SHM_SLOTS": "64"})


@pytest.mark.parametrize("field,value,match", [
    ("timeout", -1, "ax.settings.timeout=-1 must be a positive number of seconds"),
    ("timeout", float("nan"), "ax.settings.timeout=nan must be a positive number of seconds"),
    ("timeout", "x", "ax.settings.timeout='x' is not a number"),
    ("timeout", float("inf"), "ax.settings.timeout=inf must be a positive number of seconds"),
    ("stall_timeout", -5, "ax.settings.stall_timeout=-5 must be a positive number of seconds"),
    ("stall_report", 0, "ax.settings.stall_report=0 must be a positive number of seconds"),
    ("debug", "maybe", "ax.settings.debug='maybe' is not a boolean"),
    ("debug", 2, "ax.settings.debug=2 is not a boolean"),
    ("allreduce_algorithm", "bogus", "ax.settings.allreduce_algorithm='bogus' must be one of native, hierarchical"),
    ("max_message_elements", 0, "ax.settings.max_message_elements=0 must be a positive integer"),
    ("shm_collectives", "sometimes", "ax.settings.shm_collectives='sometimes' must be one of auto, off"),
])
def test_an_assignment_is_checked_as_its_variable_is(field, value, match):
    """One rule for both: assigning a field takes what its AXONHPC_* variable takes, and refuses the rest, naming
    the field, the value and the variable; the field keeps its value."""
    s = Settings()
    before = getattr(s, field)
    with pytest.raises(ConfigurationError, match=match) as info:
        setattr(s, field, value)
    assert f"(AXONHPC_{field.upper()} takes the same)" in str(info.value)
    assert getattr(s, field) == before


@pytest.mark.parametrize("field,value,want", [
    ("timeout", 0, None), ("timeout", None, None), ("timeout", "off", None), ("timeout", 3, 3.0),
    ("timeout", "2.5", 2.5), ("stall_timeout", None, None), ("debug", "yes", True), ("debug", "no", False),
    ("debug", True, True), ("debug", 0, False), ("shm_collectives", "OFF", "off"), ("log_level", "debug", "DEBUG"),
    ("allreduce_algorithm", "Ring", "ring"), ("max_message_elements", 7, 7), ("flight_signal", None, ""),
])
def test_an_assignment_is_read_as_its_variable_is(field, value, want):
    s = Settings()
    setattr(s, field, value)
    assert getattr(s, field) == want and type(getattr(s, field)) is type(want)


def test_the_global_settings_refuse_a_bad_timeout():
    import axonhpc as ax

    before = ax.settings.timeout
    with pytest.raises(ConfigurationError, match="ax.settings.timeout=nan"):
        ax.settings.timeout = float("nan")
    assert ax.settings.timeout == before
