"""LICENSE and CITATION.cff: present, README's BibTeX names the same paper and authors, and the version is written once."""

import ast
import re
import tomllib

import yaml


def test_citation_file_and_readme_bibtex_agree(repo_root):
    cff = yaml.safe_load((repo_root / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "MIT"
    paper = cff["preferred-citation"]
    readme = (repo_root / "README.md").read_text()
    bibtex = re.search(r"@inproceedings\{xie2020differentiable,(.*?)\n\}", readme, re.S).group(1)
    assert f"title     = {{{paper['title']}}}" in bibtex
    authors = re.search(r"author\s*=\s*\{(.*?)\},\n", bibtex, re.S).group(1)
    names = [" ".join(name.split()) for name in authors.split(" and ")]
    assert names == [f"{a['family-names']}, {a['given-names']}" for a in paper["authors"]]
    assert re.search(r"year\s*=\s*\{2020\}", bibtex) and paper["year"] == 2020
    assert "[CITATION.cff](CITATION.cff)" in readme  # the package's citation


def _package_version(repo_root) -> str:
    """``__version__`` of the checkout's package, read without importing it."""
    tree = ast.parse((repo_root / "fairseq_softtopk" / "__init__.py").read_text())
    values = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"]]
    assert len(values) == 1, "fairseq_softtopk/__init__.py assigns __version__ once, to a string"
    return values[0]


def test_the_version_is_written_once_and_citation_and_changelog_agree(repo_root):
    """pyproject.toml reads the version from the package (no second copy to forget); CITATION.cff names it, and
    CHANGELOG.md's first released section is that version's."""
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fairseq_softtopk.__version__"}
    version = _package_version(repo_root)
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert str(yaml.safe_load((repo_root / "CITATION.cff").read_text())["version"]) == version
    releases = re.findall(r"^## \[([^\]]+)\]", (repo_root / "CHANGELOG.md").read_text(), re.M)
    assert releases[:1] == ["Unreleased"] and releases[1] == version, releases


def test_license_is_mit_everywhere(repo_root):
    assert (repo_root / "LICENSE").read_text().startswith("MIT License")
    assert tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["license"] == "MIT"
