#!/usr/bin/env bash
# The lock annotations (base/thread_annotations.h) checked for real: the files that use them
# are compiled with clang's -Wthread-safety as errors (the build itself may use g++, which
# ignores the annotations). A member read without its mutex, or a REQUIRES not met, fails here.
#
# trainer_runtime/ files include LibTorch, whose headers take clang ~20 s per file to parse:
# they are parsed once into a precompiled header (the LibTorch includes of trainer_runtime/),
# and the files are checked in parallel. TORCH_INCLUDE_DIRS (':'-separated; CMake passes
# find_package(Torch)'s) names LibTorch's headers, Debian's by default. Without them (a build
# without the trainer) only the files outside trainer_runtime/ are checked, and it says so.
set -euo pipefail
cd "$(dirname "$0")/.."
clangxx=${CLANGXX:-clang++}
# Every .cc that uses the annotations itself or through its own header.
files=$(grep -rlE 'GUARDED_BY|REQUIRES\(|EXCLUDES\(' --include='*.cc' --include='*.h' \
          base agent rendezvous launcher config trainer_runtime |
        sed 's/\.h$/.cc/' | sort -u | while read -r f; do [ -f "$f" ] && echo "$f"; done)
[ -n "$files" ] || { echo "thread-safety: no annotated files"; exit 1; }
# trainer_runtime/util/ is plain C++ (no LibTorch), the rest of trainer_runtime/ is not.
plain=$(echo "$files" | grep -vE '^trainer_runtime/' || true)
plain="$plain $(echo "$files" | grep -E '^trainer_runtime/util/' || true)"
torch=$(echo "$files" | grep -E '^trainer_runtime/' | grep -vE '^trainer_runtime/util/' || true)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-std=c++17 -fsyntax-only -Wthread-safety -Werror=thread-safety -I.)
torch_flags=()
found=
dirs=${TORCH_INCLUDE_DIRS:-/usr/include/torch/csrc/api/include}
for d in ${dirs//:/ }; do
  [ -f "$d/torch/torch.h" ] && found=1
  # The system's own include dir as -isystem breaks libstdc++'s #include_next.
  [ "$d" = /usr/include ] || torch_flags+=(-isystem "$d")
done
if [ -n "$torch" ] && [ -z "$found" ]; then
  echo "thread-safety: no LibTorch headers (TORCH_INCLUDE_DIRS): trainer_runtime/ not checked"
  files=$plain
  torch=
fi
if [ -n "$torch" ]; then
  # As the build compiles them (c10d's headers need the USE_* macros; reducer.hpp the shim).
  torch_flags+=(-DUSE_C10D_GLOO -DUSE_DISTRIBUTED -DUSE_RPC -DUSE_TENSORPIPE
                -D_GLIBCXX_USE_CXX11_ABI=1 -Itrainer_runtime/shim)
  # shellcheck disable=SC2086
  { grep -rhE --include='*.h' '^#include <(torch|ATen|c10)/' trainer_runtime || true
    grep -hE '^#include <(torch|ATen|c10)/' $torch || true; } | sort -u >"$tmp/torch.h"
  "$clangxx" -std=c++17 -x c++-header "${torch_flags[@]}" "$tmp/torch.h" -o "$tmp/torch.pch"
  torch_flags+=(-include-pch "$tmp/torch.pch")
fi

# One clang per file, as many at once as there are CPUs; every failure is printed.
export clangxx
check() { "$clangxx" "$@" || { echo "thread-safety: FAILED ${*: -1}"; return 1; }; }
export -f check
jobs=$(nproc 2>/dev/null || echo 2)
status=0
# shellcheck disable=SC2086
printf '%s\n' $plain | xargs -r -P "$jobs" -I{} bash -c 'check "$@"' _ "${flags[@]}" {} || status=1
# shellcheck disable=SC2086
printf '%s\n' $torch |
  xargs -r -P "$jobs" -I{} bash -c 'check "$@"' _ "${flags[@]}" "${torch_flags[@]}" {} || status=1
[ "$status" = 0 ] || exit 1
echo "thread-safety: ok ($(echo "$files" | wc -w) files)"
