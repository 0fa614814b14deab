#!/usr/bin/python3
"""The benchmark part of scripts/bench/gpu (which builds and tests first; see its --help): `train`
(the real `launch` and `train` binaries, one process, `launch --multi_gpu --num_processes 1`, or
`--cpu` with --device cpu) against PyTorch (scripts/bench/gpu_torch_peer.py, same interpreter as
this script) on the same device, row by row, in fp32 and bf16, printed as one table.

Rows (sizes shrink on --device cpu, and step counts with --quick; the workload column says what
ran):
  cnn          configs/quickstart.yaml (Fashion-MNIST, 3 epochs, batch 64), training loop time
               and test accuracy; `train` with --checkpoint_every 0 --save_model never
  mlp          MLP 784-4096-4096-4096-10, Adam, synthetic data, batch 256 and 1024: steps/s
  transformer  `train`'s built-in transformer (d_model 512, 8 layers, 8 heads, context 256,
               batch 32, AdamW) on byte windows of a generated text file: tokens/s
`train`'s rates come from its own metrics.jsonl (step_ms of each step after the warm-up; every
step ends in loss.item(), so each is synchronised), its loop time and accuracy from final.json,
its MFU from an `mfu` field when it writes one (the mean over the timed steps' metrics.jsonl
lines, else final.json's; a value above 1.5 is taken as a percentage).
PyTorch's MFU is `train`'s scaled by the rate ratio (same model, same FLOPs per token)."""

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
PEER = os.path.join(HERE, "gpu_torch_peer.py")
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def sizes(device, quick):
    """Model sizes and step counts: the GPU table's, smaller on the CPU, fewer with --quick."""
    s = {"cnn_epochs": 3, "cnn_max_steps": 0,
         "mlp_layers": [784, 4096, 4096, 4096, 10], "mlp_batches": [256, 1024],
         "mlp_samples": 16384, "mlp_warmup": 20, "mlp_steps": 300,
         "tf": {"d_model": 512, "layers": 8, "heads": 8, "context": 256, "batch": 32},
         "tf_warmup": 10, "tf_steps": 100}
    if device == "cpu":
        s.update(mlp_layers=[784, 256, 256, 256, 10], mlp_samples=4096, mlp_steps=50,
                 tf={"d_model": 64, "layers": 2, "heads": 2, "context": 64, "batch": 8},
                 tf_steps=30)
    if quick and device == "cpu":
        s.update(cnn_max_steps=20, mlp_warmup=2, mlp_steps=5, tf_warmup=2, tf_steps=5)
    elif quick:
        s.update(cnn_max_steps=200, mlp_warmup=5, mlp_steps=30, tf_warmup=3, tf_steps=20)
    return s


