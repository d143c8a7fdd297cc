"""scripts/setup_venv.sh keeps a torch and a triton that the virtualenv already has (a CUDA user's build)."""

import os
import re
import shutil
import subprocess

import pytest


def _run_setup(tmp_path, repo_root, torch_version, triton_version=None):
    """Runs a copy of the setup script against a virtualenv whose Python is a stand-in: it records every
    command and has ``torch_version`` and ``triton_version`` installed (None: not installed)."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    for name in ("constraints.txt", "requirements.txt", "pyproject.toml"):
        shutil.copy(repo_root / name, root / name)
    shutil.copy(repo_root / "scripts" / "setup_venv.sh", root / "scripts" / "setup_venv.sh")
    calls = tmp_path / "calls.txt"
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    has_torch = "true" if torch_version else "false"
    has_triton = "true" if triton_version else "false"
    python.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
if [[ "$1" == -c && "$2" == *"import sys, torch"* ]]; then
    {has_torch} || exit 1
    [[ "{torch_version}" > "2.6" ]] && exit 0 || exit 1
fi
if [[ "$1" == -c && "$2" == "import triton" ]]; then {has_triton}; exit; fi
if [[ "$1" == -c && "$2" == *triton* ]]; then echo "{triton_version}"; exit 0; fi
if [[ "$1" == -c ]]; then echo "{torch_version}"; fi
exit 0
""")
    python.chmod(0o755)
    env = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    proc = subprocess.run(["bash", root / "scripts" / "setup_venv.sh"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    installs = [line.split() for line in calls.read_text().splitlines() if line.startswith("-m pip install")]
    return proc.stderr, installs


def test_a_torch_already_in_the_virtualenv_is_kept(tmp_path, repo_root):
    stderr, installs = _run_setup(tmp_path, repo_root, "2.9.1+cu128")
    assert "keeping the virtualenv's torch 2.9.1+cu128" in stderr
    assert installs and not any("torch" in args for args in installs)
    # entmax declares torch: installed without dependencies, so that pip does not fetch the pinned torch
    assert [args for args in installs if "entmax" in args] and all(
        "--no-deps" in args for args in installs if "entmax" in args)


def test_without_torch_the_pinned_one_is_installed(tmp_path, repo_root):
    _, installs = _run_setup(tmp_path, repo_root, None)
    assert any("torch" in args for args in installs[:1])  # torch first, alone (with numpy and cython)


@pytest.mark.parametrize("triton_version", [None, "3.6.0"])
def test_the_pinned_triton_is_installed_unless_the_virtualenv_has_one(tmp_path, repo_root, triton_version):
    """Without triton the pinned one is installed (constraints.txt); a triton already there (a CUDA torch's own,
    3.6.0 on the GPU machines) is kept."""
    assert "\ntriton==3.9.0\n" in (repo_root / "constraints.txt").read_text()
    stderr, installs = _run_setup(tmp_path, repo_root, "2.11.0", triton_version)
    triton_installs = [args for args in installs if "triton" in args]
    if triton_version:
        assert not triton_installs and "keeping the virtualenv's triton 3.6.0" in stderr
    else:
        assert len(triton_installs) == 1 and "-c" in triton_installs[0]
        assert str(tmp_path / "project" / "constraints.txt") in triton_installs[0]


@pytest.mark.parametrize("triton_version", [None, "3.6.0"])
def test_the_oldest_supported_triton_is_installed_beside_the_virtualenv(tmp_path, repo_root, triton_version):
    """The oldest supported triton (constraints.txt's "# oldest supported: triton==" line) goes to
    ``.venv/triton-oldest``, whatever triton the virtualenv has: without the constraints (they pin the newest) and
    without dependencies (torch's, which would replace the virtualenv's)."""
    oldest = re.search(r"^# oldest supported: triton==(\S+)$", (repo_root / "constraints.txt").read_text(), re.M)
    assert oldest, "constraints.txt names no oldest supported triton"
    _, installs = _run_setup(tmp_path, repo_root, "2.11.0", triton_version)
    oldest_installs = [args for args in installs if f"triton=={oldest.group(1)}" in args]
    assert len(oldest_installs) == 1, installs
    args = oldest_installs[0]
    assert "--no-deps" in args and "-c" not in args and "--upgrade" in args
    assert not any("constraints.txt" in arg for arg in args)
    assert args[args.index("--target") + 1] == str(tmp_path / "project" / ".venv" / "triton-oldest")
    assert [a for a in args if "triton" in a and not a.startswith(str(tmp_path))] == [f"triton=={oldest.group(1)}"]
