"""The settings object and the launcher variables it reads."""
import pytest

from axonhpc.settings import MPI_INT_MAX, Settings, launcher_env


def test_defaults():
    s = Settings()
    assert (s.debug, s.timeout, s.abort_on_exception, s.backend) == (False, None, False, "auto")
    assert s.max_message_elements == MPI_INT_MAX == 2**31 - 1


def test_environment_fills_fields():
    s = Settings().load_environment({
        "AXONHPC_DEBUG": "1", "AXONHPC_TIMEOUT": "2.5", "AXONHPC_ABORT_ON_EXCEPTION": "yes",
        "AXONHPC_BACKEND": "MPI", "AXONHPC_MAX_MESSAGE_ELEMENTS": "1024", "AXONHPC_ALLREDUCE_ALGORITHM": "Hierarchical",
        "UNRELATED": "x",
    })
    assert s.as_dict() == {"debug": True, "timeout": 2.5, "abort_on_exception": True, "backend": "mpi",
                           "max_message_elements": 1024, "allreduce_algorithm": "hierarchical",
                           "stall_report": 30.0, "flight_recorder": 256, "flight_dir": "axonhpc-flight",
                           "flight_signal": "SIGUSR1", "skip_nonfinite_steps": False, "cuda_aware_mpi": "auto",
                           "timeline_dir": "", "log_level": "INFO", "log_ranks": "0",
                           "shm_collectives": "auto", "shm_min_bytes": 0, "shm_allgather_max_bytes": 262144,
                           "shm_slot_bytes": 262144,
                           "shm_slots": 4, "deterministic": False, "bucket_size_mb": "auto"}


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
    ("AXONHPC_MAX_MESSAGE_ELEMENTS", "0", "AXONHPC_MAX_MESSAGE_ELEMENTS='0' must be a positive integer"),
])
def test_bad_values_name_the_variable(var, value, match):
    with pytest.raises(ValueError, match=match):
        Settings().load_environment({var: value})


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
