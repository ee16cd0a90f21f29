"""A storm of faults on one long job, nothing lost: the job ends bitwise equal to a run that
was never interrupted.

    python benchmarks/fault_soak.py --iterations 300 --seed 0 [--write]

One `plugtron train` job at dp 2 x pp 2 (4 ranks, tiny GPT, mock data, a checkpoint every 10
iterations) under torch elastic (`--max-restarts`). From the seed, the script picks an
iteration for each fault and injects it from outside while the job runs:

* ``kill``: SIGKILL of one rank (torch elastic restarts the group; it resumes from the latest
  checkpoint);
* ``freeze``: SIGSTOP of one rank past `--distributed-timeout-minutes` (the peers time out,
  the group restarts);
* ``disk_full``: the next checkpoint file one rank writes fails with ENOSPC (a sitecustomize
  in fault_soak_inject/ raises it once, as a full disk would; the group restarts);
* ``corrupt``: SIGTERM of the job (it saves and exits 143), then a flipped byte in the newest
  checkpoint's tensor data, then a new job (it warns and resumes from the checkpoint before);
* ``sigterm``: SIGTERM of the job (it saves and exits 143), then a new job.

Then the final checkpoint's every tensor (model and optimizer) and the final loss are compared
with an uninterrupted run's, bit for bit. Reported: each fault with its iteration and the time
until training passed that iteration again, elastic restarts and relaunched jobs, iterations
done twice. ``--write`` puts the figures in benchmarks/RESULTS.md. The suite runs a short
version (tests/reliability/test_fault_storm.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
INJECT = os.path.join(HERE, "fault_soak_inject")
#: The marker file whose presence makes the next checkpoint file fail with ENOSPC.
DISK_FULL_ENV = "PLUGTRON_SOAK_DISK_FULL_MARKER"
FAULTS = ("kill", "freeze", "disk_full", "corrupt", "sigterm")


def plugtron_command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "plugtron")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "plugtron.cli.main"]


def job_flags(iterations: int, save: str, metrics: str, save_interval: int) -> list[str]:
    return ["train", "--data", "mock", "--num-layers", "4", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
            "--lr-warmup-iters", "2", "--train-iters", str(iterations), "--eval-interval", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--pipeline-model-parallel-size", "2", "--nproc-per-node", "4",
            "--save", save, "--load", save, "--save-interval", str(save_interval),
            "--metrics-file", metrics, "--no-progress", "--log-interval", "0",
            "--distributed-timeout-minutes", "0.25"]


def records(metrics: str) -> list[dict]:
    try:
        with open(metrics) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def last_iteration(metrics: str) -> int:
    steps = [r["iteration"] for r in records(metrics) if "lm_loss" in r]
    return steps[-1] if steps else 0


def rank_pids(launcher: int) -> list[int]:
    """The rank processes below the launcher (their command line names plugtron.cli.rank)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and b"plugtron.cli.rank" in command:
            out.append(int(name))
    return sorted(out)


def newest_checkpoint(save: str) -> str | None:
    names = sorted(n for n in os.listdir(save) if n.startswith("iter_")) if os.path.isdir(save) \
        else []
    return os.path.join(save, names[-1]) if names else None


def corrupt(checkpoint: str) -> str:
    """Flip one byte in the middle of the largest tensor file: its CRC no longer matches."""
    files = [os.path.join(checkpoint, n) for n in os.listdir(checkpoint)
             if n.endswith(".safetensors")]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) - 64)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return target


@dataclass
class Fault:
    kind: str
    iteration: int
    injected_at: float = 0.0
    #: The iteration training stood at when the fault took effect (a full disk: at the next
    #: save, not when the marker was laid).
    effect: int | None = None
    recovered_s: float | None = None
    note: str = ""


@dataclass
class Report:
    iterations: int
    faults: list[Fault] = field(default_factory=list)
    jobs: int = 0
    elastic_restarts: int = 0
    recomputed: int = 0
    seconds: float = 0.0
    equal: bool = False
    differences: list[str] = field(default_factory=list)
    final_loss: float | None = None
    reference_loss: float | None = None


