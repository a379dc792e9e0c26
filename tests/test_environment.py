"""environment.yml (conda) and pyproject.toml (pip) list the same packages."""

import re
import tomllib

import yaml

from conftest import ROOT

CONDA_NAMES = {"pytorch": "torch", "dask-core": "dask"}  # conda-forge names that differ from PyPI's


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[]", requirement.strip(), maxsplit=1)[0].lower()


def test_conda_and_pip_dependencies_agree():
    """Every package of pyproject.toml (with its dev extra) is in environment.yml, with the same bounds."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip = {_name(r): r.replace(" ", "") for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    conda = {}
    listed = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    from_pip = [d for entry in listed if isinstance(entry, dict) for d in entry.get("pip", [])]
    for dep in [d for d in listed if isinstance(d, str)] + from_pip:
        if _name(dep) not in ("python", "pip"):
            name = CONDA_NAMES.get(_name(dep), _name(dep))
            conda[name] = name + dep.replace(" ", "")[len(_name(dep)):]
    assert pip == conda


def test_one_python_version_everywhere():
    """The README, pyproject.toml, environment.yml, the Dockerfile and the interpreter running these tests agree
    on the oldest Python the course supports."""
    import sys

    oldest = re.search(r">=\s*3\.(\d+)", tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                       ["requires-python"]).group(1)
    assert f"python=3.{oldest}" in (ROOT / "environment.yml").read_text()
    assert f"FROM python:3.{oldest}-" in (ROOT / "Dockerfile").read_text()
    stated = set(re.findall(r"Python 3\.(\d+)", (ROOT / "README.md").read_text()))
    assert stated == {oldest}, f"README names Python 3.{sorted(stated)}, pyproject.toml requires 3.{oldest}"
    assert sys.version_info >= (3, int(oldest))


def test_make_lab_starts_as_root_in_a_container():
    """Jupyter refuses root without --allow-root: `make lab` and `make instructor-lab` pass it exactly when root
    runs them."""
    import os
    import subprocess

    for target in ("lab", "instructor-lab"):
        command = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert ("--allow-root" in command) == (os.geteuid() == 0), command