def env_for(device):
    e = dict(os.environ)
    if device == "cpu" and "OMP_NUM_THREADS" not in e:
        e["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    return e


def run(cmd, timeout, env):
    """Runs cmd under coreutils `timeout` (TERM, then KILL 15 s later: `launch` stops its workers
    on TERM); returns (exit status, combined output)."""
    full = ["timeout", "-k", "15", str(timeout)] + cmd
    try:
        r = subprocess.run(full, capture_output=True, text=True, env=env, timeout=timeout + 30)
    except subprocess.TimeoutExpired as e:
        return 124, f"{e}"
    return r.returncode, (r.stdout or "") + (r.stderr or "")


def why(rc, out, timeout):
    """One line saying why a run failed: its last line that names an error, else its last line."""
    if rc in (124, 137):
        return f"timed out after {timeout} s"
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    named = [ln for ln in lines if "error" in ln.lower() or "refus" in ln.lower()]
    line = (named or lines or ["(no output)"])[-1]
    return f"exit {rc}: {line[:300]}"


def mean_field(fin, metrics, key):
    """The mean of `key` over the timed steps' metrics lines (the window the rate covers), else
    final.json's `key`; None when neither has it."""
    vals = [m[key] for m in metrics if isinstance(m.get(key), (int, float))]
    if vals:
        return sum(vals) / len(vals)
    return float(fin[key]) if isinstance(fin.get(key), (int, float)) else None


class Bench:
    def __init__(self, a):
        self.a = a
        self.s = sizes(a.device, a.quick)
        self.env = env_for(a.device)
        self.launch = os.path.join(a.bin_dir, "launch")
        self.failures = []  # (row, side, reason) for the notes under the table
        self.tmp = tempfile.mkdtemp(prefix="bench-gpu-")

    # --- train ---------------------------------------------------------------------------------
    def train(self, config, precision, extra, warmup):
        """Runs `train` through `launch` on one process; returns final.json's fields plus
        `rate_steps_per_s` over the steps after `warmup`, or a failure string."""
        with tempfile.TemporaryDirectory(dir=self.tmp) as d:
            out = os.path.join(d, "out")
            if not config.endswith(".yaml"):
                path = os.path.join(d, "cfg.yaml")
                with open(path, "w") as f:
                    f.write(config)
                config = path
            cmd = [self.launch, "--multi_gpu" if self.a.device == "cuda" else "--cpu",
                   "--num_processes", "1"]
            if precision != "fp32":
                cmd += ["--mixed_precision", precision]
            cmd += [config, "--", "--output_dir", out, "--resume", "never"] + extra
            rc, text = run(cmd, self.a.row_timeout, self.env)
            if rc != 0:
                refused = precision != "fp32" and "mixed_precision" in text
                return ("refused: " if refused else "") + why(rc, text, self.a.row_timeout)
            with open(os.path.join(out, "final.json")) as f:
                fin = json.load(f)
            metrics = []
            if os.path.exists(os.path.join(out, "metrics.jsonl")):
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    metrics = [json.loads(ln) for ln in f if ln.strip()]
        timed = [m for m in metrics if m.get("step", 0) > warmup and "step_ms" in m]
        if timed:
            fin["rate_steps_per_s"] = len(timed) / (sum(m["step_ms"] for m in timed) / 1000)
        else:  # no per-step lines: the whole loop, warm-up included
            fin["rate_steps_per_s"] = fin["steps"] / fin["loop_s"]
            fin["rate_note"] = "loop_s incl. warm-up"
        fin["mfu"] = mean_field(fin, timed, "mfu")
        fin["tflops"] = mean_field(fin, timed, "tflops")
        return fin

    # --- PyTorch -------------------------------------------------------------------------------
    def peer(self, args, precision):
        with tempfile.TemporaryDirectory(dir=self.tmp) as d:
            out = os.path.join(d, "result.json")
            cmd = [sys.executable, PEER, "--device", self.a.device, "--out", out] + args
            if precision != "fp32":
                cmd.append("--" + precision)
            env = self.env
            if self.a.torch_ddp:
                cmd.append("--ddp")
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0")
            rc, text = run(cmd, self.a.row_timeout, env)
            if rc != 0:
                return why(rc, text, self.a.row_timeout)
            with open(out) as f:
                return json.load(f)

    # --- rows ----------------------------------------------------------------------------------
    def cnn(self, precision):
        s = self.s
        data = self.a.data_dir
        missing = [f for f in FASHION_FILES if not os.path.exists(os.path.join(data, f))]
        label = ("quickstart CNN, Fashion-MNIST, batch 64, "
                 + (f"{s['cnn_max_steps']} steps" if s["cnn_max_steps"] else
                    f"{s['cnn_epochs']} epochs") + ": loop time")
        if missing:
            reason = f"skipped: {data} lacks {', '.join(missing)} (--data-dir)"
            return {"label": label, "train": reason, "torch": reason}
        extra = ["--checkpoint_every", "0", "--save_model", "never", "--data.path", data,
                 "--epochs", str(s["cnn_epochs"]), "--max_steps", str(s["cnn_max_steps"])]
        ours = self.train(os.path.join(REPO, "configs", "quickstart.yaml"), precision, extra, 0)
        theirs = self.peer(["--workload", "cnn", "--batch", "64", "--data", data,
                            "--epochs", str(s["cnn_epochs"]), "--max_steps",
                            str(s["cnn_max_steps"])], precision)
        row = {"label": label, "unit": "s", "train": ours, "torch": theirs}
        if isinstance(ours, dict):
            ours["value"] = ours["loop_s"]
            ours["accuracy"] = ours.get("eval_accuracy")
        if isinstance(theirs, dict):
            theirs["value"] = theirs["loop_s"]
            theirs["accuracy"] = theirs.get("test_accuracy")
        return row

    def mlp(self, precision, batch):
        s = self.s
        layers = s["mlp_layers"]
        label = (f"MLP {'-'.join(map(str, layers))}, Adam, synthetic, batch {batch}: "
                 "steps/s")
        yaml = f"""
train:
  seed: 42
  model: {{type: mlp, layers: [{', '.join(map(str, layers))}]}}
  data: {{type: synthetic, samples: {s['mlp_samples']}}}
  eval_fraction: 0.0
  batch_size: {batch}
  max_steps: {s['mlp_warmup'] + s['mlp_steps']}
  optimizer: {{type: adam, lr: 1.0e-3}}
  parallel: {{mode: ddp}}
  checkpoint_every: 0
  save_model: never
  log_every: 1000000
"""
        ours = self.train(yaml, precision, [], s["mlp_warmup"])
        theirs = self.peer(["--workload", "mlp", "--layers", ",".join(map(str, layers)),
                            "--samples", str(s["mlp_samples"]), "--batch", str(batch),
                            "--warmup", str(s["mlp_warmup"]), "--steps", str(s["mlp_steps"])],
                           precision)
        if isinstance(ours, dict):
            ours["value"] = ours["rate_steps_per_s"]
        if isinstance(theirs, dict):
            theirs["value"] = theirs["steps"] / theirs["loop_s"]
        return {"label": label, "unit": "steps/s", "train": ours, "torch": theirs}

    def text_file(self):
        """A deterministic 4 MB byte file (words of a small alphabet): the transformer's data,
        large enough that no row runs short of windows."""
        path = os.path.join(self.tmp, "text.txt")
        if not os.path.exists(path):
            rng = random.Random(0)
            words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(1, 9)))
                     for _ in range(2000)]
            parts, size = [], 0
            while size < 4 << 20:
                w = rng.choice(words) + rng.choice("     \n,.")
                parts.append(w)
                size += len(w)
            with open(path, "w") as f:
                f.write("".join(parts))
        return path

    def transformer(self, precision):
        s, t = self.s, self.s["tf"]
        label = (f"transformer d_model {t['d_model']}, {t['layers']} layers, {t['heads']} heads, "
                 f"context {t['context']}, batch {t['batch']}, AdamW: tokens/s")
        text = self.text_file()
        yaml = f"""
train:
  seed: 42
  model:
    type: transformer
    vocab: bytes
    d_model: {t['d_model']}
    layers: {t['layers']}
    heads: {t['heads']}
    context: {t['context']}
    dropout: 0.0
  data: {{type: text, path: {text}, context: {t['context']}}}
  eval_fraction: 0.0
  batch_size: {t['batch']}
  max_steps: {s['tf_warmup'] + s['tf_steps']}
  optimizer: {{type: adamw, lr: 1.0e-3, weight_decay: 0.01}}
  parallel: {{mode: ddp}}
  checkpoint_every: 0
  save_model: never
  log_every: 1000000
"""
        ours = self.train(yaml, precision, [], s["tf_warmup"])
        theirs = self.peer(["--workload", "transformer", "--text", text,
                            "--d_model", str(t["d_model"]), "--blocks", str(t["layers"]),
                            "--heads", str(t["heads"]), "--context", str(t["context"]),
                            "--batch", str(t["batch"]), "--warmup", str(s["tf_warmup"]),
                            "--steps", str(s["tf_steps"])], precision)
        tokens = t["batch"] * t["context"]
        if isinstance(ours, dict):
            ours["value"] = ours["rate_steps_per_s"] * tokens
        if isinstance(theirs, dict):
            theirs["value"] = theirs["tokens"] / theirs["loop_s"]
            for key in ("mfu", "tflops"):  # the same FLOPs per token: scale by the rates
                if isinstance(ours, dict) and ours.get(key) is not None:
                    theirs[key] = ours[key] * theirs["value"] / ours["value"]
        return {"label": label, "unit": "tokens/s", "train": ours, "torch": theirs}

    def rows(self, precision):
        """The rows of one precision, in table order; each a function of no arguments."""
        out = []
        if "cnn" in self.a.only:
            out.append(lambda: self.cnn(precision))
        if "mlp" in self.a.only:
            out += [lambda b=b: self.mlp(precision, b) for b in self.s["mlp_batches"]]
        if "transformer" in self.a.only:
            out.append(lambda: self.transformer(precision))
        return out


