"""The package as users install it: real installs into a clean virtualenv, the sdist and the wheel.

One virtualenv for the module (``python -m venv --without-pip``, no system site packages: this environment's pip
installs into it with ``--python``, which saves seeding pip there): torch first (the suite's own build,
from wherever this machine's pip finds it: a local wheel here), then ``pip install <checkout>``, which must add
numpy and the package and nothing else; the operators run there, and the fairseq plugin says how to install it.
Then fairseq's fork (``--no-deps``) and the ``[fairseq]`` extra in the same virtualenv: the plugin registers its
criterion and models. The sdist and the wheel are built with ``python -m build`` (the wheel from the sdist) and
checked with ``twine check``. Installs use ``--no-compile`` (the files are byte-compiled on first import instead:
torch's install takes 20 s instead of 47 s here). A registry that cannot be reached skips the tests that need it,
with pip's reason; any other pip failure fails them. Helpers: ``packaging_harness.py``.
"""

import email.parser
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, clean_env
from packaging_harness import (FORK, copy_checkout, dist_name, installed, memory_backed_dir, package_version, pip_env,
                               pip_for, pip_install, pyproject, run_in)

@pytest.fixture(scope="module")
def scratch():
    """A directory for this module's virtualenv, source copies and builds, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="fairseq_softtopk_packaging_", dir=memory_backed_dir()))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def clean_venv(scratch):
    """``(python, baseline)``: a new virtualenv with the suite's torch build installed, and its distributions."""
    import torch

    root = scratch / "clean_venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    # the same build as the suite's (2.13.0+cpu: a local wheel here); a GPU machine's build may be on no index
    try:
        pip_install(python, f"torch=={torch.__version__}")
    except AssertionError as error:
        if f"No matching distribution found for torch=={torch.__version__}" not in str(error):
            raise
        pytest.skip(f"pip finds no wheel of this suite's torch build, {torch.__version__}")
    return python, installed(python, root)


@pytest.fixture(scope="module")
def ops_install(clean_venv, scratch):
    """``(python, before, after)``: ``pip install <checkout>`` into the clean virtualenv, with the distributions
    before and after it."""
    python, before = clean_venv
    source = copy_checkout(scratch / "ops_source")
    pip_install(python, "-c", str(REPO / "constraints.txt"), str(source))
    return python, before, installed(python, source.parent)


def test_installing_the_package_adds_numpy_and_nothing_else(ops_install):
    python, before, after = ops_install
    assert "torch" in before and "fairseq-softtopk" not in before
    assert set(after) - set(before) == {"fairseq-softtopk", "numpy"}
    assert {name: after[name] for name in before} == before  # nothing upgraded, downgraded or removed
    assert after["fairseq-softtopk"] == package_version()


OPS_CHECK = """
    import json, sys
    import torch
    import fairseq_softtopk
    from fairseq_softtopk import __version__
    from fairseq_softtopk.ops import soft_topk, sorted_soft_topk, sparse_soft_topk
    from fairseq_softtopk.search import BeamSearchConfig, beam_search

    scores = torch.tensor([[0.3, 2.0, -1.0, 1.5, 0.9, -0.2], [1.0, -2.0, 0.5, 3.0, 2.5, 0.0]], dtype=torch.float64)
    hard = torch.zeros_like(scores).scatter_(1, torch.topk(scores, 2).indices, 1.0)  # the hard top-2 indicator
    smooth = soft_topk(scores, k=2, epsilon=1.0)
    result = {
        "file": fairseq_softtopk.__file__, "version": __version__,
        "near_hard": (soft_topk(scores, k=2, epsilon=1e-3) - hard).abs().max().item(),
        "sparse_near_hard": (sparse_soft_topk(scores, k=2, regularization=1e-3) - hard).abs().max().item(),
        "sorted_ranks": sorted_soft_topk(scores, k=2, epsilon=1e-3).argmax(dim=1).tolist(),
        "smooth_row_sums": smooth.sum(dim=1).tolist(), "smooth_min": smooth.min().item(), "smooth_max": smooth.max().item(),
    }
    for name in ("fairseq_softtopk.criterions", "fairseq_softtopk.models"):
        try:
            __import__(name)
        except ImportError as error:
            result[name] = [type(error).__name__, str(error)]
    try:
        fairseq_softtopk.register()
    except ImportError as error:
        result["register"] = [type(error).__name__, str(error)]
    result["fairseq_imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "hydra", "omegaconf"))
    print(json.dumps(result))
"""