def run_job(argv: list[str], log, env) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def storm(workdir: str, iterations: int, seed: int, kinds: tuple[str, ...] = FAULTS,
          save_interval: int = 10, max_minutes: float = 60.0) -> Report:
    """Run the faulted job and the uninterrupted reference in ``workdir``; the report."""
    rng = random.Random(seed)
    report = Report(iterations)
    low, high = max(3, save_interval // 2), iterations - 3
    targets = sorted(rng.sample(range(low, high), len(kinds)))
    order = list(kinds)
    rng.shuffle(order)
    pending = [Fault(kind, it) for kind, it in zip(order, targets)]
    save, metrics = os.path.join(workdir, "soak"), os.path.join(workdir, "soak.jsonl")
    marker = os.path.join(workdir, "disk-full")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [INJECT, *filter(None, [os.environ.get("PYTHONPATH")])]), DISK_FULL_ENV: marker,
        "OMP_NUM_THREADS": "1"}
    argv = [*plugtron_command(), *job_flags(iterations, save, metrics, save_interval),
            "--max-restarts", str(len(kinds) + 2)]
    deadline = time.monotonic() + max_minutes * 60
    start = time.monotonic()
    active: list[Fault] = []
    with open(os.path.join(workdir, "soak.log"), "a") as log:
        while True:
            report.jobs += 1
            proc = run_job(argv, log, env)
            relaunch = False
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    raise TimeoutError(f"the soak ran past {max_minutes} minutes")
                now, done = time.monotonic(), last_iteration(metrics)
                for fault in list(active):
                    if fault.effect is None and not (fault.kind == "disk_full"
                                                     and os.path.exists(marker)):
                        fault.effect = done
                    if fault.effect is not None and done > fault.effect and \
                            len(rank_pids(proc.pid)) == 4:
                        fault.recovered_s = now - fault.injected_at
                        active.remove(fault)
                # one fault at a time: the next waits until the job is past the last one
                if pending and not active and done >= pending[0].iteration:
                    fault = pending[0]
                    fault.iteration, fault.injected_at = done, now
                    outcome = inject(fault, proc, marker)
                    if outcome != "retry":  # no rank up (a restart in progress): try again
                        pending.pop(0)
                        report.faults.append(fault)
                        active.append(fault)
                    if outcome == "relaunch":
                        relaunch = True
                        break
                time.sleep(0.2)
            code = wait(proc, 120)
            if code is None:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError("a job did not end within 2 minutes of its stop")
            if relaunch and report.faults[-1].kind == "corrupt":
                newest = newest_checkpoint(save)
                if newest is not None:
                    report.faults[-1].note = f"corrupted {os.path.relpath(corrupt(newest), save)}"
            if code == 0 and last_iteration(metrics) >= iterations:
                break
            if not relaunch:
                raise RuntimeError(f"the job failed (exit {code}) without a fault asking for a "
                                   f"relaunch; see {log.name}")
    now = time.monotonic()
    for fault in active:
        fault.recovered_s = now - fault.injected_at
    report.seconds = now - start
    history = records(metrics)
    report.elastic_restarts = sum(1 for r in history if r.get("elastic_restart"))
    last = 0
    for r in history:
        if "resumed_from_iteration" in r:
            report.recomputed += max(0, last - r["resumed_from_iteration"])
        elif "lm_loss" in r:
            last = r["iteration"]
    losses = [r["lm_loss"] for r in history if "lm_loss" in r]
    report.final_loss = losses[-1] if losses else None
    reference(workdir, iterations, save_interval, report)
    return report


