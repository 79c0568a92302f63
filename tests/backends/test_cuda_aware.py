"""Deciding whether MPI is CUDA-aware: parsing, the order of the checks, the probe's verdicts.

Everything but the last tests is pure; the last ones ask this machine's MPI
(one process, no mpiexec), which is not CUDA-aware.
"""
import json
import os
import subprocess
import sys

import pytest

from axonhpc.backends.cuda_aware import (
    decide,
    disabled_by_environment,
    mpi_flavour,
    mpich_configured_with_cuda,
    parse_ompi_info,
    probe_outcome,
    run_probe,
    vendor_switch,
)
from axonhpc.settings import Settings, standalone_environment
from support.paths import ROOT


MPICH = """MPICH Version:      4.2.0
MPICH Release date: Fri Feb  9 12:29:21 CST 2024
MPICH ABI:          16:0:4
MPICH Device:       ch4:ofi
MPICH configure:    --prefix=/opt/mpich --with-device=ch4:ofi --with-cuda=/usr/local/cuda --enable-fast=O3
MPICH CC:           gcc -O3
"""
MPICH_NO_CUDA = MPICH.replace("--with-cuda=/usr/local/cuda", "--without-cuda")
MPICH_SILENT = MPICH.replace(" --with-cuda=/usr/local/cuda", "")
OPEN_MPI = "Open MPI v5.0.3, package: Open MPI builder@host Distribution, ident: 5.0.3, repo rev: v5.0.3, Apr 08, 2024"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)\nMPI BUILD INFO : Wed Nov 15 20:57 2023"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS"


def test_flavours_from_library_version_strings():
    assert mpi_flavour(MPICH) == "mpich"
    assert mpi_flavour(OPEN_MPI) == "openmpi"
    assert mpi_flavour(CRAY) == "cray-mpich"
    assert mpi_flavour(MVAPICH) == "mvapich"
    assert mpi_flavour(INTEL) == "intel"
    assert mpi_flavour("Microsoft MPI 10.1") == "unknown"


def test_mpich_configure_line():
    assert mpich_configured_with_cuda(MPICH) is True
    assert mpich_configured_with_cuda(MPICH.replace("--with-cuda=/usr/local/cuda", "--with-cuda")) is True
    assert mpich_configured_with_cuda(MPICH_NO_CUDA) is False
    assert mpich_configured_with_cuda(MPICH.replace("=/usr/local/cuda", "=no")) is False
    assert mpich_configured_with_cuda(MPICH_SILENT) is None  # MPICH may find CUDA on its own: unknown
    assert mpich_configured_with_cuda(OPEN_MPI) is None


def test_ompi_info_parsable_lines():
    five = "mca:mpi:base:param:mpi_built_with_cuda_support:value:true\n"
    four = "mca:opal:base:param:opal_built_with_cuda_support:value:false\n"
    enumerators = ("mca:mpi:base:param:mpi_built_with_cuda_support:enumerator:value:0:false\n"
                   "mca:mpi:base:param:mpi_built_with_cuda_support:enumerator:value:1:true\n")
    assert parse_ompi_info("mca:btl:smcuda:version:5.0.3\n" + five) is True
    assert parse_ompi_info(four) is False
    assert parse_ompi_info(enumerators) is None
    assert parse_ompi_info(enumerators + five) is True
    assert parse_ompi_info("") is None


def test_environment_switches():
    assert disabled_by_environment("mpich", {"MPIR_CVAR_ENABLE_GPU": "0"})[0] is False
    assert disabled_by_environment("mpich", {"MPIR_CVAR_ENABLE_GPU": "1"}) is None
    assert disabled_by_environment("openmpi", {"OMPI_MCA_opal_cuda_support": "false"})[0] is False
    assert disabled_by_environment("openmpi", {"MPIR_CVAR_ENABLE_GPU": "0"}) is None
    assert vendor_switch("cray-mpich", {"MPICH_GPU_SUPPORT_ENABLED": "1"}) == (
        True, "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1")
    assert vendor_switch("cray-mpich", {})[0] is False
    assert vendor_switch("mvapich", {"MV2_USE_CUDA": "1"})[0] is True
    assert vendor_switch("intel", {"I_MPI_OFFLOAD": "2"})[0] is True
    assert vendor_switch("mpich", {}) is None


class _Spy:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def test_the_setting_overrides_everything_and_asks_nothing():
    query, probe = _Spy((True, "query")), _Spy((True, "probe"))
    got = decide("no", MPICH, {}, query=query, probe=probe)
    assert (got.aware, got.how) == (False, "AXONHPC_CUDA_AWARE_MPI=no")
    assert str(decide("yes", OPEN_MPI, {"OMPI_MCA_opal_cuda_support": "false"})) == "yes (AXONHPC_CUDA_AWARE_MPI=yes)"
    assert query.calls == probe.calls == 0


