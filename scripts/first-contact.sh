#!/usr/bin/env bash
# CI's first-contact check: the README's main command as a new user meets it — a fresh virtualenv with nothing
# but Python (so `pip install` gets the main dependencies only, no test extras), a fresh model cache, and a tiny
# drafter budget (one domain, half a minute). A module the main path imports that only the test or loadtest extras
# install fails here, as it would on a user's first run. It also checks that the long steps report progress when
# stdout is not a terminal.
# Usage: scripts/first-contact.sh [REF]    REF: the commit to check (default: HEAD; commit first); an old commit shows
#                                          what a user met then
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d "${TMPDIR:-/tmp}/cosine-first-contact.XXXXXX")
cleanup() {
  # a cluster the run left (it stops its own; this is for an interrupted run)
  [ -x "$work/venv/bin/python" ] && (cd "$work/src" 2>/dev/null && COSINE_CACHE="$work/cache" "$work/venv/bin/python" -m cosine.cli down >/dev/null 2>&1) || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "==> a fresh clone of ${1:-HEAD} in $work/src"
git clone -q "$root" "$work/src"
git -C "$work/src" checkout -q "${1:-$(git rev-parse HEAD)}"
echo "==> a fresh virtualenv ($(python3 --version)) and a fresh COSINE_CACHE"
python3 -m venv "$work/venv"
log=$work/run.log
started=$(date +%s)
set +e
(cd "$work/src" && PATH="$work/venv/bin:$PATH" PYTHON="$work/venv/bin/python" COSINE_CACHE="$work/cache" \
  COSINE_ZOO_MINUTES=${FIRST_CONTACT_ZOO_MINUTES:-0.5} COSINE_ZOO_DOMAINS=code \
  bash scripts/run.sh "Write a Python function that checks whether a number is prime." < /dev/null 2>&1 | tee "$log")
status=${PIPESTATUS[0]}
set -e
echo "==> the README's main command exited $status after $(( $(date +%s) - started ))s"
[ "$status" -eq 0 ] || { echo "FAIL: the main command failed on a fresh virtualenv"; exit 1; }
for want in "\[cosine zoo prepare\] .* elapsed" "\[cosine zoo build\] .* elapsed" "tokens per pass" "lm-code"; do
  if ! grep -q -- "$want" "$log"; then
    echo "FAIL: the run's output has no line matching '$want'"
    exit 1
  fi
done
echo "first contact: OK"
