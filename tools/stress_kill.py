"""Kill a rank of a TP2 x PP2 CPU job at random moments and count how many runs still end with
the losses of a run that was never killed (not part of CI: minutes per trial with torchrun).

    python tools/stress_kill.py --trials 20 [--launcher torchrun|fork] [--seed 0]

Each trial runs pretrain_gpt.py under `torchrun --standalone --max-restarts 1` (or the same
elastic agent with forked ranks, tests/elastic_launch.py, with --launcher fork) with --save and
--load naming one fresh directory and a checkpoint every other iteration, and SIGKILLs one rank
once, at random: half the trials at a named moment (MEGAPIPE_FAULT=kill:<moment>:<iteration>:
<rank> with all three drawn), half after a random delay from the first logged iteration (any
rank, any moment: start-up, a collective, a save, the final evaluation). A trial ends identical
when the job exits 0, every log and validation line it printed (iteration time aside) is the
unkilled reference run's line, and every iteration was printed. Prints one line per trial and
a summary; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megapipe.testing import run_distributed, train_with_flags  # noqa: E402
from tests.test_auto_resume import FLAGS as TEST_FLAGS  # noqa: E402
from tests.test_auto_resume import LOG, numbers  # noqa: E402

TRAIN_ITERS = 10
# the auto-resume test's job (TP2 x PP2, dropout, evaluation), longer and with another seed
CHANGES = {"--train-iters": str(TRAIN_ITERS), "--eval-interval": "4", "--seed": "11"}
FLAGS = [CHANGES.get(TEST_FLAGS[i - 1], v) if i else v for i, v in enumerate(TEST_FLAGS)]
MOMENTS = ("forward", "backward", "optimizer", "save", "eval")


def iterations(lines: list[str]) -> set[int]:
    return {int(m[1]) for m in map(LOG.match, lines) if m}


def _env(fault: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MEGAPIPE_FAULT")}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["MEGAPIPE_FAULT"] = fault
    return env


def _kill_later(job: subprocess.Popen, out, delay: float) -> int | None:
    """SIGKILL one of the agent's ranks `delay` s after iteration 1 was logged; its pid."""
    with open(f"/proc/self/fd/{out.fileno()}") as log:  # its own offset: the job's is shared
        while job.poll() is None and " iteration        1/" not in log.read():
            time.sleep(0.1)
    time.sleep(delay)
    try:
        with open(f"/proc/{job.pid}/task/{job.pid}/children") as f:
            ranks = [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return None
    if not ranks or job.poll() is not None:
        return None
    victim = random.choice(ranks)
    os.kill(victim, signal.SIGKILL)
    return victim


def run_trial(launcher: str, flags: list[str], fault: str | None, delay: float | None) -> dict:
    """One job; kills a random rank `delay` s after the first logged iteration when given."""
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "4", "--max-restarts", "1", "--monitor-interval", "0.2",
                   str(ROOT / "pretrain_gpt.py"), *flags]  # fmt: skip
    else:
        command = [sys.executable, str(ROOT / "tests" / "elastic_launch.py"), "--nproc", "4",
                   "--max-restarts", "1", "--", *flags]  # fmt: skip
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        job = subprocess.Popen(
            command, stdout=out, stderr=err, text=True, env=_env(fault), cwd=ROOT
        )
        killed = _kill_later(job, out, delay) if delay is not None else None
        try:
            job.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return {
        "returncode": job.returncode,
        "stdout": stdout,
        "stderr": stderr,
        "seconds": time.monotonic() - start,
        "killed_pid": killed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--launcher", choices=("torchrun", "fork"), default="torchrun")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=3.0, help="seconds (delay trials)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)

    reference = numbers(run_distributed(train_with_flags, 4, FLAGS, timeout=600)[-1][1])
    expected = set(reference)
    rows = []
    for trial in range(args.trials):
        work = Path(tempfile.mkdtemp(prefix="stress-kill-"))
        save = work / "ckpt"
        flags = [*FLAGS, "--save", str(save), "--load", str(save), "--save-interval", "2"]
        fault = delay = None
        if trial % 2 == 0:
            moment = rng.choice(MOMENTS)
            when = {"eval": range(4, TRAIN_ITERS + 1, 4), "save": range(2, TRAIN_ITERS + 1, 2)}
            iteration = rng.choice(when.get(moment, range(1, TRAIN_ITERS)))
            fault = f"kill:{moment}:{iteration}:{rng.randrange(4)}"
            what = f"MEGAPIPE_FAULT={fault}"
        else:
            delay = round(rng.uniform(0.0, args.max_delay), 2)
            what = f"SIGKILL a random rank {delay} s after iteration 1"
        got = run_trial(args.launcher, flags, fault, delay)
        printed = numbers(got["stdout"])
        fired = fault is None or "MEGAPIPE_FAULT: kill" in got["stderr"]
        identical = (
            got["returncode"] == 0
            and all(line in expected for line in printed)
            and iterations(printed) == set(range(1, TRAIN_ITERS + 1))
        )
        loaded = r"successfully loaded checkpoint .* at iteration +(\d+)"
        resumed = re.findall(loaded, got["stdout"])
        row = {
            "trial": trial,
            "kill": what,
            "fired": fired and (fault is not None or got["killed_pid"] is not None),
            "resumed_from": [int(r) for r in resumed],
            "exit": got["returncode"],
            "identical": identical,
            "seconds": round(got["seconds"], 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not identical:
            print(got["stderr"][-2000:], file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    fired = [r for r in rows if r["fired"]]
    same = sum(r["identical"] for r in fired)
    print(
        f"{same} of {len(fired)} killed runs ended identical to the unkilled run "
        f"({len(rows) - len(fired)} trials where the kill came too late to fire; "
        f"launcher {args.launcher})"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if same == len(fired) else 1


if __name__ == "__main__":
    sys.exit(main())