def test_a_switch_that_turns_gpu_support_off_beats_the_library_query():
    got = decide("auto", MPICH, {"MPIR_CVAR_ENABLE_GPU": "0"}, query=_Spy((True, "MPIX_Query_cuda_support() returned 1")))
    assert not got.aware and "MPIR_CVAR_ENABLE_GPU=0" in got.how


def test_the_library_query_decides_before_build_information():
    got = decide("auto", MPICH, {}, query=lambda: (False, "MPIX_Query_cuda_support() returned 0"))
    assert not got.aware and got.how == "MPIX_Query_cuda_support() returned 0"
    got = decide("auto", OPEN_MPI, {}, query=lambda: (True, "MPIX_Query_cuda_support() returned 1"))
    assert got.aware


def test_the_probe_runs_only_when_asked_and_comes_before_the_query():
    probe = _Spy((True, "a device send and all-reduce gave the right values"))
    assert decide("auto", MPICH, {}, query=lambda: (False, "q"), probe=probe).how == "q"
    assert probe.calls == 0
    got = decide("probe", MPICH, {}, query=lambda: (False, "q"), probe=probe)
    assert got.aware and got.how.startswith("probe transfer: a device send") and probe.calls == 1


def test_vendor_switches_then_build_information_then_no():
    assert decide("auto", CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "1"}).aware
    assert not decide("auto", CRAY, {}).aware
    assert decide("auto", MPICH, {}).how == "MPICH configured --with-cuda"
    assert not decide("auto", MPICH_NO_CUDA, {}).aware
    ompi_info = _Spy("mca:mpi:base:param:mpi_built_with_cuda_support:value:true\n")
    assert decide("auto", OPEN_MPI, {}, ompi_info=ompi_info).aware and ompi_info.calls == 1
    assert decide("auto", MPICH_SILENT, {}, ompi_info=ompi_info).how.startswith("no sign of CUDA support in this mpich")
    assert ompi_info.calls == 1  # ompi_info is asked about Open MPI only
    assert not decide("auto", "Microsoft MPI 10.1", {}).aware


def test_probe_outcomes():
    assert probe_outcome(0, "axonhpc-probe ok\n", "") == (True, "a device send and all-reduce gave the right values")
    aware, how = probe_outcome(-11, "", "")
    assert not aware and "signal 11" in how and "crash" in how
    assert probe_outcome(0, "axonhpc-probe wrong-values\n", "")[0] is False
    assert probe_outcome(1, "", "Traceback...\nModuleNotFoundError: No module named 'cupy'\n") == (
        False, "the probe process failed (exit 1): ModuleNotFoundError: No module named 'cupy'")


def test_the_probe_process_fails_cleanly_without_cupy():
    env = standalone_environment()
    env["PYTHONPATH"] = ""  # this interpreter's own packages: no cupy here
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('cupy') is None else 3)"
    if subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode != 0:
        pytest.skip("cupy is installed here")
    aware, how = run_probe(env, timeout=60)
    assert not aware and "No module named 'cupy'" in how


def test_setting_values():
    for text, value in [("auto", "auto"), ("PROBE", "probe"), ("yes", "yes"), ("1", "yes"), ("on", "yes"),
                        ("no", "no"), ("0", "no"), ("off", "no"), ("", "auto")]:
        assert Settings().load_environment({"AXONHPC_CUDA_AWARE_MPI": text}).cuda_aware_mpi == value, text
    with pytest.raises(ValueError, match="AXONHPC_CUDA_AWARE_MPI='maybe' must be one of:? auto, probe, yes, no"):
        Settings().load_environment({"AXONHPC_CUDA_AWARE_MPI": "maybe"})


def test_the_probe_environment_drops_the_launchers_rank_variables():
    env = standalone_environment({"PMI_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "SLURM_PROCID": "1",
                                  "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2", "AXONHPC_DEBUG": "1"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2", "AXONHPC_DEBUG": "1"}


def _info(extra_env):
    env = dict(os.environ, **extra_env)
    for key in ("PMI_RANK", "PMI_SIZE"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-m", "axonhpc", "info", "--json"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["cuda_aware_mpi"]


def test_this_machines_mpi_is_asked_and_the_answer_says_how():
    answer = _info({})
    assert answer.startswith(("no (", "yes (")) and answer.endswith(")")
    if "MPICH Version" in subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                                          "print(MPI.Get_library_version())"],
                                         capture_output=True, text=True, timeout=60).stdout:
        assert answer == "no (MPIX_Query_cuda_support() returned 0)"
    assert _info({"AXONHPC_CUDA_AWARE_MPI": "yes"}) == "yes (AXONHPC_CUDA_AWARE_MPI=yes)"
    assert _info({"MPIR_CVAR_ENABLE_GPU": "0"}).startswith("no (MPIR_CVAR_ENABLE_GPU=0 turns MPICH's GPU support off")