def test_the_operators_run_and_the_plugin_names_its_install_without_fairseq(ops_install, tmp_path):
    python, _, _ = ops_install
    result = run_in(python, OPS_CHECK, tmp_path)
    assert Path(result["file"]).is_relative_to(python.parents[1]) and result["version"] == package_version()
    # epsilon (regularization) -> 0 gives the hard top-k indicator; at epsilon = 1 rows still sum to k, inside (0, 1)
    assert result["near_hard"] < 1e-6 and result["sparse_near_hard"] < 1e-6
    assert result["sorted_ranks"] == [[1, 3], [3, 4]]  # the index of rank r's element: the hard sorted top-2
    assert result["smooth_row_sums"] == pytest.approx([2.0, 2.0], abs=1e-4)
    assert 0.0 < result["smooth_min"] and result["smooth_max"] < 1.0
    for part in ("fairseq_softtopk.criterions", "fairseq_softtopk.models", "register"):
        kind, message = result[part]
        assert kind == "MissingExtraError", (part, message)
        assert f"pip install {FORK} --no-deps" in message and 'pip install "fairseq-softtopk[fairseq]"' in message
    assert result["fairseq_imported"] == []


@pytest.mark.parametrize("command, extra", [("fairseq-softtopk-options", "fairseq"),
                                            ("fairseq-softtopk-bleu", "experiments")])
