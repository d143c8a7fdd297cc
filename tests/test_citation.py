"""LICENSE and CITATION.cff: present, and README's BibTeX names the same paper and authors."""

import re

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
    version = re.search(r'^version = "(.*)"$', (repo_root / "pyproject.toml").read_text(), re.M).group(1)
    assert cff["version"] == version and "[CITATION.cff](CITATION.cff)" in readme  # the package's citation


def test_license_is_mit_everywhere(repo_root):
    assert (repo_root / "LICENSE").read_text().startswith("MIT License")
    assert 'license = {text = "MIT"}' in (repo_root / "pyproject.toml").read_text()
