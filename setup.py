"""Every package under the repository root ships as ``strata.<folder>``; nothing is listed by hand.

pyproject.toml holds the metadata and maps ``strata`` to this folder; setuptools' own package
discovery cannot add that prefix, so the list is made here.
"""

from setuptools import find_packages, setup

NOT_SHIPPED = ["tests", "tests.*", "benchmarks", "benchmarks.*", "examples", "examples.*", "build", "build.*"]

setup(packages=["strata"] + [f"strata.{name}" for name in find_packages(where=".", exclude=NOT_SHIPPED)])
