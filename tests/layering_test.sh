#!/usr/bin/env bash
# Keeps the module DAG from regressing: base < config < {rendezvous < agent, trainer_runtime} <
# launcher. Fails on any `#include "X/..."` from a module that may not see X (and names it).
# `launch` never links LibTorch, so launcher/ may not include trainer_runtime/ either.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A allowed=(
  [base]="base"
  [config]="base config"
  [rendezvous]="base config rendezvous"
  [agent]="base config rendezvous agent"
  [trainer_runtime]="base config trainer_runtime"
  [launcher]="base config rendezvous agent launcher"
)
modules="base config rendezvous agent trainer_runtime launcher"
bad=0
for module in "${!allowed[@]}"; do
  while IFS= read -r hit; do
    [ -n "$hit" ] || continue
    target=$(sed -E 's/.*#include "([a-z_]+)\/.*/\1/' <<<"$hit")
    case " $modules " in *" $target "*) ;; *) continue ;; esac  # not a module (e.g. a shim path)
    case " ${allowed[$module]} " in
      *" $target "*) ;;
      *) echo "layering: $hit  ($module/ may include only: ${allowed[$module]})"; bad=1 ;;
    esac
  done < <(grep -rnE '^#include "[a-z_]+/' "$module" --include='*.h' --include='*.cc' || true)
done
# config/ must stay cheap to include: no LibTorch, no Asio anywhere in it.
if grep -rnE '#include <(torch|boost|ATen|c10)/' config; then
  echo "layering: config/ must not include LibTorch or Boost"; bad=1
fi
if [ "$bad" = 0 ]; then echo "layering: ok ($modules)"; fi
exit "$bad"