def better(row, old, new):
    """The better of two runs of one side: shorter loop time, or higher rate."""
    if not isinstance(new, dict):
        return old if old is not None else new
    if not isinstance(old, dict):
        return new
    if row["unit"] == "s":
        return new if new["value"] < old["value"] else old
    return new if new["value"] > old["value"] else old


def fmt_value(unit, v):
    if unit == "s":
        return f"{v:.2f} s"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def fmt_mfu(v):
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if v <= 1.5 else f"{v:.1f}%"  # a fraction, or already percent


def gpu_name(device):
    if device == "cpu":
        model = "?"
        try:
            with open("/proc/cpuinfo") as f:
                model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
        except (OSError, StopIteration):
            pass
        return f"none (--device cpu): {model}, {len(os.sched_getaffinity(0))} usable cores"
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return "; ".join(ln.strip() for ln in r.stdout.splitlines() if ln.strip()) or "?"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? (nvidia-smi: {e})"


def versions(a):
    r = subprocess.run([os.path.join(a.bin_dir, "train"), "--version"], capture_output=True,
                       text=True)
    train = (r.stdout.strip() or r.stderr.strip() or "?").splitlines()[0]
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                        "torch.version.cuda or 'no CUDA')"], capture_output=True, text=True)
    torch_v = r.stdout.strip() or "?"
    return f"`train`: {train}; PyTorch: {torch_v} ({sys.executable})"


