#!/usr/bin/env bash
# The device check on a GPU/TPU machine that cannot install anything: the one command to run.
#
#   experiments/device_check.sh [BUDGET_S] [extra device_check.py flags]
#
# It needs JAX (with its CUDA or TPU plugin), torch, transformers, flax, optax, orbax, chex,
# numpy and pyarrow on the machine; what marft_jax imports beyond them travels as wheels pinned
# in experiments/device_check_wheels.txt, in the folder experiments/wheels/ next to this script.
# Fill that folder once, on any machine with network access, from the repository root:
#
#   pip download --no-deps -d experiments/wheels -r experiments/device_check_wheels.txt
#
# (pure-Python wheels: any platform's pip fetches the same files). The script installs them into
# a temporary --target directory (never into the machine's environment), puts it and the
# checkout on PYTHONPATH, runs experiments/device_check.py with a budget (default 540 s, which
# leaves a 10-minute slot a minute for start-up) and writes the JSON lines (one per part as it
# ends, then the summary) to experiments/results/device_check-<host>-<UTC time>.jsonl, printing
# the path. The check's own log goes to the .log file beside it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
BUDGET="${1:-540}"
shift || true
PYTHON="${PYTHON:-python3}"
WHEELS="${DEVICE_CHECK_WHEELS:-$HERE/wheels}"

TARGET="$(mktemp -d "${TMPDIR:-/tmp}/marft-device-check.XXXXXX")"
trap 'rm -rf "$TARGET"' EXIT

# The pinned names and versions; blank lines and comments skipped.
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$HERE/device_check_wheels.txt" | grep -v '^$' || true)
if [ "${#PINS[@]}" -gt 0 ]; then
  if [ ! -d "$WHEELS" ]; then
    echo "device_check.sh: no wheel folder $WHEELS; fill it where there is network:" >&2
    echo "  pip download --no-deps -d experiments/wheels -r experiments/device_check_wheels.txt" >&2
    exit 2
  fi
  "$PYTHON" -m pip install --no-index --no-deps --quiet --disable-pip-version-check \
    --find-links "$WHEELS" --target "$TARGET" "${PINS[@]}"
fi

OUT_DIR="$HERE/results"
mkdir -p "$OUT_DIR"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="$OUT_DIR/device_check-$(hostname -s 2>/dev/null || echo host)-$STAMP.jsonl"

cd "$ROOT"
export PYTHONPATH="$ROOT:$TARGET${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "device_check.sh: budget ${BUDGET} s; JSON lines -> $OUT" >&2
# The outer timeout is a backstop: the check skips and stops parts at its own budget.
status=0
timeout --kill-after=10 "$((${BUDGET%.*} + 45))" \
  "$PYTHON" "$HERE/device_check.py" --budget-s "$BUDGET" --out "$OUT" "$@" 2> "${OUT%.jsonl}.log" >/dev/null \
  || status=$?
echo "$OUT"
exit "$status"
