"""What the Triton kernel tests (tests/test_triton_*_topk.py) share: where the kernels run, and the child pytest
that runs them under Triton's interpreter where there is no GPU.

Triton fixes its mode (compiled or interpreted) when it is first imported, and torch.compile imports it: so the
interpreter must be chosen before the test process imports anything, in a child process of its own.
"""

import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

from conftest import clean_env, script_module
from fairseq_softtopk.ops.kernels import backend as backend_module, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the kernels run in this process: on a GPU, or on the CPU when this process started under the interpreter
IN_PROCESS = DEVICE == "cuda" or backend_module.interpreter_requested()
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install triton; "
                                                                 "the dev extra has it)")
kernel_test = pytest.mark.skipif(
    not (IN_PROCESS and triton_available()),
    reason="no GPU: run in a child process under TRITON_INTERPRET=1 by test_kernels_under_the_interpreter"
    if triton_available() else "triton is not installed (pip install triton; the dev extra has it)")
#: the runner of a test file's kernel tests (decorates ``test_kernels_under_the_interpreter``)
interpreter_runner = pytest.mark.skipif(IN_PROCESS or not triton_available(),
                                        reason="the kernel tests run in this process" if IN_PROCESS else
                                        "triton is not installed (pip install triton; the dev extra has it)")


def run_under_the_interpreter(test_file: str, repo_root, selection: str) -> None:
    """Runs the tests of ``test_file`` that ``selection`` (pytest's ``-k``) picks in a child pytest started with
    ``TRITON_INTERPRET=1``; fails unless they all pass (none skipped)."""
    env = dict(clean_env(), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           test_file, "-k", selection], cwd=repo_root, env=env, capture_output=True, text=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "passed" in summary and "skipped" not in summary, proc.stdout[-3000:]


def compile_without_spills(kernel, signature: Dict[str, str], constexprs: dict, arch: int, dtype: str,
                           options: dict, tmp_path: Path, name: str = "", allowed_spill_bytes: int = 0) -> None:
    """Compiles ``kernel`` ahead of time for ``sm_{arch}`` (no GPU needed; ``D`` in ``signature``'s types is
    ``dtype``) and asserts a cubin and, by ``ptxas -v``, no register spill (skips where no bundled ptxas takes
    the PTX; ``allowed_spill_bytes``: a known spill, which must not grow). The caller sets ``TRITON_CACHE_DIR`` to a
    fresh directory, so that nothing comes from a cache. The compile and ``ptxas -v`` are
    scripts/bench/kernel_instructions.py's."""
    instructions = script_module("bench/kernel_instructions.py")
    assert set(kernel.arg_names) == set(signature) | set(constexprs), kernel.arg_names
    compiled = instructions.compile_ahead(kernel, signature, constexprs, arch, dtype, options)
    assert compiled.asm["cubin"], (name, arch, dtype, constexprs)
    _, spills = instructions.ptxas_usage(compiled.asm["ptx"], arch, tmp_path)
    if spills is None:
        pytest.skip("no bundled ptxas takes this PTX: the spill check needs one")
    assert spills <= allowed_spill_bytes, (name, arch, dtype, constexprs, spills)


def _mutated_copy(kernel_file: Path, tmp_path: Path, old: str, new: str) -> Path:
    """A copy of ``kernel_file`` in ``tmp_path`` with ``old``, which must occur exactly once, replaced by ``new``."""
    source = kernel_file.read_text()
    assert source.count(old) == 1, old
    path = tmp_path / kernel_file.name
    path.write_text(source.replace(old, new))
    return path


def load_mutant(op_module, monkeypatch, tmp_path: Path, old: str, new: str) -> None:
    """From now on (until ``monkeypatch`` undoes it) ``op_module`` loads its kernels from a copy of its kernel file
    (``KERNEL_FILE``) with ``old``, which must occur exactly once, replaced by ``new``: a mutant the tests must
    catch."""
    monkeypatch.setattr(op_module, "KERNEL_FILE", _mutated_copy(op_module.KERNEL_FILE, tmp_path, old, new))
    monkeypatch.setattr(op_module, "_kernel_modules", {})


def load_shared_mutant(kernel_file: Path, probe: str, importers, monkeypatch, tmp_path: Path, old: str,
                       new: str) -> None:
    """A mutant of a file of device functions that kernel files import by module name (``kernel_file``, imported as
    ``fairseq_softtopk.ops.kernels.<its stem>``; ``probe``: one of its Triton functions): loaded from a mutated copy
    into ``sys.modules`` in that module's place, and the ``importers`` (op modules) load their kernels again, on it
    (until ``monkeypatch`` undoes it)."""
    from fairseq_softtopk.ops.kernels.loading import load_kernels

    name = f"fairseq_softtopk.ops.kernels.{kernel_file.stem}"
    monkeypatch.setitem(sys.modules, name, load_kernels(_mutated_copy(kernel_file, tmp_path, old, new), name, probe))
    for importer in importers:
        monkeypatch.setattr(importer, "_kernel_modules", {})
