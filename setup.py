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

extensions = [
    Extension(
        "axonhpc._ext." + os.path.splitext(os.path.basename(path))[0],
        [path],
        include_dirs=[numpy.get_include(), "cython_src"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"] if not DEBUG else ["-O0", "-g"],
    )
    for path in sorted(glob.glob(os.path.join("cython_src", "*.pyx")))
]

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES))
