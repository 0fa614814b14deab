#!/usr/bin/env bash
# A shell test's skip under cmake/testing.cmake's protocol: records CASE's skip in
# $LAUNCH_SKIP_FILE and exits 77, which CTest reports as "Skipped".
#   tests/skip.sh setup|env CASE REASON...
# Registered in place of a test that cannot run here (tests/CMakeLists.txt: clang missing).
set -euo pipefail
if [ $# -lt 3 ] || { [ "$1" != setup ] && [ "$1" != env ]; }; then
  echo "usage: tests/skip.sh setup|env CASE REASON..." >&2
  exit 2
fi
kind=$1 case=$2
shift 2
echo "skipped: [$kind] $case: $*"
if [ -n "${LAUNCH_SKIP_FILE:-}" ]; then
  mkdir -p "$(dirname "$LAUNCH_SKIP_FILE")"
  printf '%s\t%s\t%s\n' "$kind" "$case" "$*" >"$LAUNCH_SKIP_FILE"
fi
exit 77
