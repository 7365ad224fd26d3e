"""`vit-serve train` under torchrun across machines, played as two "machines" on one host, on the CPU (gloo).

Two torchrun agents (`--nnodes 2 --nproc-per-node 1`) meet through a c10d rendezvous on 127.0.0.1 and form
one world of 2; the elastic path kills a worker mid-run and torchrun's `--max-restarts` brings the group back,
which `--resume` continues from the last checkpoint. The reference is torchrun itself (its agents' own
rendezvous records say which world they formed and that they restarted) and a single-machine
`torchrun --standalone --nproc-per-node 2` run of the same configuration: the same two ranks, the same shards,
the same per-(rank, step) dropout draws and the same gloo all-reduce of two numbers, so the losses must be
equal exactly, as test_distributed.py's resume test demands.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vit_serve.train.distributed import restart_hazard
from vit_serve.train.progress import read_metrics

# The test finds torchrun's workers through /proc (Linux), as `ps` would.
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the workers")

STEPS = 60
# Dropout on, so that the losses depend on each rank's own draws: one world of 2 differs from two worlds of 1.
ARGS = ["--steps", str(STEPS), "--batch-size", "16", "--log-every", "1", "--ckpt-every", "5", "--eval-every", "0",
        "--lr", "0.003", "--dropout", "0.1", "--model-args", "depth=2,embed_dim=32,num_heads=2,mlp_dim=64,patch_size=2",
        "--res", "8", "--no-progress"]
TIMEOUT = 420  # seconds for one launch; a run takes about 25 s on 2 shared cores
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}  # LOGLEVEL: the agents log their rendezvous


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(port: int, run_id: str, *torchrun_args: str) -> list[str]:
    """One "machine"'s torchrun command line (c10d decides its node rank)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, *torchrun_args]