def inject(fault: Fault, proc: subprocess.Popen, marker: str) -> str:
    """Inject ``fault`` into the running job: ``"relaunch"`` when the job is being stopped on
    purpose (a new job follows), ``"retry"`` when its ranks are not all up (a restart in
    progress), else ``"done"``."""
    ranks = rank_pids(proc.pid)
    if fault.kind in ("kill", "freeze") and len(ranks) < 4:
        return "retry"
    if fault.kind == "kill":
        victim = ranks[fault.iteration % len(ranks)]
        os.kill(victim, signal.SIGKILL)
        fault.note = f"SIGKILL pid {victim}"
    elif fault.kind == "freeze":
        victim = ranks[fault.iteration % len(ranks)]
        os.kill(victim, signal.SIGSTOP)
        fault.note = f"SIGSTOP pid {victim}"
    elif fault.kind == "disk_full":
        open(marker, "w").close()
        fault.note = "the next checkpoint file written fails with ENOSPC"
    elif fault.kind in ("corrupt", "sigterm"):
        if len(ranks) < 4:
            return "retry"
        os.kill(proc.pid, signal.SIGTERM)
        fault.note = "SIGTERM of the job"
        return "relaunch"
    return "done"


def reference(workdir: str, iterations: int, save_interval: int, report: Report) -> None:
    """The same job never interrupted; compares its final checkpoint and loss with the soak's."""
    from plugtron.core.checkpoint.reader import CheckpointReader

    save, metrics = os.path.join(workdir, "reference"), os.path.join(workdir, "reference.jsonl")
    argv = [*plugtron_command(), *job_flags(iterations, save, metrics, save_interval)]
    with open(os.path.join(workdir, "reference.log"), "w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600).returncode
    if code != 0:
        raise RuntimeError(f"the reference run failed (exit {code}); see {log.name}")
    losses = [r["lm_loss"] for r in records(metrics) if "lm_loss" in r]
    report.reference_loss = losses[-1] if losses else None
    name = f"iter_{iterations:07d}"
    mine = CheckpointReader(os.path.join(workdir, "soak", name))
    theirs = CheckpointReader(os.path.join(save, name))
    try:
        def logical(reader) -> list[str]:
            return sorted(f"{kind}{n}" for kind in ("model/", "optim/")
                          for n in reader.names(kind))

        names, other = logical(mine), logical(theirs)
        if names != other:
            report.differences.append("the two checkpoints hold different tensors")
        for logical in names:
            if logical in other and not mine.read_full(logical).equal(theirs.read_full(logical)):
                report.differences.append(logical)
    finally:
        mine.close()
        theirs.close()
    report.equal = not report.differences and report.final_loss == report.reference_loss


def describe(report: Report) -> list[str]:
    lines = [f"{report.iterations} iterations, dp 2 x pp 2, {len(report.faults)} faults, "
             f"{report.jobs} jobs ({report.jobs - 1} relaunched), {report.elastic_restarts} "
             f"elastic restarts, {report.recomputed} iterations done twice, "
             f"{report.seconds:.0f} s"]
    for f in report.faults:
        took = f"{f.recovered_s:.1f} s" if f.recovered_s is not None else "-"
        lines.append(f"  {f.kind:<9} at iteration {f.iteration:>4}: training past it again "
                     f"after {took} ({f.note})")
    verdict = "bitwise equal" if report.equal else "DIFFERENT: " + ", ".join(
        report.differences[:5] or ["the final loss"])
    lines.append(f"final loss {report.final_loss} (uninterrupted: {report.reference_loss}); "
                 f"final checkpoint (model and optimizer) {verdict}")
    return lines


def write_results(report: Report, command: str) -> None:
    from results import write_section  # benchmarks/results.py

    write_section("\n".join([
        f"## Fault storm ({datetime.date.today()})", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores."
        f" Command: `{command}`.", "", "```", *describe(report), "```"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--max-minutes", type=float, default=60.0)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="plugtron-soak-")
    report = storm(workdir, args.iterations, args.seed, max_minutes=args.max_minutes)
    print("\n".join(describe(report)))
    if args.write:
        sys.path.insert(0, HERE)
        write_results(report, " ".join(["python benchmarks/fault_soak.py", *sys.argv[1:]]))
    return 0 if report.equal else 1


if __name__ == "__main__":
    sys.exit(main())
