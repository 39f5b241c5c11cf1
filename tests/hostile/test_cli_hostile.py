"""Hostile input to the command line: no bad argument ends in a traceback, and data never reaches the terminal raw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkqueue import Message, Namespace
from sparkqueue.cli.render import clean

TIMEOUT_S = 120


def sq(root: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m sparkqueue.cli --root ROOT ARGS` as a real process (rich colours on, as on a terminal)."""
    env = {**os.environ, "COLUMNS": "300", "FORCE_COLOR": "1", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "sparkqueue.cli", "--root", root, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        check=False,
    )


def many(root: str, calls: list[tuple[str, ...]]) -> list[subprocess.CompletedProcess[str]]:
    """Independent invocations, run concurrently (each spends most of its time importing)."""
    with ThreadPoolExecutor(max_workers=6) as pool:
        return list(pool.map(lambda args: sq(root, *args), calls))


DURATION_FLAGS = ("--lock-duration", "--ttl", "--duplicate-window")
BAD_ARGUMENTS: list[tuple[str, ...]] = [
    *[("create", "queue", "q1", flag, value) for flag in DURATION_FLAGS for value in ("nan", "inf", "-inf", "1e308")],
    ("create", "topic", "t1", "--ttl", "nan"),
    ("create", "topic", "t1", "--duplicate-window", "1e308"),
    ("receive", "q", "--wait", "nan"),
    ("receive", "q", "--wait", "inf"),
    ("receive", "q", "--count", str(2**64)),
    ("peek", "q", "--count", "0"),
    ("peek", "q", "--from-sequence", str(2**64)),
    ("send", "q", "--batch", str(2**63)),
]


def test_bad_numbers_never_end_in_a_traceback(root):
    with Namespace(root) as ns:
        ns.create_queue("q")
    results = many(root, BAD_ARGUMENTS)
    for args, p in zip(BAD_ARGUMENTS, results, strict=True):
        assert p.returncode in (1, 2), f"{args}: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
        assert "Traceback" not in p.stdout + p.stderr, f"{args}: {p.stderr}"
    with Namespace(root) as ns:
        assert [q.name for q in ns.list_queues()] == ["q"] and ns.list_topics() == []  # nothing was created


BAD_RECORDS = [
    '{"body": "x", "time_to_live": 1e308}',
    '{"body": "x", "time_to_live": NaN}',
    '{"body": "x", "time_to_live": Infinity}',
    '{"body": "x", "application_properties": {"v": NaN}}',
    '{"body": "x", "application_properties": {"v": 1e999}}',
    '{"body": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"body": "x", "application_properties": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}",
    '{"body": "x", "application_properties": [1, 2]}',
    '{"body": "x", "message_id": 5}',
    '{"body": "x", "scheduled_enqueue_time_utc": 12}',
    '{"body_base64": "!!!"}',
    "[1, 2, 3]",
    '{"body": "x", "partition_key": "' + "k" * 10_000 + '"}',
]


@pytest.mark.parametrize("jsonl", [True, False])
def test_bad_jsonl_records_are_one_line_errors_and_send_nothing(root, tmp_path, jsonl):
    with Namespace(root) as ns:
        ns.create_queue("q")
    files = []
    for i, record in enumerate(BAD_RECORDS):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text('{"body": "fine"}\n' + record + "\n")
        files.append(f)
    if not jsonl:  # the same file on stdin
        results = [sq(root, "send", "q", "--jsonl", "--file", "-", stdin=f.read_text()) for f in files[:4]]
    else:
        results = many(root, [("send", "q", "--jsonl", "--file", str(f)) for f in files])
    for p in results:
        assert p.returncode in (1, 2), p.stdout + p.stderr
        assert "Traceback" not in p.stdout + p.stderr, p.stderr[-2000:]
        assert sum("Error: " in line for line in p.stderr.splitlines()) == 1, p.stderr[-2000:]
    with Namespace(root) as ns:
        # a file is validated before anything is sent; stdin's batch fails before it is sent
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_bad_roots(tmp_path):
    calls = [("list",), ("create", "queue", "q")]
    results = [sq(r, *c) for r in ("", "   ", "/", "/proc", "/proc/self/x") for c in calls]
    for p in results:
        assert p.returncode in (1, 2), p.stdout + p.stderr
        assert "Traceback" not in p.stdout + p.stderr, p.stderr[-2000:]
        assert "Error: " in _strip_colour(p.stderr).splitlines()[0], p.stderr
    assert not Path("/_catalog").exists() and not Path("/entities").exists()


HOSTILE = [
    "\x1b]8;;https://evil.example/x\x1b\\click\x1b]8;;\x1b\\",  # OSC 8 hyperlink
    "[link=https://evil.example/x]click[/link]",  # rich markup
    "\x1b[2J\x1b[31mred\x07\x9b1m\u202eevil",  # clear screen, colour, bell, C1 CSI, RTL override
    "[bold red]shout[/]",
]


def test_data_is_shown_escaped_never_as_control_sequences_or_markup(root):
    with Namespace(root) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([
                Message(h, message_id=h, partition_key=h, subject=h, application_properties={h: h}) for h in HOSTILE
            ])  # fmt: skip
        with ns.get_queue_receiver("q") as r:
            for m in r.receive_messages(2, max_wait_time=2):
                r.dead_letter_message(m, reason=HOSTILE[0], error_description=HOSTILE[1])
    calls = [("peek", "q", "-n", "10"), ("peek", "q", "--dead-letter"), ("peek", "q", "--json")]
    shown = many(root, [*calls, ("receive", "q", "-n", "10", "--abandon", "--dead-letter")])
    for p in shown:
        assert p.returncode == 0, p.stderr
        text = p.stdout + p.stderr
        for h in HOSTILE:
            for raw in ("\x1b]8;;https://evil", "\x1b[2J", "\x07", "\x9b", "\u202e"):
                assert raw not in text, (h, text)
        assert "\x1b]8" not in text  # no hyperlinks at all: rich made none from markup either
    table = shown[0].stdout + shown[1].stdout  # every message: two in the queue, two dead-lettered
    assert "[link=https://evil.example/x]" in table  # the id shown as the text it is
    assert "\\x1b[2J" in table  # control characters shown as escapes
    data = json.loads(shown[2].stdout if "\x1b" not in shown[2].stdout else _strip_colour(shown[2].stdout))
    assert len(data) == 2 and {m["message_id"] for m in data} <= set(HOSTILE)  # --json keeps the exact data (escaped)


def _strip_colour(text: str) -> str:
    """SGR colour sequences that rich adds to JSON on a terminal."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_clean_escapes_every_control_character():
    assert clean("a\x1bb\nc\x7f\x85\u202ed") == "a\\x1bb\\nc\\x7f\\x85\\u202ed"
    assert clean("plain [b]text[/b] ünïcode") == "plain [b]text[/b] ünïcode"
