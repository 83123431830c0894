"""The optional native extension; everything else is in pyproject.toml.

``kvevents.kernels._native`` (the router's plain ``/route`` answer in one call, see
``src/kvevents/kernels/native.py``) is built when a C compiler and Python's headers are
there; without them the install goes on and the router answers in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvevents.kernels._native",
            ["src/kvevents/kernels/_native.c"],
            extra_compile_args=["-O2", "-ffp-contract=off", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
