"""A stand-in training worker for the multi-node tests (no torch needed).

Prints one line with its environment contract, then behaves as told by flags:
  --pid-dir DIR        write DIR/rank<RANK>_try<RESTART>.pid (so a test can SIGKILL it)
  --sleep-try N:S      sleep S seconds when TORCHELASTIC_RESTART_COUNT == N
  --sleep-single S     sleep S seconds while this job has a single node (scale-up tests)
  --fail RANK:TRY:CODE exit with CODE (after a line on stderr) as RANK in restart TRY
"""
import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--pid-dir")
p.add_argument("--sleep-try", action="append", default=[])
p.add_argument("--sleep-single", type=float, default=0)
p.add_argument("--fail", action="append", default=[])
a = p.parse_args()

env = os.environ
rank = int(env["RANK"])
attempt = int(env["TORCHELASTIC_RESTART_COUNT"])
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"]
print("ENV " + " ".join(f"{k}={env.get(k, '')}" for k in keys), flush=True)
if a.pid_dir:
    path = os.path.join(a.pid_dir, f"rank{rank}_try{attempt}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
for spec in a.fail:
    r, t, code = (int(x) for x in spec.split(":"))
    if r == rank and t == attempt:
        print(f"worker rank {rank}: simulated failure (code {code})", file=sys.stderr, flush=True)
        sys.exit(code)
for spec in a.sleep_try:
    t, s = spec.split(":")
    if int(t) == attempt:
        time.sleep(float(s))
if a.sleep_single and int(env["GROUP_WORLD_SIZE"]) == 1:
    time.sleep(a.sleep_single)
sys.exit(0)
