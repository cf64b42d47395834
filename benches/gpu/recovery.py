#!/usr/bin/env python3
"""train-cnn's in-job recovery on a GPU (the `recovery` step of benches/gpu_verify.sh).

    recovery.py LOCKSTEP TRAIN_CNN DATA

Runs `lockstep launch --nproc-per-node 2 --max-restarts 1 --restart-policy rank -- train-cnn
--device cuda --epochs 4 --json` twice with the same seed, both ranks on GPU 0 (staged through
shared memory: one GPU and NCCL < 2.30 cannot hold two NCCL ranks): undisturbed, then with rank 1
killed by SIGKILL when rank 0 reports half of epoch 2's steps. The recovered run must finish with
the undisturbed run's final test accuracy (within 0.5 points) and last epoch's training loss (the
same digits), within its wall time plus 5 s, with the launcher's replacement and the survivor's
`recovered in` in the log. Prints one `recovery:` line per run and exits non-zero on a failed bar.
This is crates/train/tests/recovery.rs for a machine without cargo.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def rank1_pid(mark):
    """The process of train-cnn rank 1 carrying `mark` in its environment."""
    want = f"RECOVERY_MARK={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0]
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if argv0.endswith(b"train-cnn") and want in env and b"RANK=1" in env:
            return int(pid)
    return None


def run(lockstep, train, data, kill):
    mark = f"{os.getpid()}-{kill}"
    env = dict(os.environ, RECOVERY_MARK=mark, LOCKSTEP_LOG="info", CUDA_VISIBLE_DEVICES="0",
               NCCL_MULTI_RANK_GPU_ENABLE="0")
    cmd = [lockstep, "launch", "--nproc-per-node", "2", "--max-restarts", "1",
           "--restart-policy", "rank", "--", train, "--device", "cuda", "--epochs", "4",
           "--seed", "7", "--json", "--loss-every", "1", "--log-every", "1", "--data", data]
    with tempfile.TemporaryFile(mode="w+") as err, tempfile.TemporaryDirectory() as cwd:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd, text=True)
        acc, loss, killed = None, None, False
        for line in p.stdout:
            if "{" not in line:
                continue
            try:
                v = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            if "test_acc" in v:
                acc, loss = v["test_acc"], v.get("train_loss")
            if kill and not killed and v.get("epoch") == 2 and "step" in v \
                    and v["step"] >= v.get("steps", 0) // 2:
                pid = rank1_pid(mark)
                if pid is None:
                    sys.exit("recovery: rank 1's process was not found")
                os.kill(pid, signal.SIGKILL)
                print(f"recovery: killed rank 1 (pid {pid}) at epoch 2 step {v['step']}/{v['steps']}")
                killed = True
        rc = p.wait()
        wall = time.monotonic() - t0
        err.seek(0)
        log = err.read()
        left = os.listdir(cwd)
    what = "killed" if kill else "undisturbed"
    if rc != 0:
        sys.exit(f"recovery: the {what} run failed (exit {rc}):\n{log[-4000:]}")
    if kill and not killed:
        sys.exit(f"recovery: rank 1 was never killed in epoch 2:\n{log[-4000:]}")
    if left:
        sys.exit(f"recovery: the {what} run wrote {left} in its working directory")
    rec = None
    if "recovered in" in log:
        rec = float(log.split("recovered in", 1)[1].split()[0])
    print(f"recovery: {what}: test acc {acc} %, last epoch loss {loss}, wall {wall:.2f} s"
          + (f", recovered in {rec:.2f} s on the survivor" if rec is not None else ""))
    return acc, loss, wall, rec, log


def main():
    # Absolute: each run's working directory is a fresh temporary one.
    lockstep, train, data = (os.path.abspath(a) for a in sys.argv[1:4])
    calm = run(lockstep, train, data, False)
    hit = run(lockstep, train, data, True)
    fails = []
    if "restart 1: rank 1" not in hit[4] or hit[3] is None:
        fails.append("the launcher did not replace rank 1, or the survivor did not recover in the job")
    if calm[0] is None or hit[0] is None or abs(hit[0] - calm[0]) > 0.5:
        fails.append(f"final test accuracy {hit[0]} vs {calm[0]} (bar: within 0.5 points)")
    if hit[1] != calm[1]:
        fails.append(f"last epoch's training loss {hit[1]} vs {calm[1]} (bar: the same)")
    if hit[2] > calm[2] + 5:
        fails.append(f"wall {hit[2]:.2f} s vs {calm[2]:.2f} s (bar: within + 5 s)")
    for f in fails:
        print(f"recovery: FAIL: {f}")
    if fails:
        print(hit[4][-4000:])
        sys.exit(1)
    print("recovery: all bars met")


if __name__ == "__main__":
    main()
