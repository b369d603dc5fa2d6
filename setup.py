"""Every package under the repository root ships as ``strata.<folder>``; nothing is listed by hand.

pyproject.toml holds the metadata and maps ``strata`` to this folder; setuptools' own package
discovery cannot add that prefix, so the list is made here. The root folder is the ``strata``
package itself, so this file would ship as ``strata/setup.py``: ``build_py`` leaves it out.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "benchmarks", "benchmarks.*", "examples", "examples.*", "build", "build.*"]


class BuildWithoutSetupScript(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [(pkg, module, path) for pkg, module, path in modules if (pkg, module) != ("strata", "setup")]


setup(
    packages=["strata"] + [f"strata.{name}" for name in find_packages(where=".", exclude=NOT_SHIPPED)],
    cmdclass={"build_py": BuildWithoutSetupScript},
)
