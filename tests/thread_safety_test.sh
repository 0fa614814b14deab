#!/usr/bin/env bash
# The lock annotations (base/thread_annotations.h) checked for real: the files that use them
# are compiled with clang's -Wthread-safety as errors (the build itself may use g++, which
# ignores the annotations). A member read without its mutex, or a REQUIRES not met, fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
clangxx=${CLANGXX:-clang++}
# Every .cc that uses the annotations itself or through its own header.
files=$(grep -rlE 'GUARDED_BY|REQUIRES\(|EXCLUDES\(' --include='*.cc' --include='*.h' \
          base agent rendezvous launcher config trainer_runtime/util |
        sed 's/\.h$/.cc/' | sort -u | while read -r f; do [ -f "$f" ] && echo "$f"; done)
[ -n "$files" ] || { echo "thread-safety: no annotated files"; exit 1; }
for f in $files; do
  "$clangxx" -std=c++17 -fsyntax-only -Wthread-safety -Werror=thread-safety -I. "$f"
done
echo "thread-safety: ok ($(echo $files | wc -w) files)"
