"""The native core; everything else is in pyproject.toml.

``kvevents.kernels._native`` (``src/kvevents/kernels/_native.c`` and the headers it
includes: see ``src/kvevents/kernels/__init__.py``) is built when a C compiler and
Python's headers are there; without them the install goes on and the router answers in
Python, with the same answers.
"""

from setuptools import Extension, setup

_KERNELS = "src/kvevents/kernels"
_PARTS = [
    "args.h",
    "xxh3.h",
    "token_json.h",
    "block_table.h",
    "mask_mirror.h",
    "load_scan.h",
    "json_out.h",
]

setup(
    ext_modules=[
        Extension(
            "kvevents.kernels._native",
            [f"{_KERNELS}/_native.c"],
            depends=[f"{_KERNELS}/{part}" for part in _PARTS],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
