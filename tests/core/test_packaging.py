"""What the distributions declare: a pip install from wheels has exactly these to run on."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent


def project(package: str) -> dict:
    path = ROOT / ("pyproject.toml" if package == "." else f"packages/{package}/pyproject.toml")
    return tomllib.loads(path.read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
            for r in requirements}  # fmt: skip


def test_core_declares_numpy_which_writing_safetensors_needs(tmp_path):
    """A pip install lacked numpy: pegainfer-tiny crashed half-way through its first write."""
    blocked = (
        "import sys; sys.modules['numpy'] = None; import torch; "
        "from safetensors.torch import save_file; save_file({'a': torch.zeros(1)}, 'x')"
    )
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True,
                            cwd=tmp_path)  # fmt: skip
    assert "numpy" in result.stderr  # the premise: safetensors writes through numpy
    assert "numpy" in names(project("core")["dependencies"])


PACKAGES = [".", "core", "server", "model-qwen3", "model-qwen35", "model-deepseek", "model-kimi-k2"]


def test_workspace_packages_pin_each_other_to_their_one_version():
    """They are released together: a wheel of one must not pair with another release of the
    next (they were unpinned)."""
    versions = {project(p)["name"]: project(p)["version"] for p in PACKAGES}
    for package in PACKAGES:
        meta = project(package)
        assert meta.get("description"), package
        requirements = meta.get("dependencies", []) + [
            r for extra in meta.get("optional-dependencies", {}).values() for r in extra
        ]
        for requirement in requirements:
            name = next(iter(names([requirement])))
            if name in versions:
                assert f"{name}=={versions[name]}" in requirement.replace(" ", ""), requirement


def test_dev_tools_stay_out_of_a_default_install_and_the_readme_asks_for_them():
    """`uv sync` installed the whole dev group (transformers, pytest, ruff...) for everyone."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "dev" not in root["tool"]["uv"].get("default-groups", [])
    readme = (ROOT / "README.md").read_text()
    assert "uv run --group dev pytest -q" in readme
    assert "https://download.pytorch.org/whl/cpu" in readme  # the CPU-only path is documented
