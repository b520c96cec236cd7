#!/usr/bin/env bash
# Check the Binder configuration: a fresh virtual environment built only from binder/
# (requirements.txt, then postBuild, as mybinder.org does) runs every notebook.
#
#   bash binder/check.sh                 # PYTHON=python3.11 to pick the interpreter
#   bash binder/check.sh 01 11           # only these notebooks
#
# Not part of `pytest`: it installs torch, pyspark, Lightning, Transformers and the rest into a
# new environment, which takes minutes. The environment and the executed notebooks live in a
# temporary directory, removed at the end; the repository is not changed. Java comes from
# binder/apt.txt on Binder; here it must be on PATH (or JAVA_HOME), else the Spark notebooks
# (02, 07) are left out with a note.
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

python -c 'import torch; assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, torch.__version__'
python -c 'import lightning, transformers, sklearn'

notebooks=("$@")
if [ ${#notebooks[@]} -eq 0 ]; then
  for path in "$root"/notebooks/*.ipynb; do notebooks+=("$(basename "$path")"); done
fi
if ! command -v java >/dev/null && [ -z "${JAVA_HOME:-}" ]; then
  echo "binder/check.sh: note: no java on PATH or JAVA_HOME (binder/apt.txt provides it on Binder): leaving out the Spark notebooks 02-spark and 07-dataframe"
  kept=()
  for name in "${notebooks[@]}"; do
    case "$name" in 02*|07*) ;; *) kept+=("$name") ;; esac
  done
  notebooks=("${kept[@]}")
fi

echo "binder/check.sh: running ${notebooks[*]} in $(python -c 'import sys; print(sys.prefix)')"
python "$root/notebooks/execute.py" --output-dir "$work/executed" "${notebooks[@]}"
echo "binder/check.sh: OK in $(( $(date +%s) - started )) s"
