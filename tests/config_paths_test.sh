#!/usr/bin/env bash
# The example configurations point their readers at files of this repository in their comments
# ("see docs/trainer.md#..."): every such path must exist, so a moved or deleted file cannot leave
# a dead reference behind (configs/dp.yaml named a README section that no longer existed).
set -euo pipefail
cd "$(dirname "$0")/.."

bad=0
for config in configs/*.yaml; do
  # Repository paths in comment lines: a known top-level folder, then a path; an #anchor is cut.
  while IFS= read -r path; do
    [ -n "$path" ] || continue
    file=${path%%#*}
    file=${file%[.,;:)]}
    if [ ! -e "$file" ]; then
      echo "config_paths: $config names $file, which does not exist"
      bad=1
    fi
  done < <(grep -E '^\s*#' "$config" |
           grep -oE '\b(base|config|configs|docs|examples|launcher|rendezvous|agent|scripts|tests|trainer_runtime)/[A-Za-z0-9_./#-]+' || true)
done
exit $bad
