"""The one thing pyproject.toml cannot declare: kvcm's optional C extension.

``kvcm._native`` (service/kvcm/csrc/, docs/native.md) is optional: without a C compiler
the build skips it and kvcm runs the same steps in numpy.
"""

from pathlib import Path

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvcm._native",
            sorted(str(p) for p in Path("service/kvcm/csrc").glob("*.c")),
            include_dirs=["service/kvcm/csrc"],
            depends=sorted(str(p) for p in Path("service/kvcm/csrc").glob("*.h")),
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
