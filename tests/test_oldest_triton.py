"""The oldest supported triton (constraints.txt's "oldest supported" line; the GPU machines' version) compiles every
kernel for sm_90 (the H100's and H200's), in float32 and float64, as the pinned one does for sm_90 and sm_80 in
tests/test_triton_*.py.

scripts/setup_venv.sh installs it beside the virtualenv (``.venv/triton-oldest``, not on the virtualenv's path);
a child pytest runs the kernel files' compile tests with it first on ``PYTHONPATH``. Its interpreter is not used:
triton 3.6's fails with numpy 2.4 (the kernels' values are tested with the pinned triton).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env

REPO = Path(__file__).resolve().parents[1]
OLDEST_DIR = Path(sys.prefix) / "triton-oldest"
KERNEL_TEST_FILES = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_triton_*.py"))


def oldest_supported() -> str:
    return re.search(r"^# oldest supported: triton==(\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)


@pytest.mark.skipif(not (OLDEST_DIR / "triton").is_dir(),
                    reason=f"the oldest supported triton is not installed beside the virtualenv ({OLDEST_DIR.name}: "
                           f"scripts/setup_venv.sh installs it)")
def test_every_kernel_compiles_with_the_oldest_supported_triton(repo_root, tmp_path):
    env = clean_env()
    env.update(PYTHONPATH=":".join(filter(None, [str(OLDEST_DIR), env.get("PYTHONPATH")])), TRITON_CACHE_DIR=str(tmp_path))
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == oldest_supported() == "3.6.0"
    assert len(KERNEL_TEST_FILES) == 6  # every kernel family: the window's and the split ones' included
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *KERNEL_TEST_FILES, "-k", "compiles_for_the_gpu and not 80"],
                          cwd=repo_root, env=env, capture_output=True, text=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.match(r"\d+ passed", summary) and "skipped" not in summary, proc.stdout[-3000:]
