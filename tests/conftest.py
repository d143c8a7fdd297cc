import contextlib
import sys
from pathlib import Path

import pytest
import torch

from fairseq_softtopk.checkpoint_safety import torch_release

REPO = Path(__file__).resolve().parents[1]


def _share_the_cores_among_workers():
    """Under pytest-xdist each worker (and each process it starts) gets its share of the cores: with torch's
    default, two workers ran two threads each on two cores, and a set of test files took 1.75x as long (OpenMP
    threads wait for each other spinning)."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_among_workers()


def script_module(path: str):
    """The module of a script under ``scripts/`` (``path`` relative to it, e.g. ``"bench/bench_train.py"``),
    loaded from its file once and kept in ``sys.modules`` under its file name: the scripts are not a package,
    and their directories are not on ``sys.path``."""
    import importlib.util

    file = REPO / "scripts" / path
    name = file.stem
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "")).resolve() == file.resolve():
        return module
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cuda_unavailable_reason():
    """Why the ``cuda`` tests cannot run here, or None where they can (on CUDA, or on the CPU in a dry run:
    ``SOFTTOPK_CUDA_TESTS_DEVICE=cpu``, see tests/test_cuda.py)."""
    import os

    if os.environ.get("SOFTTOPK_CUDA_TESTS_DEVICE") == "cpu":
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped, with the reason, where CUDA is not available."""
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"cuda test: {reason}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

#: torch.compile of the unrolled fixed-iteration solve (forward and backward): torch 2.6's AOT
#: partitioner ran for over 10 minutes on it (aot_eager, the tests' small cases); 2.11, 2.13 and 2.15
#: compile it in seconds. Dynamo's graph-break checks (explain) run on every supported torch.
compiles_fixed_solve = pytest.mark.skipif(
    torch_release(torch.__version__) < (2, 11), reason=f"torch {torch.__version__}: compiling the unrolled solve takes over 10 minutes")


@pytest.fixture
def rng():
    """A seeded generator, so each test's random data is reproducible on its own."""
    return torch.Generator().manual_seed(1234)


def word_dictionary(n_words: int):
    """A fairseq ``Dictionary`` of the special symbols and ``w0 ... w{n_words - 1}``."""
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(n_words):
        dictionary.add_symbol(f"w{i}")
    return dictionary


@contextlib.contextmanager
def recorded_solves():
    """Within the block, every sorted soft top-k solve of the beam search (the adaptive window's, or the static
    window's) appends its ``SolverInfo`` to the yielded list (the operators themselves run unchanged)."""
    from unittest import mock

    from fairseq_softtopk.modules import beam_selection
    from fairseq_softtopk.ops import sorted_soft_topk, sorted_soft_topk_window

    infos = []

    def recording(*args, **kwargs):
        out, info = sorted_soft_topk(*args, **kwargs)
        infos.append(info)
        return out, info

    def recording_window(*args, **kwargs):
        ranks, index, info = sorted_soft_topk_window(*args, **kwargs)
        infos.append(info)
        return ranks, index, info

    with mock.patch.object(beam_selection, "sorted_soft_topk", recording), \
            mock.patch.object(beam_selection, "sorted_soft_topk_window", recording_window):
        yield infos


@pytest.fixture
def repo_root() -> Path:
    return REPO


def clean_env() -> dict:
    """A minimal environment for fairseq subprocesses: nothing inherited that changes loading."""
    import os

    # PYTHONPATH stays: on some machines fairseq itself is installed through it
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH") if key in os.environ}
    env["OMP_NUM_THREADS"] = "1"  # tests share two cores
    return env


def run_fairseq(tool: str, args, cwd=None, check=True):
    """Runs ``python -m fairseq_cli.<tool> *args`` (no ``--user-dir`` added) in a clean environment;
    returns the process."""
    import subprocess

    from fairseq_softtopk.experiments.fairseq_commands import fairseq_command

    cmd = fairseq_command(tool, args, user_dir=False)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def toy_data_bin(tmp_path_factory):
    """A small toy corpus, binarised with a joined dictionary: ``(raw_dir, data_bin)``."""
    from fairseq_softtopk.experiments.fairseq_commands import binarize_generated_corpus

    root = tmp_path_factory.mktemp("toy")
    data_bin = binarize_generated_corpus(root, splits={"train": (400, 11), "valid": (40, 12), "test": (40, 13)},
                                   joined_dictionary=True)
    return root / "raw", data_bin


def pytest_runtest_logreport(report):
    """With ``SOFTTOPK_FAILURE_LOG`` set (gpu_check does), each failure's traceback is appended to that
    file as it happens: on a lent GPU machine a run stopped at its time limit keeps its failures,
    which pytest prints only at the end (with pytest-xdist this runs in the controller)."""
    import os

    path = os.environ.get("SOFTTOPK_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # once, by the controller
        with open(path, "a") as log:
            log.write(f"\n===== {report.nodeid} ({report.when}) FAILED =====\n{report.longreprtext}\n")


def overwrite_tensor_bytes(path) -> str:
    """Overwrites 16 bytes in the middle of the largest tensor of the torch checkpoint at ``path`` (a zip
    archive), keeping its size: the member's CRC-32 no longer matches, which torch does not check (the file
    loads). Returns the member's name."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        member = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    data = bytearray(Path(path).read_bytes())
    header = member.header_offset  # the local header: 30 bytes, then the name and its own extra field
    name_length = int.from_bytes(data[header + 26:header + 28], "little")
    extra_length = int.from_bytes(data[header + 28:header + 30], "little")
    start = header + 30 + name_length + extra_length + member.compress_size // 2
    data[start:start + 16] = bytes(b ^ 0xFF for b in data[start:start + 16])
    Path(path).write_bytes(bytes(data))
    return member.filename
