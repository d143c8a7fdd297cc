"""The commands: every console script of pyproject.toml is a module of fairseq_softtopk.cli with a callable
``main(argv=None)`` that also runs as ``python -m``; the thin entry points under scripts/ run them; scripts
import helpers from the package, never from the files next to them; the package's import (fairseq's
--user-dir) stays light."""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env


def console_scripts():
    """``{name: (module, function)}`` of pyproject.toml's ``[project.scripts]``."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("\n[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    entries = dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"\s*$', section, re.M))
    return {name: tuple(target.split(":")) for name, target in entries.items()}


def checkout_env() -> dict:
    """A clean environment whose PYTHONPATH starts with this checkout, so that its package is the one run."""
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


SCRIPTS = console_scripts()


def test_the_commands_are_declared():
    assert set(SCRIPTS) >= {"fairseq-softtopk-options", "fairseq-softtopk-main-job", "fairseq-softtopk-ablation",
                            "fairseq-softtopk-bleu"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_script_names_a_cli_module_with_a_callable_main(name):
    module_name, function = SCRIPTS[name]
    assert module_name.startswith("fairseq_softtopk.cli.") and function == "main", (name, module_name, function)
    main = getattr(importlib.import_module(module_name), function)
    assert callable(main)
    argv = inspect.signature(main).parameters.get("argv")
    assert argv is not None and argv.default is None, f"{module_name}.main takes argv=None"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_script_runs_as_python_m_from_anywhere(name, tmp_path):
    module_name = SCRIPTS[name][0]
    proc = subprocess.run([sys.executable, "-m", module_name, "--help"], capture_output=True, text=True,
                          env=checkout_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: ")


@pytest.mark.parametrize("script, module_name", [("run_main_job.py", "fairseq_softtopk.cli.main_job"),
                                                 ("ablation.py", "fairseq_softtopk.cli.ablation")])
def test_the_entry_points_under_scripts_run_their_commands(script, module_name, tmp_path):
    """From another directory and without PYTHONPATH (--help imports neither torch nor fairseq): the script
    finds its own checkout's package itself, as from a pinned git worktree."""
    path = REPO / "scripts" / script
    assert module_name in path.read_text(encoding="utf-8")
    env = {key: value for key, value in clean_env().items() if key != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {script} ")


def test_the_main_job_outside_a_clone_says_it_needs_one(tmp_path, monkeypatch, capsys):
    """An installed package without the repository around it (no configs/): a plain error, no traceback."""
    from fairseq_softtopk.cli import main_job

    monkeypatch.setattr(main_job, "REPO", tmp_path)
    monkeypatch.setattr(main_job, "CONFIG", tmp_path / "configs" / "demo_finetune.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--work-dir", str(tmp_path / "work")])
    assert exit_info.value.code == 2
    assert "clone of the repository" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_importing_the_plugin_loads_neither_the_experiments_nor_the_commands():
    code = ("import sys, fairseq, fairseq_softtopk; "
            "print(sorted(m for m in sys.modules if m.startswith(('fairseq_softtopk.experiments', "
            "'fairseq_softtopk.cli'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=checkout_env(),
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def _script_files():
    return sorted((REPO / "scripts").rglob("*.py"))


def _imported_top_level_names(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


@pytest.mark.parametrize("path", _script_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_script_imports_a_module_next_to_it(path):
    """Helpers live in the package: a script's directory is not a place to import from."""
    siblings = {p.stem for p in path.parent.glob("*.py") if p != path} | {
        p.name for p in path.parent.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    imported = set(_imported_top_level_names(ast.parse(path.read_text(encoding="utf-8"))))
    assert not imported & siblings, f"{path.relative_to(REPO)} imports {sorted(imported & siblings)} from its directory"
    assert not (path.parent / "__init__.py").exists()  # not a package either


@pytest.mark.parametrize("path", _script_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_script_that_imports_the_package_puts_its_own_checkout_first(path):
    """Run as a file from a pinned git worktree, a script imports that worktree's package, not the editable
    install's: a module-level ``sys.path.insert(0, ...)`` comes before its first import of the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inserted = False
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func) == "sys.path.insert":
            inserted = True
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(name.split(".")[0] == "fairseq_softtopk" for name in names):
            assert inserted, f"{path.relative_to(REPO)}: fairseq_softtopk imported before its checkout is on sys.path"
            return


def test_no_script_is_named_after_an_importable_module():
    """scripts/evaluate.py was named like PyPI's ``evaluate``: whichever came first on sys.path won."""
    import importlib.util

    scripts = (REPO / "scripts").resolve()
    for path in _script_files():
        spec = importlib.util.find_spec(path.stem)
        # a script that a test loaded (conftest.script_module) is found as itself
        assert spec is None or scripts in Path(spec.origin).resolve().parents, (path, spec.origin)


def test_the_package_list_includes_the_subpackages():
    """pyproject's [tool.setuptools.packages.find] pattern, applied to this checkout."""
    setuptools = pytest.importorskip("setuptools")

    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[([^\]]*)\]", text).group(1)
    patterns = re.findall(r'"([^"]+)"', include)
    packages = setuptools.find_packages(where=str(REPO), include=patterns)
    assert {"fairseq_softtopk", "fairseq_softtopk.cli", "fairseq_softtopk.experiments"} <= set(packages)
