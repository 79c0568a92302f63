"""Build the compiled core: every cython_src/NAME.pyx becomes axonhpc._ext.NAME.

Cython directives are set here, once, for all modules. Set
AXONHPC_CYTHON_DEBUG=1 at build time to compile with bounds checks and
wrap-around indexing switched back on (slower; for chasing memory errors).
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("AXONHPC_CYTHON_DEBUG", "0") not in ("", "0")

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

# The host kernels (layers, optimizer updates): no fused multiply-add, so every build and every
# vector width computes the numpy code's bits (cython_src/host_math.h); no errno and no FP traps,
# so sqrt is one instruction and the loops with selects vectorize. Neither changes a result.
KERNEL_FLAGS = ["-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
KERNEL_MODULES = {"_layers", "_updates"}


def extension(path: str) -> Extension:
    name = os.path.splitext(os.path.basename(path))[0]
    flags = ["-O3"] if not DEBUG else ["-O0", "-g"]
    if name in KERNEL_MODULES:
        flags += KERNEL_FLAGS
    return Extension(
        "axonhpc._ext." + name,
        [path],
        include_dirs=[numpy.get_include(), "cython_src"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=flags,
        # A change to a C header or a .pxd rebuilds the modules (setuptools looks only at the .c otherwise).
        depends=sorted(glob.glob(os.path.join("cython_src", "*.h")) + glob.glob(os.path.join("cython_src", "*.pxd"))),
    )


extensions = [extension(path) for path in sorted(glob.glob(os.path.join("cython_src", "*.pyx")))]

# The modules compile side by side, on every core this process may use (setuptools' build_ext --parallel).
JOBS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, nthreads=JOBS if JOBS > 1 else 0),
      options={"build_ext": {"parallel": JOBS}})
