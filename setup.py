"""The one thing pyproject.toml cannot declare: kvcm's optional C extension.

``kvcm._native`` (service/kvcm/_native.c, docs/native.md) is optional: without a C compiler
the build skips it and kvcm runs the same steps in numpy.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvcm._native",
            ["service/kvcm/_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
