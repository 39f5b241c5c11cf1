"""Interpreter exit with daemon threads inside sparkqueue calls: the process still exits 0 (sparkqueue/shutdown.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys, threading, time
from sparkqueue import Message, Namespace

root = sys.argv[1]
ns = Namespace(root)
try:
    ns.create_queue("q")
except Exception:
    pass
with ns.get_queue_sender("q") as s:
    s.send_messages([Message(f"m{i}") for i in range(50)])
started = threading.Barrier(5)

def receive_forever():
    r = ns.get_queue_receiver("q")
    started.wait()
    while True:  # a daemon receiver: receives, abandons, never stops on its own
        got = r.receive_messages(10, max_wait_time=0)
        if got:
            r.abandon_messages(got)

def send_forever():
    s = ns.get_queue_sender("q")
    started.wait()
    while True:
        s.send_messages(Message("more"))

for target in (receive_forever, receive_forever, receive_forever, send_forever):
    threading.Thread(target=target, daemon=True).start()
started.wait()
time.sleep(0.3)  # the threads are mid-call when the main thread ends
print("main done", flush=True)
"""


def run_many(tmp_path: Path, runs: int) -> list[subprocess.CompletedProcess[str]]:
    """Run SCRIPT `runs` times (two at a time), each on its own namespace."""
    script = tmp_path / "daemons.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def one(i: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), str(tmp_path / f"ns{i % 2}")], capture_output=True, text=True, env=env, timeout=300
        )

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(runs)))


def check(results: list[subprocess.CompletedProcess[str]]) -> None:
    """Every run finished its work and exited 0 (no signal, no abort)."""
    failed = [(p.returncode, p.stderr[-1500:]) for p in results if p.returncode != 0 or "main done" not in p.stdout]
    assert not failed, f"{len(failed)} of {len(results)} runs failed: {failed[:3]}"


def test_exit_with_daemon_threads_mid_call(tmp_path):
    check(run_many(tmp_path, 5))


@pytest.mark.slow
def test_exit_with_daemon_threads_mid_call_50_runs(tmp_path):
    check(run_many(tmp_path, 50))


AFTER_MAIN = r"""
import sys, threading, time
from sparkqueue import Message, Namespace

ns = Namespace(sys.argv[1])
ns.create_queue("q")

def late():
    time.sleep(0.5)  # the main thread has ended: the interpreter waits for this thread, its thread pools take no job
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("late"))  # one file
        s.send_messages([Message(f"m{i}", partition_key=str(i)) for i in range(40)])  # a file per partition
    r = ns.get_queue_receiver("q")
    got = r.receive_messages(100, max_wait_time=1)
    r.complete_messages(got)
    print("late thread done", len(got), flush=True)

threading.Thread(target=late).start()
"""


def test_a_thread_that_sends_after_the_main_thread_ended_still_stores_its_files(tmp_path: Path) -> None:
    """The writer pool refuses jobs once the interpreter is exiting; a file is then written in the calling thread."""
    script = tmp_path / "late.py"
    script.write_text(AFTER_MAIN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ns")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    assert "late thread done 41" in p.stdout, (p.stdout, p.stderr[-1500:])
