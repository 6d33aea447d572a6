"""setuptools hooks (everything else is in pyproject.toml): the install compiles the CPU kernels.

`build_kernels` runs kernels/cpu/build.py's `build_all` as a step of `build`, so every wheel
build, `pip install .` and `pip install -e .` (hence `make install` and the image's build stage)
compiles each kernel library once per x86 level: into the wheel's kvpilot/kernels/cpu/lib, or in
place (kernels/cpu/lib) for an editable install. A compiler error fails the install with the
compiler's message. The wheel is platform-specific (it holds shared libraries).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _kernel_build():
    """kernels/cpu/build.py, loaded by path (kvpilot is not importable while it is being built)."""
    spec = importlib.util.spec_from_file_location("_kvpilot_kernel_build", ROOT / "kernels" / "cpu" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class build_kernels(Command):  # noqa: N801 (setuptools command names are lower case)
    description = "compile kvpilot's CPU kernels once per x86 level (kernels/cpu/build.py)"
    user_options = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False  # set by setuptools' editable_wheel: build in place

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def _out(self) -> Path:
        return ROOT / "kernels" / "cpu" / "lib" if self.editable_mode else (
            Path(self.build_lib) / "kvpilot" / "kernels" / "cpu" / "lib")

    def run(self):
        kb = _kernel_build()
        try:
            manifest = kb.build_all(self._out())
        except kb.BuildError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"kvpilot CPU kernels: {len(manifest['compile_s'])} libraries ({', '.join(manifest['variants'])}) "
              f"built in {manifest['wall_s']:.1f} s into {self._out()}")

    def get_outputs(self):
        out = self._out()
        return [str(p) for p in out.rglob("*") if p.is_file()] if out.exists() else []

    def get_source_files(self):
        return [f"kernels/cpu/csrc/{p.name}" for p in (ROOT / "kernels" / "cpu" / "csrc").iterdir()]


class build_with_kernels(build):  # noqa: N801
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class BinaryDistribution(Distribution):
    """The wheel holds shared libraries: tag it for the platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build": build_with_kernels, "build_kernels": build_kernels}, distclass=BinaryDistribution)
