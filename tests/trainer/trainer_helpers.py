"""Helpers for the trainer's multi-process tests: write a config, start N ranks of `train` with
the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), wait with a hard timeout, and read
metrics.jsonl / final.json / parameter dumps; write tiny MNIST-format (IDX) data sets."""

import json
import os
import random
import re
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import harness  # noqa: E402

TRAIN = harness.TRAIN
LAUNCH = harness.LAUNCH


def _libtorch_major():
    """The major version of the LibTorch `train` was built with ("train 0.1.0 (LibTorch 2.6.0,
    ..."), 0 when `train` is not built."""
    try:
        out = subprocess.run([TRAIN, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except OSError:
        return 0
    m = re.search(r"LibTorch (\d+)\.", out)
    return int(m.group(1)) if m else 0


LIBTORCH_MAJOR = _libtorch_major()


free_port = harness.free_port  # outside the ephemeral range (tests/harness.py)


def write_config(directory, text, name="cfg.yaml"):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def rank_env(rank, world, port, restart=0, extra=None):
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(restart), "OMP_NUM_THREADS": "1",
        "LAUNCH_INIT_TIMEOUT_S": "30",
    })
    if extra:
        env.update(extra)
    return env


def start_ranks(config, world, args=(), restart=0, extra_env=None, port=None):
    """Starts `world` train processes; returns (procs, port). Output goes to pipes."""
    port = port or free_port()
    procs = []
    for r in range(world):
        procs.append(subprocess.Popen([TRAIN, config, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env=rank_env(r, world, port, restart, extra_env)))
    return procs, port


def wait_all(procs, timeout):
    """Waits for every process (bounded); kills leftovers. Returns [(rc, out, err)]."""
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += "\n[test: killed after timeout]"
        results.append((p.returncode, out, err))
    return results


def run_ranks(config, world, args=(), timeout=120, restart=0, extra_env=None):
    procs, _ = start_ranks(config, world, args, restart, extra_env)
    results = wait_all(procs, timeout)
    for r, (rc, out, err) in enumerate(results):
        if rc != 0:
            raise AssertionError(f"rank {r} exited {rc}\nstdout:\n{out}\nstderr:\n{err}")
    return results


def drop_from_checkpoint(step_dir, name):
    """Removes file `name` from checkpoint folder `step_dir` and from its SHA256SUMS, as a
    checkpoint written without it (another mode, an older version) would be: a file removed
    from the folder alone is damage, which the trainer refuses or falls back from."""
    os.remove(os.path.join(step_dir, name))
    sums = os.path.join(step_dir, "SHA256SUMS")
    with open(sums) as f:
        lines = [line for line in f if line.rstrip("\n").split("  ", 1)[1] != name]
    with open(sums, "w") as f:
        f.writelines(lines)


def metrics(out_dir, evals=False):
    """metrics.jsonl's step lines (with `evals`: its evaluation lines, eval_every's)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [m for m in lines if ("eval_loss" in m) == evals]


def final(out_dir):
    with open(os.path.join(out_dir, "final.json")) as f:
        return json.load(f)


def params(out_dir, rank=0):
    """The float32 parameters written by `train --dump_params`, as a list of floats."""
    with open(os.path.join(out_dir, f"params_rank{rank}.bin"), "rb") as f:
        data = f.read()
    return list(struct.unpack(f"<{len(data) // 4}f", data))


# Loads two model.pt files (Debian's python3 has torch; the runner's may not): their names,
# shapes, the largest difference and the largest in units of PyTorch's float32 assert_close
# tolerance (atol 1e-5 + rtol 1.3e-6 x |b|): at most 1 passes assert_close.
_COMPARE_MODELS = r"""
import json, sys, torch
def load(paths):  # a pipeline's stages: one file each, together the model
    state = {}
    for path in paths.split(","):
        state.update(torch.load(path))
    return state
a, b = load(sys.argv[1]), load(sys.argv[2])
same = sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
diff = max((a[k] - b[k]).abs().max().item() for k in a) if same else None
ratio = max(((a[k] - b[k]).abs() / (1e-5 + 1.3e-6 * b[k].abs())).max().item()
            for k in a) if same else None
print(json.dumps({"same_names_and_shapes": same, "max_abs_diff": diff, "ratio": ratio}))
"""


def compare_models(a, b):
    """{same_names_and_shapes, max_abs_diff, ratio} of model files `a` (several joined by ",":
    a pipeline's stages) against `b`; ratio <= 1 passes torch.testing.assert_close."""
    r = harness.run([harness.SYSTEM_PYTHON, "-c", _COMPARE_MODELS, a, b], timeout=120)
    if r.returncode != 0:
        raise AssertionError(r.stderr)
    return json.loads(r.stdout)


def rel_diff(a, b):
    """||a - b|| / ||b|| (and max |a - b|)."""
    assert len(a) == len(b), (len(a), len(b))
    num = sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5
    den = sum(y * y for y in b) ** 0.5
    return num / den, max(abs(x - y) for x, y in zip(a, b))


def write_idx(path, magic, dims, payload):
    """An uncompressed IDX file: big-endian magic (2051 images, 2049 labels), the dimensions,
    then the unsigned bytes of `payload`."""
    with open(path, "wb") as f:
        f.write(struct.pack(f">i{len(dims)}i", magic, *dims))
        f.write(bytes(payload))


IDX_CLASSES = 4  # write_split's labels: one per quadrant


def write_split(directory, prefix, n, seed, side=8):
    """`prefix`-images-idx3-ubyte and `prefix`-labels-idx1-ubyte in `directory` ("train" or
    "t10k"): n side x side images of noise with one quadrant brightened; label = the brightest
    quadrant by pixel sum (IDX_CLASSES classes). The brightening is weak on purpose: two epochs
    reach roughly 50-90% eval accuracy, not 100%, so comparing final.json's accuracy with the
    exported module's can catch a difference."""
    assert side % 2 == 0, side
    rng = random.Random(seed)
    half = side // 2
    pixels, labels = bytearray(), bytearray()
    for _ in range(n):
        img = [rng.randint(0, 110) for _ in range(side * side)]
        q = rng.randrange(IDX_CLASSES)
        for r in range(half):
            for c in range(half):
                i = ((q // 2) * half + r) * side + (q % 2) * half + c
                img[i] = min(255, img[i] + rng.randint(0, 40))
        sums = [sum(img[((k // 2) * half + r) * side + (k % 2) * half + c]
                    for r in range(half) for c in range(half)) for k in range(IDX_CLASSES)]
        pixels += bytes(img)
        labels.append(sums.index(max(sums)))
    write_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte"), 2051, (n, side, side),
              pixels)
    write_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"), 2049, (n,), labels)
