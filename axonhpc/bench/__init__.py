"""Benchmarks behind ``axonhpc bench``: each prints our figure beside a baseline from the same run."""