def load_line():
    one, five, fifteen = os.getloadavg()
    line = f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"
    if one > 0.5:
        line += " (WARNING: load > 0.5, timings may be skewed by other work)"
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="few steps: checks the script, not speed")
    ap.add_argument("--repeats", type=int, default=1, help="best of N, the sides interleaved")
    ap.add_argument("--precision", default="both", choices=["both", "all", "fp32", "bf16", "fp16"],
                    help="both: fp32 and bf16; all: fp16 (with loss scaling) too")
    ap.add_argument("--only", default="cnn,mlp,transformer",
                    help="comma-separated rows: cnn, mlp, transformer")
    ap.add_argument("--torch-ddp", action="store_true",
                    help="PyTorch in DDP at world 1 (NCCL; Gloo on the CPU), as the hand-measured "
                    "table; default a plain loop, as `train` runs at world 1")
    ap.add_argument("--bin-dir", default=os.environ.get("LAUNCH_BIN_DIR",
                                                        os.path.join(REPO, "build", "bin")))
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist",
                    help="Fashion-MNIST's four .gz files (the cnn row)")
    ap.add_argument("--row-timeout", type=int, default=600, help="seconds per run of one side")
    a = ap.parse_args()
    a.only = {w.strip() for w in a.only.split(",") if w.strip()}
    a.bin_dir, a.data_dir = os.path.abspath(a.bin_dir), os.path.abspath(a.data_dir)
    precisions = {"both": ["fp32", "bf16"], "all": ["fp32", "bf16", "fp16"]}.get(a.precision,
                                                                                [a.precision])

    bench = Bench(a)
    try:
        report(a, bench, precisions)
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)


