"""Helpers of tests/test_packaging.py: pip into another virtualenv, code run there, copies of the checkout."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from conftest import REPO, clean_env

FORK = "ve-fairseq==0.12.3"
NETWORK_ERRORS = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                  "Connection refused", "ConnectTimeoutError", "ReadTimeoutError", "Max retries exceeded")


def dist_name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def package_version() -> str:
    """``__version__`` of the checkout's package, read without importing it."""
    tree = ast.parse((REPO / "fairseq_softtopk" / "__init__.py").read_text(encoding="utf-8"))
    return next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"])


def pip_env() -> dict:
    """This environment (pip's configuration, certificates) without what would leak this virtualenv in."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PYTHON") and key not in ("VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", OMP_NUM_THREADS="1")
    return env


def pip_for(python: Path, command: str) -> list:
    """This environment's pip, acting on ``python``'s environment (pip >= 22.3)."""
    return [sys.executable, "-m", "pip", "--python", str(python), command]


def pip_install(python: Path, *args: str, skip_unreachable: bool = True) -> str:
    """Runs ``pip install --no-compile ...`` into ``python``'s environment; returns its output. A registry that
    cannot be reached skips the test (pip's reason in the message); any other failure fails it."""
    cmd = pip_for(python, "install") + ["--no-compile", "--timeout", "30", "--retries", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_env())
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        reason = next((line for line in out.splitlines() if any(e in line for e in NETWORK_ERRORS)), None)
        if skip_unreachable and reason:
            pytest.skip(f"the package registry cannot be reached: {reason.strip()[:300]}")
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}")
    return out


def run_in(python: Path, code: str, cwd: Path) -> dict:
    """Runs ``code`` with ``python`` from ``cwd`` (not the checkout: the installed package is imported); returns
    the JSON object that its last line of output prints."""
    proc = subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                          env={key: value for key, value in clean_env().items() if key != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def installed(python: Path, cwd: Path) -> dict:
    """``{normalised name: version}`` of every distribution installed in ``python``'s environment."""
    return run_in(python, """
        import importlib.metadata as m, json, re
        print(json.dumps({re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in m.distributions()}))
    """, cwd)


def copy_checkout(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored) under ``dest``: builds write their
    ``build/`` and ``*.egg-info`` there, not into the checkout, and a stale ``build/`` cannot leak into a wheel."""
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                          capture_output=True)
    if proc.returncode == 0:
        for name in filter(None, proc.stdout.decode().split("\0")):
            if (REPO / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, dest / name)
    else:  # not a git checkout (an unpacked sdist, say)
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "runs", "__pycache__", ".pytest_cache"))
    return dest


def memory_backed_dir():
    """``/dev/shm`` where it is a tmpfs with room that allows executables, else None (the default temporary
    directory). The virtualenv holds 1.1 GB: removing it from this machine's disk (ext4 mounted with discard) took
    90 s, from memory half a second, and pytest would otherwise keep three of them around."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    shm = next((line.split() for line in mounts if line.split()[1:2] == ["/dev/shm"]), None)
    if not shm or shm[2] != "tmpfs" or "noexec" in shm[3].split(",") or not os.access("/dev/shm", os.W_OK):
        return None
    return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 4 * 2**30 else None
