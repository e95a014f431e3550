"""The package list, which pyproject.toml cannot say: the `engines/` folder installs as `dyn_engines`.

A top-level package named as plainly as `engines` would collide with any other distribution's, and then
break `dyn` (STYLE.md rule 17); the folder keeps its place in the tree, the import name is dyn's own.
"""

from setuptools import find_packages, setup

ENGINES = "dyn_engines"

setup(
    packages=[
        *find_packages(include=["dynamo_cli", "dynamo_cli.*"]),
        *(ENGINES + name.removeprefix("engines") for name in find_packages(include=["engines", "engines.*"])),
    ],
    package_dir={ENGINES: "engines"},
)