def report(a, bench, precisions):
    print(f"device: {gpu_name(a.device)}")
    print(versions(a))
    before = load_line()
    print(f"before: {before}", flush=True)
    results = []  # (precision, row)
    for p in precisions:
        for make in bench.rows(p):
            best = None
            for i in range(a.repeats):
                row = make()
                # The numbers as they come, so that a run cut short by its deadline still reports.
                print(f"  ran: {p} {row['label']}: train {row['train']} torch {row['torch']}",
                      flush=True)
                if best is None:
                    best = row
                else:
                    best["train"] = better(best, best["train"], row["train"])
                    best["torch"] = better(best, best["torch"], row["torch"])
            results.append((p, best))
    after = load_line()

    peer = "DDP at world 1 over " + ("NCCL" if a.device == "cuda" else "Gloo") \
        if a.torch_ddp else "a plain loop"
    print(f"\n`train`: launch {'--multi_gpu' if a.device == 'cuda' else '--cpu'} "
          f"--num_processes 1; PyTorch: {peer}, data on the {a.device.upper()}; "
          f"best of {a.repeats}{'; --quick (checks the script, not speed)' if a.quick else ''}")
    print(f"before: {before}\nafter:  {after}\n")
    print("| workload | precision | `train` | PyTorch | train/PyTorch | accuracy train / PyTorch "
          "| MFU train / PyTorch |")
    print("|---|---|---:|---:|---:|---:|---:|")
    notes, failed = [], False
    for p, row in results:
        cells = []
        for side in ("train", "torch"):
            r = row[side]
            if isinstance(r, dict):
                cells.append(fmt_value(row.get("unit", ""), r["value"]))
                continue
            tag = r.split(":", 1)[0] if r.startswith(("refused", "skipped")) else "failed"
            cells.append(tag)
            failed |= tag == "failed"  # a refusal or a skip says why, and is no failure
            if side == "torch" and r == row["train"]:  # one reason for both sides
                notes[-1] = notes[-1].replace("`train`: ", "both: ", 1)
                continue
            name = "`train`" if side == "train" else "PyTorch"
            notes.append(f"{p} {row['label']}, {name}: {r}")
        o, t = row["train"], row["torch"]
        ratio = acc = "-"
        if isinstance(o, dict) and isinstance(t, dict):
            x = t["value"] / o["value"] if row["unit"] == "s" else o["value"] / t["value"]
            ratio = f"{x:.2f}x"
            if o.get("accuracy") is not None and t.get("accuracy") is not None:
                acc = f"{o['accuracy']:.4f} / {t['accuracy']:.4f}"
        mfu = "-"
        theirs = t if isinstance(t, dict) else {}
        if isinstance(o, dict) and o.get("mfu") is not None:
            mfu = f"{fmt_mfu(o['mfu'])} / {fmt_mfu(theirs.get('mfu'))}"
        elif isinstance(o, dict) and o.get("tflops") is not None:  # no peak known: TFLOP/s
            mfu = f"{o['tflops']:.1f} / " + (f"{theirs['tflops']:.1f}" if "tflops" in theirs
                                             else "-") + " TFLOP/s"
        print(f"| {row['label']} | {p} | {cells[0]} | {cells[1]} | {ratio} | {acc} | {mfu} |")
    print("\ntrain/PyTorch: throughput ratio (> 1: `train` faster; for loop times PyTorch's over "
          "`train`'s). MFU: `train`'s own `mfu` field (its `tflops` in TFLOP/s when it writes no "
          "mfu), \"-\" when it writes neither; PyTorch's is `train`'s scaled by the rate ratio.")
    for n in notes:
        print(f"- {n}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
