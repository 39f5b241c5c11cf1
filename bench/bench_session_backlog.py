"""Per-message cost inside one session as the session's backlog grows: a lock or settle costs what it touches.

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/bench_session_backlog.py [--small 200] [--large 20000] [--rounds 40]

For each backlog, a one-partition session queue holds one session of that many 1 KB messages
(sent 200 per call). One receiver accepts the session, then receives and completes one message
at a time (`receive_messages(1)` + `complete_message`, as SDK code does); after 5 warm-up
messages, the median of `--rounds` per-message times is the figure. Printed and written to
`bench/results/session-backlog.json`: both medians and the ratio large / small, which should stay
within 2x (a plain queue's per-message cost stays flat with the backlog, `bench_core.py` backlog).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BODY_SIZE, RESULTS_DIR, heading, machine_info, row, write_results

from sparkqueue import Message, Namespace

TARGET_RATIO = 2.0
WARM_UP = 5


def per_message_ms(backlog: int, rounds: int, scratch: Path) -> dict[str, float]:
    """Median ms of receive(1) + complete inside one session holding `backlog` messages; and the accept's ms."""
    root = scratch / f"backlog-{backlog}"
    body = b"x" * BODY_SIZE
    with Namespace(root) as ns:
        ns.create_queue("q", requires_session=True, enable_partitioning=False)
        with ns.get_queue_sender("q") as s:
            for k in range(0, backlog, 200):
                s.send_messages([Message(body, session_id="s", message_id=f"m{k + i}") for i in range(min(200, backlog - k))])
        t0 = time.perf_counter()
        with ns.get_queue_receiver("q", session_id="s") as r:
            accept = time.perf_counter() - t0
            times = []
            for i in range(WARM_UP + rounds):
                t = time.perf_counter()
                (m,) = r.receive_messages(1, max_wait_time=5)
                r.complete_message(m)
                if i >= WARM_UP:
                    times.append(time.perf_counter() - t)
    shutil.rmtree(root, ignore_errors=True)
    return {"backlog": backlog, "accept_ms": accept * 1000, "per_message_ms": statistics.median(times) * 1000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", type=int, default=200)
    p.add_argument("--large", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "session-backlog.json")
    args = p.parse_args()
    heading(f"one session: receive(1) + complete, backlog {args.small:,} vs {args.large:,}")
    with tempfile.TemporaryDirectory(prefix="bench-session-backlog-") as tmp:
        small = per_message_ms(args.small, args.rounds, Path(tmp))
        large = per_message_ms(args.large, args.rounds, Path(tmp))
    ratio = large["per_message_ms"] / small["per_message_ms"]
    for r in (small, large):
        row(f"backlog {r['backlog']:,}: per message", f"{r['per_message_ms']:.1f} ms", f"accept {r['accept_ms']:.1f} ms")
    row("ratio large / small", f"{ratio:.2f}x", f"target <= {TARGET_RATIO:g}x: {'met' if ratio <= TARGET_RATIO else 'MISS'}")
    result: dict[str, Any] = {
        "small": small,
        "large": large,
        "ratio": ratio,
        "target": {"ratio": TARGET_RATIO, "met": ratio <= TARGET_RATIO},
    }
    write_results(
        args.out, {"machine": machine_info(), "params": vars(args) | {"out": str(args.out)}}, {"session_backlog": result}
    )
    print(f"\nresults in {args.out}")


if __name__ == "__main__":
    main()
