#!/usr/bin/env bash
# Create or reuse the virtualenv at .venv/ and install the pinned dependencies.
# Idempotent: a stamp holding the hash of the dependency files skips a finished install.
# About 1.5 minutes on a fresh machine here (torch comes from local disk, the rest, triton's 286 MB wheel
# included, from PyPI).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${root}/.venv"
python="${PYTHON:-python3.11}"
command -v "${python}" >/dev/null 2>&1 || python=python3

stamp_value="$(cat "${root}/constraints.txt" "${root}/requirements.txt" "${root}/pyproject.toml" | sha256sum | cut -d' ' -f1)"
stamp_file="${venv}/.fairseq_softtopk_installed"
if [[ -f "${stamp_file}" && "$(cat "${stamp_file}")" == "${stamp_value}" ]]; then
    exit 0
fi

echo "[setup] creating/updating ${venv} (one-time, about 1.5 minutes)" >&2
[[ -x "${venv}/bin/python" ]] || "${python}" -m venv "${venv}"
pip=("${venv}/bin/python" -m pip install --quiet --disable-pip-version-check -c "${root}/constraints.txt")
# torch first, alone: the CPU build 2.13.0 lies on this machine's disk. A torch >= 2.6 already in the
# virtualenv (say a CUDA build installed there first) is kept: nothing below installs torch then.
if "${venv}/bin/python" -c "import sys, torch; sys.exit(0 if tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]) >= (2, 6) else 1)" 2>/dev/null; then
    echo "[setup] keeping the virtualenv's torch $("${venv}/bin/python" -c 'import torch; print(torch.__version__)')" >&2
    "${pip[@]}" numpy cython
else
    "${pip[@]}" torch numpy cython
fi
# fairseq main-branch build for Python 3.11, without its declared deps (torchaudio would pull another torch).
"${pip[@]}" --no-deps ve-fairseq
"${pip[@]}" -r "${root}/requirements.txt"
# the [dev] extra (tests, figures, sparse attention, the Hugging Face adapters, the wheel and sdist tools); entmax without
# its declared dependency, torch, which the constraints pin: a CUDA torch kept above must not be replaced by the pinned CPU one
"${pip[@]}" pytest pytest-xdist pyflakes matplotlib cvxpy transformers accelerate build twine
"${pip[@]}" --no-deps entmax
# triton (the dev extra; the operators' kernels, tested on the CPU under its interpreter): the pinned one,
# unless the virtualenv has one already: a CUDA torch depends on the triton it was built with
if "${venv}/bin/python" -c "import triton" 2>/dev/null; then
    echo "[setup] keeping the virtualenv's triton $("${venv}/bin/python" -c 'import triton; print(triton.__version__)')" >&2
else
    "${pip[@]}" triton
fi
# the oldest triton the kernels support, beside it (not importable from the virtualenv): the tests compile every
# kernel with it too (tests/test_oldest_triton.py); the constraints pin the newest, hence no -c here
oldest_triton="$(sed -n 's/^# oldest supported: triton==//p' "${root}/constraints.txt")"
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "${venv}/triton-oldest" "triton==${oldest_triton}"
# the build backend of the editable install (pyproject's build-system: setuptools >= 77, the first that reads an SPDX
# license); --no-build-isolation takes the virtualenv's, which a kept older torch may have left older
"${pip[@]}" setuptools
"${pip[@]}" --no-deps --no-build-isolation -e "${root}"
"${venv}/bin/python" -c "import torch, fairseq, fairseq_softtopk; print('[setup] torch', torch.__version__, 'fairseq', fairseq.__version__)" >&2
echo "${stamp_value}" > "${stamp_file}"
