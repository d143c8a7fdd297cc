#!/usr/bin/env bash
# Run the test suite under another Python and the newest torch (or a given one), in a separate
# virtualenv, to verify a Python/torch combination (README, "Verified combinations").
#
#   bash scripts/check_python_torch.sh PYTHON VENV [--torch VERSION] [--fairseq-on-pythonpath DIR] [pytest args]
#
#   PYTHON   the interpreter, e.g. ~/.pyenv/versions/3.12.1/bin/python
#   VENV     where to create (or reuse) the virtualenv; never .venv/ (make test's own)
#   --torch VERSION             torch to install (default: the newest on the index)
#   --fairseq-on-pythonpath DIR install ve-fairseq into DIR (pip --target) instead of the venv and
#                               put DIR on PYTHONPATH, as a machine where fairseq is not pip-installed
#
# Installs without this machine's pip cap on torch (PIP_CONFIG_FILE=/dev/null; PyPI's torch for
# Python != 3.11 is a CUDA build of several GB, which runs on the CPU too), then the runtime
# requirements unpinned (the newest releases), this checkout with --no-deps, and runs pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -ge 2 ]] || { sed -n 5,12p "${BASH_SOURCE[0]}" >&2; exit 2; }
python="$1"; venv="$2"; shift 2
torch_spec="torch"; fairseq_dir=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --torch) torch_spec="torch==$2"; shift 2 ;;
        --fairseq-on-pythonpath) fairseq_dir="$2"; shift 2 ;;
        *) break ;;
    esac
done
[[ -x "$(command -v "${python}")" ]] || { echo "check_python_torch: no interpreter ${python}" >&2; exit 2; }
[[ "$(cd "$(dirname "${venv}")" 2>/dev/null && pwd)/$(basename "${venv}")" != "${root}/.venv" ]] || {
    echo "check_python_torch: ${venv} is make test's .venv; give another directory" >&2; exit 2; }

export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && export PIP_CERT=/etc/ssl/certs/ca-certificates.crt
[[ -x "${venv}/bin/python" ]] || "${python}" -m venv "${venv}"
pip=("${venv}/bin/python" -m pip install --quiet)
# the editable install below runs without build isolation: it needs setuptools and wheel in the venv
# (an older Python's venv has an old setuptools and no wheel: "invalid command 'bdist_wheel'")
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" "${torch_spec}" numpy cython
if [[ -n "${fairseq_dir}" ]]; then
    "${venv}/bin/python" -m pip uninstall --quiet -y ve-fairseq 2>/dev/null || true
    "${pip[@]}" --no-deps --target "${fairseq_dir}" ve-fairseq==0.12.3
    export PYTHONPATH="${fairseq_dir}${PYTHONPATH:+:${PYTHONPATH}}"
else
    "${pip[@]}" --no-deps ve-fairseq==0.12.3
fi
"${pip[@]}" -r "${root}/requirements.txt"
"${pip[@]}" --no-deps --no-build-isolation -e "${root}"
"${venv}/bin/python" -c "import sys, torch, fairseq; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'fairseq', fairseq.__version__, 'from', fairseq.__file__)"
cd "${root}"
exec "${venv}/bin/python" -m pytest -q tests -p no:cacheprovider "$@"
