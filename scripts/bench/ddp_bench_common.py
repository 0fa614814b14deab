"""Shared by the trainer benchmarks: run `train` or a Python worker with 2 ranks under the same
launcher (torchrun by default; `launch` with --launcher launch), OMP_NUM_THREADS=1."""

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def bin_dir():
    return os.environ.get("LAUNCH_BIN_DIR", os.path.join(REPO, "build", "bin"))


def env():
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    return e


def launch_cmd(launcher, nproc, program, args):
    """The command that starts `program args` on `nproc` ranks."""
    if launcher == "launch":
        launch = os.path.join(bin_dir(), "launch")
        if program.endswith(".yaml"):
            return [launch, "--nproc_per_node", str(nproc), program, "--", *args]
        # Debian's interpreter: the python3 on PATH may lack torch.
        return [launch, "--nproc_per_node", str(nproc), "--", "/usr/bin/python3", program, *args]
    cmd = ["/usr/bin/torchrun", "--standalone", "--nproc_per_node", str(nproc),
           "--redirects", "1", "--tee", "1", "--monitor_interval", "0.1"]
    if program.endswith(".yaml"):
        return cmd + ["--no_python", os.path.join(bin_dir(), "train"), program, *args]
    return cmd + [program, *args]


def run(cmd, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"benchmark command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}"
                 f"\n{r.stderr[-3000:]}")
    return r


def train(launcher, nproc, yaml_text, extra=(), timeout=600):
    """Runs `train` on a config; returns final.json plus the metrics lines."""
    # Removed afterwards: each run leaves checkpoints and model files (hundreds of MB).
    with tempfile.TemporaryDirectory(prefix="bench-") as d:
        cfg = os.path.join(d, "cfg.yaml")
        with open(cfg, "w") as f:
            f.write(yaml_text.replace("OUT", os.path.join(d, "out")))
        run(launch_cmd(launcher, nproc, cfg, list(extra)), timeout=timeout)
        with open(os.path.join(d, "out", "final.json")) as f:
            fin = json.load(f)
        with open(os.path.join(d, "out", "metrics.jsonl")) as f:
            fin["metrics"] = [json.loads(line) for line in f if line.strip()]
        return fin


def torch_worker(launcher, nproc, args):
    with tempfile.TemporaryDirectory(prefix="bench-") as d:
        out = os.path.join(d, "result.json")
        run(launch_cmd(launcher, nproc,
                       os.path.join(os.path.dirname(__file__), "ddp_torch_worker.py"),
                       [*args, "--out", out]))
        with open(out) as f:
            return json.load(f)


def python_worker(launcher, nproc, script, args, timeout=600):
    """Runs scripts/bench/`script` on `nproc` ranks with --out; returns what rank 0 wrote there."""
    with tempfile.TemporaryDirectory(prefix="bench-") as d:
        out = os.path.join(d, "result.json")
        run(launch_cmd(launcher, nproc, os.path.join(os.path.dirname(__file__), script),
                       [*args, "--out", out]), timeout=timeout)
        with open(out) as f:
            return json.load(f)


def versions():
    """Which LibTorch `train` links and which PyTorch the peer runs: the tables differ by both."""
    torch_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip() or "?"
    libtorch = "?"
    ldd = subprocess.run(["ldd", os.path.join(bin_dir(), "train")], capture_output=True, text=True)
    for line in ldd.stdout.splitlines():
        if "libtorch_cpu.so" in line:
            libtorch = line.split()[0].replace("libtorch_cpu.so", "").strip(".") or "?"
    return f"train: LibTorch {libtorch}; peer: PyTorch {torch_version}"


def load_line():
    """The 1/5/15-minute load average, with a warning when other work may skew the timings."""
    one, five, fifteen = os.getloadavg()
    line = f"{versions()}; load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"
    if one > 0.5:
        line += " (WARNING: load > 0.5, timings may be skewed by other work)"
    return line


def mlp_yaml(hidden, steps, batch=64, mode="ddp", accum=1, sync_each=False, local_sgd=0,
             cap=25.0):
    return f"""
train:
  output_dir: OUT
  model: {{type: mlp, layers: [784, {hidden}, {hidden}, 10]}}
  data: {{type: synthetic, samples: 8192}}
  eval_fraction: 0.0
  batch_size: {batch}
  max_steps: {steps}
  optimizer: {{type: sgd, lr: 0.01}}
  parallel: {{mode: {mode}, bucket_cap_mb: {cap}}}
  gradient_accumulation_steps: {accum}
  sync_each_batch: {str(sync_each).lower()}
  local_sgd_steps: {local_sgd}
  checkpoint_every: 0
  resume: never
  log_every: 1000000
"""
