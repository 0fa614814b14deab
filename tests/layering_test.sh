#!/usr/bin/env bash
# Keeps the module DAG from regressing: base < config < {rendezvous < agent, trainer_runtime} <
# launcher, and inside trainer_runtime/ the order of its folders (`inner` below: util at the
# bottom, train at the top). Fails on any `#include "X/..."` from a module or folder that may not
# see X (and names it). `launch` never links LibTorch, so launcher/ may not include
# trainer_runtime/ either.
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
    # Bash's own regex: a sed per include line made this check take half a minute.
    [[ $hit =~ \#include\ \"([a-z_]+)/ ]] || continue
    target=${BASH_REMATCH[1]}
    case " $modules " in *" $target "*) ;; *) continue ;; esac  # not a module (e.g. a shim path)
    case " ${allowed[$module]} " in
      *" $target "*) ;;
      *) echo "layering: $hit  ($module/ may include only: ${allowed[$module]})"; bad=1 ;;
    esac
  done < <(grep -rnE '^#include "[a-z_]+/' "$module" --include='*.h' --include='*.cc' || true)
done
# Inside trainer_runtime/, one folder per layer (docs/layout.md): a folder includes only itself
# and the folders below it. Files at trainer_runtime/'s top (its cross-folder tests) may include
# any folder; no header lives there.
declare -A inner=(
  [util]="util"
  [compat]="util compat"
  [comm]="util compat comm"
  [model]="util compat model"
  [data]="util compat data"
  [state]="util compat model state"
  [parallel]="util compat comm model state parallel"
  [api]="util compat comm model data state parallel api"
  [train]="util compat comm model data state parallel api train"
)
folders="util compat comm model data state parallel api train"
while IFS= read -r hit; do
  [ -n "$hit" ] || continue
  file=${hit%%:*}
  [[ $hit =~ \#include\ \"trainer_runtime/([^\"]+)\" ]] || continue
  included=${BASH_REMATCH[1]}
  target=${included%%/*}
  if [ "$target" = "$included" ] || [ -z "${inner[$target]+x}" ]; then
    echo "layering: $hit  (trainer_runtime/ headers live in its folders: $folders)"; bad=1
    continue
  fi
  from=${file#trainer_runtime/}
  from=${from%%/*}
  [ -n "${inner[$from]+x}" ] || continue  # a file at the top, or shim/
  case " ${inner[$from]} " in
    *" $target "*) ;;
    *) echo "layering: $hit  (trainer_runtime/$from/ may include only: ${inner[$from]})"; bad=1 ;;
  esac
done < <(grep -rnE '^#include "trainer_runtime/' trainer_runtime tests examples \
           --include='*.h' --include='*.cc' || true)
# util/ is the trainer's plain C++: it builds and tests without LibTorch.
if grep -rnE '#include <(torch|ATen|c10)/' trainer_runtime/util; then
  echo "layering: trainer_runtime/util/ must not include LibTorch"; bad=1
fi
# LibTorch's versions differ in one place (compat/torch_compat.h): nothing else tests them.
if grep -rnE '^\s*#\s*(el)?if.*TORCH_VERSION' base config rendezvous agent launcher trainer_runtime \
     examples --include='*.h' --include='*.cc' | grep -v '^trainer_runtime/compat/'; then
  echo "layering: only trainer_runtime/compat/ may test LibTorch's version"; bad=1
fi
# config/ must stay cheap to include: no LibTorch, no Asio anywhere in it.
if grep -rnE '#include <(torch|boost|ATen|c10)/' config; then
  echo "layering: config/ must not include LibTorch or Boost"; bad=1
fi
if [ "$bad" = 0 ]; then echo "layering: ok ($modules; trainer_runtime/: $folders)"; fi
exit "$bad"
