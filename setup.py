"""Which packages the wheel holds; everything else is in pyproject.toml.

Found, not listed: every package under `tk_mlir/`, and every package under
the top-level `dialects/`, `passes/` and `lowering/`, which install as
`tk_mlir.dialects`, `tk_mlir.passes` and `tk_mlir.lowering` (the code
imports them by those names; nothing generic lands at the top of
site-packages). pyproject.toml alone cannot say this: its `packages` is
either a list or one `find`, and a find cannot rename a folder."""
from setuptools import find_packages, setup

SIBLINGS = ("dialects", "passes", "lowering")

packages = find_packages(include=["tk_mlir", "tk_mlir.*"])
package_dir = {}
for sibling in SIBLINGS:
    for name in find_packages(include=[sibling, sibling + ".*"]):
        packages.append("tk_mlir." + name)
        package_dir["tk_mlir." + name] = name.replace(".", "/")

setup(packages=packages, package_dir=package_dir)
