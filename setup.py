"""The one build step pyproject.toml cannot declare: the native CPU kernels, compiled at install.

`pip install .` (and `pip wheel .`, the image build, `make`) compiles kernels/native for every ISA
level (AVX2, AVX-512, AVX-512 + BF16; the AMX tile paths live in the last) and the KV checksums'
CRC-32C into kernels/native/prebuilt/, so a runtime image needs no compiler and no server compiles
at start (kernels/native/build.py). The build needs torch's headers: pyproject.toml's
build-system lists the pinned torch, and `make` installs it first and builds without isolation.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _native_build():
    """kernels/native/build.py, loaded by path (importing the package would import the engine)."""
    spec = importlib.util.spec_from_file_location(
        "pdserve_native_build", ROOT / "kernels" / "native" / "build.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildNative(Command):
    description = "compile the native CPU kernels for every ISA level (kernels/native/build.py)"
    user_options = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False  # set by setuptools for `pip install -e`: build into the checkout
        self.outputs = []

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        native = _native_build()
        folder = (
            native.PREBUILT if self.editable_mode else Path(self.build_lib, "kernels", "native", "prebuilt")
        )
        # A checkout already built (`make`) holds the same files, named by their sources: reused.
        self.outputs = [str(p) for p in native.build_all(folder, reuse=native.PREBUILT)]

    def get_outputs(self):
        return self.outputs

    def get_output_mapping(self):
        return {}


class Build(build):
    sub_commands = [*build.sub_commands, ("build_native", None)]


class BinaryDistribution(Distribution):
    """Wheels carry compiled libraries: tag them for this platform and Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build": Build, "build_native": BuildNative}, distclass=BinaryDistribution)