def children(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc (torchrun starts each worker in a session of its own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def environ(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return {}


@contextlib.contextmanager
def launched(*commands: tuple[list[str], Path], env: dict[str, str] | None = None) -> Iterator[list[subprocess.Popen]]:
    """Start each (command, log file) as its own process group; whatever is still running at the end (a failed
    assertion, a timeout) is killed, workers included."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log in commands:
            with log.open("w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                                              start_new_session=True))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                for pid in [*children(p.pid), p.pid]:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                p.wait()


def finish(procs: list[subprocess.Popen], logs: list[Path]) -> list[str]:
    """Wait for every launch; their logs."""
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun still running after {TIMEOUT} s:\n" + logs[0].read_text()[-3000:])
    return [log.read_text() for log in logs]


def cpu_s() -> float:
    """CPU seconds of every finished child process so far, grandchildren (the workers) included."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def losses(out: Path) -> dict[int, float]:
    """step -> loss; a resumed run rewrites the steps it logged after its last checkpoint: the last record wins."""
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def rendezvous(log: str) -> list[dict[str, str]]:
    """The results of every rendezvous an agent logged (torchrun's `Rendezvous complete for workers`)."""
    rounds = []
    for block in log.split("Rendezvous complete for workers. Result:")[1:]:
        rounds.append(dict(re.findall(r"\]\s+(\w+)=(\S+)", block.split("Starting worker group")[0])))
    return rounds


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The reference: one agent, two workers on one machine."""
    root = tmp_path_factory.mktemp("one_machine")
    out, log = root / "run", root / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "vit_serve", "train", "--out", str(out), *ARGS]
    with launched((cmd, log)) as procs:
        (text,) = finish(procs, [log])
    assert procs[0].returncode == 0, text[-3000:]
    return out, losses(out)


def test_two_machines_form_one_world_with_the_losses_of_one(one_machine, tmp_path):
    port, run_id, out = free_port(), f"vit-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    cmd = [*node(port, run_id), "-m", "vit_serve", "train", "--out", str(out), *ARGS]
    t0, c0 = time.perf_counter(), cpu_s()
    with launched((cmd, logs[0]), (cmd, logs[1])) as procs:
        texts = finish(procs, logs)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    assert [p.returncode for p in procs] == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    # torchrun's own record: one rendezvous, node ranks 0 and 1 of a group of 2, global ranks 0 and 1 of 2.
    rounds = [rendezvous(t) for t in texts]
    assert [len(r) for r in rounds] == [1, 1]
    assert sorted(r[0]["group_rank"] for r in rounds) == ["0", "1"]
    assert {(r[0]["group_world_size"], r[0]["global_world_sizes"]) for r in rounds} == {("2", "[2]")}
    assert sorted(r[0]["global_ranks"] for r in rounds) == ["[0]", "[1]"]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    want, got = one_machine[1], losses(out)
    print(f"2 machines x 1 process: {wall:.1f} s wall, {cpu:.1f} CPU s; losses equal to 1 machine x 2 processes at "
          f"{sum(got[s] == want[s] for s in want)}/{len(want)} steps")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert got == want


def test_killed_worker_is_restarted_and_resumes_exactly(one_machine, tmp_path):
    port, run_id, out = free_port(), f"vit-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    state = out / "checkpoints" / "last.pt"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    # --resume from the first start: no state yet means a fresh run, and every restart continues the last one.
    cmd = [*node(port, run_id, "--max-restarts", "1"), "-m", "vit_serve", "train", "--out", str(out), "--resume",
           *ARGS]
    t0, c0 = time.perf_counter(), cpu_s()
    # A store of its own for every attempt: with torch's default, the shared one, the restarted group can read
    # the killed group's addresses (see distributed.restart_hazard).
    with launched((cmd, logs[0]), (cmd, logs[1]), env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) as procs:
        deadline, victim = time.monotonic() + TIMEOUT, None
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if victim is None:  # the writer: global rank 0, whichever machine it landed on
                victim = next((pid for p in procs for pid in children(p.pid) if environ(pid).get("RANK") == "0"),
                              None)
            if victim is not None and state.exists():
                break
            time.sleep(0.01)
        assert victim is not None and state.exists(), "no checkpoint before the run ended:\n" + \
            logs[0].read_text()[-3000:]
        os.kill(victim, signal.SIGKILL)
        killed_at = torch.load(state, weights_only=True)["step"]  # only rank 0 writes it, and it is dead
        texts = finish(procs, logs)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    assert [p.returncode for p in procs] == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    assert 0 < killed_at < STEPS
    # torchrun restarted the group: the killed worker's agent counted a failure and used its restart
    # (restart_count=1). The other agent restarts either because a node came back to the rendezvous (not
    # counted) or, when its own worker fails first on the lost connection, as a failure of its own (counted):
    # a race torchrun allows. Both rendezvoused a second time ...
    rounds = [rendezvous(t) for t in texts]
    assert [len(r) for r in rounds] == [2, 2]
    assert sorted(rs[1]["restart_count"] for rs in rounds) in (["0", "1"], ["1", "1"])
    assert sorted(rs[1]["global_world_sizes"] for rs in rounds) == ["[2]", "[2]"]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in texts[0] + texts[1]
    assert all(rs[0]["master_port"] != rs[1]["master_port"] for rs in rounds)  # a new store for the new group
    assert "warning:" not in texts[0] + texts[1]
    # ... and the new rank 0 resumed from the checkpoint of the killed run.
    resumed = re.findall(r"resuming at step (\d+) of \d+ from (\S+)", texts[0] + texts[1])
    assert resumed == [(str(killed_at), str(state))]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    want, got = one_machine[1], losses(out)
    print(f"killed rank 0 after the step-{killed_at} checkpoint; restarted and resumed: {wall:.1f} s wall, "
          f"{cpu:.1f} CPU s in all; losses equal to the uninterrupted run at "
          f"{sum(got[s] == want[s] for s in want)}/{len(want)} steps")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == want, [(s, got[s], want[s]) for s in got if got[s] != want[s]]


def test_machines_that_see_different_checkpoints_stop_with_a_message(one_machine, tmp_path):
    """A node-local --out: one machine finds the last checkpoint, the other none. Every rank says so and stops,
    instead of the ranks running different numbers of steps into a deadlock."""
    port, run_id = free_port(), f"vit-{uuid.uuid4().hex[:8]}"
    shared, local = tmp_path / "shared", tmp_path / "local"
    shutil.copytree(one_machine[0], shared)  # holds checkpoints/last.pt at the last step
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    cmds = [[*node(port, run_id), "-m", "vit_serve", "train", "--out", str(out), "--resume", *ARGS]
            for out in (shared, local)]
    with launched((cmds[0], logs[0]), (cmds[1], logs[1])) as procs:
        texts = finish(procs, logs)
    assert all(p.returncode != 0 for p in procs)
    for text in texts:
        assert "vit-serve train: error: the processes found different training states" in text, text[-3000:]
        assert "shared storage" in text
    assert not (local / "checkpoints").exists()


def test_restart_hazard_names_the_shared_rendezvous_store():
    """The worker environment torchrun 2.14 sets (local_elastic_agent._start_workers): restarts on the shared
    store are the hazard; a store per attempt, or no restarts, are not."""
    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_hazard(shared)
    assert restart_hazard({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert restart_hazard({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_hazard({}) is None
