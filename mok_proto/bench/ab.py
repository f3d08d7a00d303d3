"""A/B of the layer between two source trees in one run: a worker process per tree
(mok_proto/bench/ab_worker.py, each importing its own `mok_proto`), both holding the same staged
shape on the same GPU, timed in alternation (A B, B A, ...) so that both see the same clocks;
per round the median replay time of each, and the ratio B / A as the median of the per-round
ratios. The two trees' results are compared through their digests (bitwise)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from mok_proto.bench.timing import summarize

WORKER = Path(__file__).with_name("ab_worker.py")
ANSWER_TIMEOUT_S = 900.0  # a setup compiles every kernel of a tree


class Worker:
    """A worker process over the tree `root` (its `mok_proto` package), `label` naming it in errors."""

    def __init__(self, root: Path, label: str, extra_path: str = ""):
        self.label = label
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), extra_path) if p)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=root)

    def send(self, **request) -> None:
        """Ask without waiting (answer() takes the answer): two workers can set up at once."""
        self.pending = request["cmd"]
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"the {self.label} worker gave no answer to {self.pending} "
                               f"(exit {self.proc.poll()}; its stderr is above)")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the {self.label} worker failed: {answer['error']}")
        return answer

    def ask(self, **request) -> dict:
        self.send(**request)
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(cmd="close")
            except RuntimeError:
                pass
            self.proc.wait(timeout=60)


def tree_of(base: str, into: Path) -> Path:
    """The source tree of `base`: a folder holding mok_proto/ as is, else a git revision of this
    checkout, exported (git archive) under `into`."""
    path = Path(base)
    if (path / "mok_proto").is_dir():
        return path.resolve()
    repo = Path(__file__).resolve().parents[2]
    out = into / "base"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        done = subprocess.run(["git", "archive", base, "mok_proto", "cuda"], cwd=repo, stdout=tar,
                              stderr=subprocess.PIPE, text=False)
        if done.returncode:
            raise ValueError(f"--base {base!r} is neither a folder holding mok_proto/ nor a git revision of "
                             f"{repo}: {done.stderr.decode().strip()}")
        tar.seek(0)
        with tarfile.open(fileobj=tar) as t:
            t.extractall(out, filter="data")
    return out


def interleaved(a: Worker, b: Worker, pass_: str, rounds: int, iters: int, warmup: int) -> dict:
    """Per round the median of `iters` replays of each worker's `pass_` graph, A first in even
    rounds and B first in odd ones: {"a": stats, "b": stats, "ratio": median B/A of the rounds,
    "ratio_p20", "ratio_p80"}."""
    medians = {"a": [], "b": []}
    for r in range(rounds):
        order = (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a))
        for key, worker in order:
            medians[key].append(float(np.median(worker.ask(cmd="time", **{"pass": pass_}, iters=iters,
                                                           warmup=warmup)["ms"])))
    ratios = np.asarray(medians["b"]) / np.asarray(medians["a"])
    return {"a": summarize(medians["a"]), "b": summarize(medians["b"]), "ratio": float(np.median(ratios)),
            "ratio_p20": float(np.percentile(ratios, 20)), "ratio_p80": float(np.percentile(ratios, 80))}