def test_the_commands_name_the_extra_they_need(ops_install, tmp_path, command, extra):
    python, _, _ = ops_install
    args = ["data-bin", "checkpoint.pt", "--ref", "ref.txt"] if command.endswith("bleu") else []
    proc = subprocess.run([str(python.parent / command), *args], capture_output=True, text=True, cwd=tmp_path,
                          env={key: value for key, value in clean_env().items() if key != "PYTHONPATH"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"{command}: error: this command needs ")
    assert f'pip install "fairseq-softtopk[{extra}]"' in proc.stderr and f"pip install {FORK} --no-deps" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_command_names_only_the_install_that_is_missing(repo_root):
    """With fairseq there and one package of the experiments missing (hidden here), the command names the extra
    and that package, not the fork; the library check says the same as an ImportError."""
    code = textwrap.dedent("""
        import sys

        class Hidden:  # a meta path finder that hides sacremoses
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "sacremoses":
                    raise ImportError(f"{name} is hidden by the test")

        sys.meta_path.insert(0, Hidden())
        from fairseq_softtopk.extras import MissingExtraError, require_extra
        try:
            require_extra("experiments", "the scoring")
        except MissingExtraError as error:
            print("ERROR:", error)
        from fairseq_softtopk.cli.bleu import main
        main(["data-bin", "checkpoint.pt", "--ref", "ref.txt"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root, env=clean_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.strip() == ('ERROR: the scoring needs the [experiments] extra; not installed: sacremoses. '
                                   'Install with: pip install "fairseq-softtopk[experiments]"')
    assert proc.stderr.strip().endswith('error: this command needs the [experiments] extra; not installed: sacremoses. '
                                        'Install with: pip install "fairseq-softtopk[experiments]"')
    assert "Traceback" not in proc.stderr

PLUGIN_CHECK = """
    import json
    import fairseq  # first, as fairseq-train does: importing the package then registers the plugin
    import fairseq_softtopk
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
    print(json.dumps({"criteria": sorted(CRITERION_REGISTRY), "models": sorted(MODEL_REGISTRY),
                      "archs": sorted(ARCH_MODEL_REGISTRY), "file": fairseq_softtopk.__file__}))
"""


@pytest.mark.skipif(sys.version_info[:2] not in ((3, 11), (3, 12)), reason="fairseq's fork has wheels for "
                    "CPython 3.11 and 3.12 only")
def test_the_fork_and_the_fairseq_extra_make_the_plugin_register(ops_install, tmp_path):
    """The two commands that the errors name, in the virtualenv of the tests above (the extra of the installed
    package: pip reads it from the installed metadata); then `pip check` finds nothing missing but what the fork
    declares and does not need (torchaudio; cffi and cython, which built its extensions)."""
    python, _, _ = ops_install
    pip_install(python, "--no-deps", FORK)
    pip_install(python, "-c", str(REPO / "constraints.txt"), "fairseq-softtopk[fairseq]")
    result = run_in(python, PLUGIN_CHECK, tmp_path)
    assert Path(result["file"]).is_relative_to(python.parents[1])
    assert {"soft_beam_search", "beamgrad_risk"} <= set(result["criteria"])
    assert {"softtopk_lstm", "softtopk_transformer"} <= set(result["models"])
    assert {"softtopk_lstm", "softtopk_lstm_tiny", "softtopk_transformer_tiny"} <= set(result["archs"])
    check = subprocess.run(pip_for(python, "check"), capture_output=True, text=True, env=pip_env())
    problems = [line for line in check.stdout.splitlines() if line.strip()]
    unmet = {re.match(r"ve-fairseq 0\.12\.3 requires ([\w-]+)", line).group(1).lower() for line in problems
             if line.startswith("ve-fairseq 0.12.3 requires ")}
    assert len(unmet) == len(problems) and unmet <= {"torchaudio", "cffi", "cython"}, check.stdout


@pytest.fixture(scope="module")
def dists(scratch):
    """``(sdist, wheel)`` that ``python -m build`` makes of the checkout (the wheel from the sdist), in this
    environment (``--no-isolation``: its setuptools, no download)."""
    pytest.importorskip("build", reason="the release tools: pip install -e '.[dev]'")
    source = copy_checkout(scratch / "build_source")
    out = source.parent / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, env=pip_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "deprecated" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
    sdist, = out.glob("*.tar.gz")
    wheel, = out.glob("*.whl")
    return sdist, wheel


def test_twine_accepts_the_sdist_and_the_wheel(dists):
    pytest.importorskip("twine", reason="the release tools: pip install -e '.[dev]'")
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)],
                          capture_output=True, text=True, env=pip_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2


def test_the_wheel_metadata_declares_the_version_the_extras_and_the_platforms(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    assert metadata["Version"] == package_version() and wheel.name == f"fairseq_softtopk-{package_version()}-py3-none-any.whl"
    assert metadata["Requires-Python"] == ">=3.11"
    assert set(metadata.get_all("Provides-Extra")) == {"fairseq", "experiments", "plot", "sparse-attention", "hf",
                                                       "dev"}
    requires = metadata.get_all("Requires-Dist")
    assert {dist_name(r) for r in requires if "extra ==" not in r} == {"torch", "numpy"}
    fairseq_extra = {dist_name(r) for r in requires if r.endswith('extra == "fairseq"')}
    assert {"hydra-core", "omegaconf", "bitarray", "regex", "sacrebleu", "scikit-learn"} <= fairseq_extra
    assert not fairseq_extra & {"torchaudio", "ve-fairseq", "fairseq"}
    classifiers = metadata.get_all("Classifier")
    assert {"Programming Language :: Python :: 3.11", "Programming Language :: Python :: 3.12",
            "Operating System :: POSIX :: Linux"} <= set(classifiers)
    assert metadata["License-Expression"] == "MIT"


def test_the_sdist_holds_what_the_wheel_is_built_from(dists):
    """Every file of the wheel's package comes from the sdist unchanged, and every module of the checkout's
    package is in the wheel."""
    sdist, wheel = dists
    with tarfile.open(sdist) as archive:
        root = archive.getnames()[0].split("/")[0]
        sdist_files = {m.name[len(root) + 1:]: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}
    with zipfile.ZipFile(wheel) as archive:
        wheel_files = {n: archive.read(n) for n in archive.namelist() if n.startswith("fairseq_softtopk/")}
    assert wheel_files and all(sdist_files.get(n) == data for n, data in wheel_files.items())
    checkout = {p.relative_to(REPO).as_posix() for p in (REPO / "fairseq_softtopk").rglob("*.py")}
    assert checkout <= set(wheel_files)
    assert {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "CITATION.cff"} <= set(sdist_files)


def _expanded(extra: str, extras: dict) -> set:
    """The distribution names that ``extra`` brings, its references to other extras of the package followed."""
    names = set()
    for requirement in extras[extra]:
        if dist_name(requirement) == "fairseq-softtopk":
            for other in re.search(r"\[(.*)\]", requirement).group(1).split(","):
                names |= _expanded(other.strip(), extras)
        else:
            names.add(dist_name(requirement))
    return names


def test_the_modules_checked_for_each_extra_are_what_it_installs():
    """fairseq_softtopk.extras checks import names; each is installed by its extra (or is the fork), and each
    package of the extra beyond the base dependencies is checked."""
    from importlib.metadata import packages_distributions

    from fairseq_softtopk.extras import EXTRA_MODULES

    project = pyproject()["project"]
    base = {dist_name(r) for r in project["dependencies"]}
    providers = packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        installed_by = {dist_name(providers[module][0]) for module in modules}
        assert installed_by == (_expanded(extra, project["optional-dependencies"]) - base) | {"ve-fairseq"}, extra


def test_setup_venv_installs_and_pins_the_dev_extra():
    """scripts/setup_venv.sh (make test, make demo) installs every package of the dev extra, each pinned in
    constraints.txt."""
    extras = pyproject()["project"]["optional-dependencies"]
    wanted = _expanded("dev", extras) | {dist_name(r) for r in pyproject()["project"]["dependencies"]}
    script = (REPO / "scripts" / "setup_venv.sh").read_text(encoding="utf-8")
    installed = {dist_name(word) for line in script.splitlines() if '"${pip[@]}"' in line and not line.startswith("#")
                 for word in line.split() if re.match(r"[A-Za-z]", word)}
    installed |= {dist_name(line) for line in (REPO / "requirements.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#")}
    pinned = {dist_name(line.split("==")[0]) for line in (REPO / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert wanted - installed == set()
    assert wanted - pinned == set()


def test_the_hf_extra_installs_what_the_trainer_example_needs(ops_install, tmp_path):
    """``pip install "fairseq-softtopk[hf]"`` in the virtualenv of the tests above (the extra of the installed
    package, with the pinned versions) brings transformers and accelerate (Seq2SeqTrainer raises ImportError
    without it), and examples/huggingface_trainer.py runs there on the installed package (a copy of the script
    outside the checkout)."""
    python, _, _ = ops_install
    pip_install(python, "-c", str(REPO / "constraints.txt"), "fairseq-softtopk[hf]")
    versions = installed(python, tmp_path)
    assert {"transformers", "accelerate"} <= set(versions), sorted(versions)
    script = tmp_path / "examples" / "huggingface_trainer.py"
    script.parent.mkdir()
    shutil.copy2(REPO / "examples" / "huggingface_trainer.py", script)
    proc = subprocess.run([str(python), "-c", "import runpy, sys, fairseq_softtopk; "
                           "print('package:', fairseq_softtopk.__file__); runpy.run_path(sys.argv[1], run_name='__main__')",
                           str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={key: value for key, value in clean_env().items() if key != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    package = re.search(r"^package: (.*)$", proc.stdout, re.M).group(1)
    assert Path(package).is_relative_to(python.parents[1])
    assert re.search(r"^generate\(num_beams=4\) after: \d+ of 8 right$", proc.stdout, re.M), proc.stdout
