#!/usr/bin/env bash
# Check the Binder configuration: a fresh virtual environment built only from binder/
# (requirements.txt, then postBuild, as mybinder.org does) runs the quick-start notebook.
#
#   bash binder/check.sh          # PYTHON=python3.11 to pick the interpreter
#
# Not part of `pytest`: it installs torch, pyspark and the rest into a new environment, which
# takes minutes.  The environment lives in a temporary directory and is removed at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/binder-check-XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)

"$PYTHON" -m venv "$work/venv"
export VIRTUAL_ENV="$work/venv" PATH="$work/venv/bin:$PATH"

requirements="$root/binder/requirements.txt"
# mybinder.org reaches the PyTorch CPU index; a machine that cannot (an offline mirror, a
# sandbox) gets the same pinned torch from its own configured pip index instead.
if ! python -c 'import urllib.request; urllib.request.urlopen("https://download.pytorch.org/whl/cpu/", timeout=5)' 2>/dev/null; then
  echo "binder/check.sh: download.pytorch.org is not reachable; torch comes from the configured pip index"
  grep -v '^--extra-index-url' "$requirements" > "$work/requirements.txt"
  requirements="$work/requirements.txt"
fi

echo "binder/check.sh: pip install -r binder/requirements.txt"
pip install --quiet --disable-pip-version-check -r "$requirements"
echo "binder/check.sh: binder/postBuild"
bash "$root/binder/postBuild" >/dev/null
command -v java >/dev/null || echo "binder/check.sh: note: no java on PATH (binder/apt.txt provides it on Binder); the quick start does not need it"

python -c 'import torch; assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, torch.__version__'
echo "binder/check.sh: running notebooks/01-quickstart.ipynb in $(python -c 'import sys; print(sys.prefix)')"
python "$root/notebooks/run_quickstart.py"
echo "binder/check.sh: OK in $(( $(date +%s) - started )) s"
