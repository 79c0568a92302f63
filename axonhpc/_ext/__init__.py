"""Compiled core built from ``cython_src/*.pyx``; use it through ``axonhpc.bucketing``."""
