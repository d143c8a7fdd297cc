"""The Hugging Face adapters on both ends of the ``[hf]`` extra's transformers range: this environment has one (the
highest, pinned in constraints.txt); the lowest, the range's floor, is unpacked with ``pip install --no-deps
--target`` into a directory under the user's cache (reused by later runs) and put first on ``PYTHONPATH`` of a
subprocess that runs tests/test_huggingface_adapters.py there (its deprecation-warning test included; its two
gradient checks left out: they test the search, not the version, and take minutes). A registry that cannot be
reached skips the test, with pip's reason."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from conftest import REPO, clean_env  # noqa: E402
from packaging_harness import NETWORK_ERRORS, pip_env, pyproject  # noqa: E402


def declared_range():
    """``(floor, cap)`` of the ``[hf]`` extra's ``transformers>=FLOOR,<CAP``."""
    requirement = next(r for r in pyproject()["project"]["optional-dependencies"]["hf"] if r.startswith("transformers"))
    floor, cap = re.fullmatch(r"transformers>=([\d.]+),<([\d.]+)", requirement).groups()
    return floor, cap


def release(version: str):
    return tuple(int(part) for part in re.match(r"[\d.]+\d", version).group(0).split("."))


def unpacked_transformers(version: str) -> Path:
    """A directory holding transformers ``version`` alone (its dependencies are this environment's), made once."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fairseq_softtopk"
    target = cache / f"transformers-{version}"
    if (target / "transformers" / "__init__.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"transformers-{version}-", dir=cache))  # renamed when complete
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--timeout", "30", "--retries", "2",
           "--target", str(partial), f"transformers=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_env())
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        out = proc.stdout + proc.stderr
        reason = next((line for line in out.splitlines() if any(e in line for e in NETWORK_ERRORS)), None)
        if reason:
            pytest.skip(f"the package registry cannot be reached: {reason.strip()[:300]}")
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    try:
        partial.rename(target)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    return target


def test_this_environment_has_a_transformers_of_the_declared_range():
    floor, cap = declared_range()
    assert release(floor) <= release(transformers.__version__) < release(cap), transformers.__version__


def test_the_adapters_pass_their_tests_on_the_lowest_transformers_of_the_range():
    floor, _ = declared_range()
    lowest = floor + ".0" * (3 - floor.count(".") - 1)
    if transformers.__version__ == lowest:
        pytest.skip(f"this environment has the lowest, {lowest}, and runs the adapter tests on it itself")
    directory = unpacked_transformers(lowest)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, env=env, cwd=REPO)
    assert version.stdout.strip() == lowest, version.stdout + version.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "tests/test_huggingface_adapters.py", "-k", "not finite_differences"],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed >= 20 and " skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
