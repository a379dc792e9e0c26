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
