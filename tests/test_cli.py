"""The `sparkqueue` command line, run as a real subprocess against real Delta tables in tmp_path."""

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from procs import peek_all

from sparkqueue import CorrelationRuleFilter, Message, Namespace, SubQueue
from sparkqueue.cli import ops
from sparkqueue.cli.app import CliError, property_value

CLI_TIMEOUT_S = 120


def sq(root: Path | str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m sparkqueue.cli ARGS` with SPARKQUEUE_ROOT=root; returns the finished process."""
    env = {**os.environ, "SPARKQUEUE_ROOT": str(root), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "sparkqueue.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def sq_all(root: Path | str, *calls: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Run independent CLI invocations concurrently (each subprocess spends most of its time importing)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(lambda args: sq(root, *args), calls))


def ok_all(root: Path | str, *calls: tuple[str, ...]) -> list[str]:
    """Run invocations concurrently, assert each exits 0, return their stdouts."""
    outs = []
    for args, p in zip(calls, sq_all(root, *calls), strict=True):
        assert p.returncode == 0, f"{args}: rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
        outs.append(p.stdout)
    return outs


def ok(root: Path | str, *args: str, stdin: str | None = None) -> str:
    """Run the CLI, assert exit code 0, return stdout."""
    p = sq(root, *args, stdin=stdin)
    assert p.returncode == 0, f"{args}: rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


def as_json(text: str) -> Any:
    """Parse the CLI's --json output."""
    return json.loads(text)


def dead_letter_all(ns: Namespace, queue: str, expected: int, reason: str = "Poison") -> None:
    """Receive `expected` messages from the queue and dead-letter them."""
    done = 0
    with ns.get_queue_receiver(queue) as r:
        while done < expected:
            got = r.receive_messages(max_message_count=expected - done, max_wait_time=2)
            assert got, f"only {done} of {expected} messages arrived"
            for m in got:
                r.dead_letter_message(m, reason=reason, error_description="bad input")
            done += len(got)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A namespace root that does not exist yet."""
    return tmp_path / "ns"


def test_piped_output_is_not_cut_at_80_columns() -> None:
    """Rich cuts lines and tables at 80 columns when output is not a terminal (a CI log); the CLI and jobs use 160."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    code = "from sparkqueue.cli.render import console; print(console().width, console(stderr=True).width)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=60)
    assert done.stdout.split() == ["160", "160"]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, "COLUMNS": "99"}, check=True)
    assert done.stdout.split() == ["99", "99"]


def test_create_list_delete(root: Path) -> None:
    """create queue/topic/subscription with settings, list them (table and JSON), delete them."""
    Namespace(root).close()  # the namespace exists, so the two concurrent creates do not both create its catalog
    ok_all(
        root,
        ("create", "queue", "orders", "--no-partitioning", "--lock-duration", "30", "--max-delivery-count", "3",
         "--duplicate-detection", "--ttl", "3600"),
        ("create", "topic", "events"),
    )  # fmt: skip
    out = ok(root, "create", "subscription", "events", "audit", "--forward-to", "orders")
    assert "events/audit" in out

    with Namespace(root) as ns:
        q = ns.get_queue("orders")
        assert (q.enable_partitioning, q.lock_duration, q.max_delivery_count) == (False, timedelta(seconds=30), 3)
        assert q.requires_duplicate_detection and q.default_message_time_to_live == timedelta(hours=1)
        assert ns.get_subscription("events", "audit").forward_to == "orders"

    table, listed_json = ok_all(root, ("list",), ("list", "--json"))
    assert all(name in table for name in ("orders", "events", "audit", "Available"))
    listed = as_json(listed_json)
    assert [(q["name"], q["partitions"], q["active_message_count"]) for q in listed["queues"]] == [("orders", 1, 0)]
    assert [t["name"] for t in listed["topics"]] == ["events"]
    assert [s["name"] for s in listed["topics"][0]["subscriptions"]] == ["audit"]
    assert listed["topics"][0]["partitions"] == 16

    ok(root, "delete", "subscription", "events", "audit")
    with Namespace(root) as ns:
        assert ns.list_subscriptions("events") == []
    ok_all(root, ("delete", "queue", "orders"), ("delete", "topic", "events"))
    with Namespace(root) as ns:
        assert ns.list_queues() == [] and ns.list_topics() == []


def test_send_show_peek_receive(root: Path, tmp_path: Path) -> None:
    """send a file in batches, show the counts per partition, peek, receive (complete and abandon)."""
    with Namespace(root) as ns:
        ns.create_queue("q")
    lines = [f"line {i}" for i in range(30)]
    src = tmp_path / "msgs.txt"
    src.write_text("\n".join(lines[:15]) + "\n\n" + "\n".join(lines[15:]) + "\n")  # the blank line is skipped

    assert "Sent 30 message(s)" in ok(root, "send", "q", "--file", str(src), "--batch", "7")

    shown_json, table, peeked_json = ok_all(root, ("show", "q", "--json"), ("show", "q"), ("peek", "q", "--count", "5", "--json"))
    shown = as_json(shown_json)
    rt = shown["runtime"]
    assert (shown["type"], rt["active_message_count"], rt["availability_status"]) == ("queue", 30, "Available")
    assert len(rt["partitions"]) == 16
    assert sum(p["active_message_count"] for p in rt["partitions"]) == 30
    assert sum(1 for p in rt["partitions"] if p["active_message_count"]) >= 2  # batches spread over partitions
    assert shown["settings"]["lock_duration"] == 60

    assert "Partitions" in table and "Available" in table and "30" in table

    peeked = as_json(peeked_json)
    assert len(peeked) == 5 and {m["body"] for m in peeked} <= set(lines)
    assert all(m["state"] == "active" and m["sequence_number"] >> 48 == m["partition_id"] for m in peeked)

    got = as_json(ok(root, "receive", "q", "-n", "4", "--json"))
    assert len(got) == 4 and all(m["delivery_count"] == 0 and m["body"] in lines for m in got)
    out = ok(root, "receive", "q", "-n", "2", "--abandon")
    assert "Abandoned 2 message(s)" in out and "line" in out

    with Namespace(root) as ns:
        rp = ns.get_queue_runtime_properties("q")
        assert rp.active_message_count == 26  # 4 completed; 2 abandoned are available again
        with ns.get_queue_receiver("q") as r:
            bodies = []
            while got2 := r.receive_messages(max_message_count=50, max_wait_time=0.5):
                bodies += [str(m) for m in got2]
                r.complete_messages(got2)
        assert sorted(bodies + [m["body"] for m in got]) == sorted(lines)


def test_send_jsonl_and_stdin(root: Path, tmp_path: Path) -> None:
    """--jsonl sets message properties; a bad record fails before anything is sent; '-' reads stdin."""
    with Namespace(root) as ns:
        ns.create_queue("q")
    records = [
        {"body": "plain", "message_id": "m-1", "partition_key": "k", "properties": {"n": 1, "flag": True}, "subject": "s"},
        {"body": {"x": [1, 2]}, "message_id": "m-2", "correlation_id": "c", "time_to_live": 60},
        {"body_base64": base64.b64encode(b"\x00\xff").decode(), "message_id": "m-3"},
    ]
    src = tmp_path / "msgs.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    ok(root, "send", "q", "-f", str(src), "--jsonl")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "fine"}\n{"bodee": "typo"}\n')
    with ThreadPoolExecutor(2) as pool:
        rejected = pool.submit(sq, root, "send", "q", "-f", str(bad), "--jsonl")
        from_stdin = pool.submit(sq, root, "send", "q", "-f", "-", stdin="from stdin 1\nfrom stdin 2\n")
    assert rejected.result().returncode == 1 and "Traceback" not in rejected.result().stderr
    assert "line 2" in rejected.result().stderr and "bodee" in rejected.result().stderr
    assert from_stdin.result().returncode == 0, from_stdin.result().stderr

    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").active_message_count == 5  # nothing of bad.jsonl
        with ns.get_queue_receiver("q") as r:
            msgs = {m.message_id: m for m in r.peek_messages(10)}
            while more := r.peek_messages(10):
                msgs.update({m.message_id: m for m in more})
    assert msgs["m-1"].partition_key == "k" and msgs["m-1"].application_properties == {"n": 1, "flag": True}
    assert msgs["m-1"].subject == "s" and msgs["m-1"].body == b"plain"
    assert json.loads(msgs["m-2"].body) == {"x": [1, 2]} and msgs["m-2"].content_type == "application/json"
    assert msgs["m-2"].time_to_live == timedelta(seconds=60) and msgs["m-2"].correlation_id == "c"
    assert msgs["m-3"].body == b"\x00\xff"
    assert sorted(str(m) for m in msgs.values() if m.message_id not in ("m-1", "m-2", "m-3")) == ["from stdin 1", "from stdin 2"]


def test_topic_send_and_subscription_show(root: Path, tmp_path: Path) -> None:
    """A send to a topic reaches every subscription; `show TOPIC/SUB` reads one subscription."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "a")
        ns.create_subscription("t", "b")
    src = tmp_path / "m.txt"
    src.write_text("one\ntwo\nthree\n")
    assert "6 copies" in ok(root, "send", "t", "-f", str(src))
    sub_json, got_json = ok_all(root, ("show", "t/a", "--json"), ("receive", "t/b", "-n", "3", "--json"))
    sub = as_json(sub_json)
    assert (sub["type"], sub["name"], sub["runtime"]["active_message_count"]) == ("subscription", "t/a", 3)
    got = as_json(got_json)
    assert sorted(m["body"] for m in got) == ["one", "three", "two"]


def test_a_queue_named_like_a_subscription_comes_first_and_the_path_form_names_the_subscription(root: Path) -> None:
    """`show tp/all` is the queue "tp/all"; `show tp/Subscriptions/all` is subscription "all" of topic "tp"."""
    with Namespace(root) as ns:
        ns.create_topic("tp")
        ns.create_subscription("tp", "all")
        ns.create_queue("tp/all")
        with ns.get_queue_sender("tp/all") as s:
            s.send_messages(Message("q"))
        with ns.get_topic_sender("tp") as s:
            s.send_messages([Message("s1"), Message("s2")])
    calls = ("show", "tp/all", "--json"), ("show", "tp/subscriptions/all", "--json"), ("show", "tp/Subscriptions/none")
    queue, sub, missing = sq_all(root, *calls)
    assert (as_json(queue.stdout)["type"], as_json(queue.stdout)["runtime"]["active_message_count"]) == ("queue", 1)
    shown = as_json(sub.stdout)
    assert (shown["type"], shown["name"], shown["runtime"]["active_message_count"]) == ("subscription", "tp/all", 2)
    assert (
        missing.returncode == 1
        and "subscription 'tp/Subscriptions/none' does not exist" in missing.stderr
        and "Traceback" not in missing.stderr
    ), missing.stderr


def test_purge(root: Path) -> None:
    """purge empties the queue, or with --dead-letter its dead-letter sub-queue."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"m{i}") for i in range(1200)])
        dead_letter_all(ns, "q", 5)
    main, dead = ok_all(root, ("purge", "q"), ("purge", "q", "--dead-letter"))
    assert "Purged 1195 message(s)" in main and "Purged 5 message(s)" in dead
    with Namespace(root) as ns:
        rp = ns.get_queue_runtime_properties("q")
        assert (rp.active_message_count, rp.dead_letter_message_count) == (0, 0)


def test_resubmit_dead_letters(root: Path) -> None:
    """peek --dead-letter shows the reason; resubmit moves keyed and unkeyed dead letters back, properties intact."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"k{i}", message_id=f"k{i}", partition_key=f"key{i % 3}", application_properties={"i": i})
                             for i in range(6)])  # fmt: skip
            s.send_messages([Message(f"u{i}", message_id=f"u{i}", subject="unkeyed") for i in range(4)])
        dead_letter_all(ns, "q", 10)

    dlq_json, dlq_table = ok_all(root, ("peek", "q", "--dead-letter", "-n", "20", "--json"), ("peek", "q", "--dead-letter"))
    dlq = as_json(dlq_json)
    assert len(dlq) == 10 and all(m["dead_letter_reason"] == "Poison" for m in dlq)
    assert "Poison: bad input" in dlq_table

    out = ok(root, "resubmit", "q")
    assert "Resubmitted 10 dead letter(s)" in out and "6 in transactions" in out

    with Namespace(root) as ns:
        rp = ns.get_queue_runtime_properties("q")
        assert (rp.active_message_count, rp.dead_letter_message_count) == (10, 0)
        with ns.get_queue_receiver("q") as r:
            back = {m.message_id: m for m in r.receive_messages(max_message_count=10, max_wait_time=2)}
            while len(back) < 10 and (more := r.receive_messages(max_message_count=10, max_wait_time=1)):
                back.update({m.message_id: m for m in more})
    assert sorted(back) == sorted([f"k{i}" for i in range(6)] + [f"u{i}" for i in range(4)])
    assert all(
        back[f"k{i}"].partition_key == f"key{i % 3}" and back[f"k{i}"].application_properties == {"i": i} for i in range(6)
    )
    assert all(back[f"u{i}"].subject == "unkeyed" and back[f"u{i}"].body == f"u{i}".encode() for i in range(4))
    assert all(m.dead_letter_reason is None and m.delivery_count == 0 for m in back.values())


def test_resubmit_ends_when_its_copies_come_straight_back(root: Path) -> None:
    """The queue forwards to a destination deleted since: each resubmitted copy is dead-lettered again at once. The run
    moves only the dead letters that were there when it began, reports the returned ones and ends (it looped forever)."""
    with Namespace(root) as ns:
        ns.create_queue("dest")
        ns.create_queue("src", forward_to="dest")
        ns.delete_queue("dest")
        with ns.get_queue_sender("src") as s:
            s.send_messages([Message("one", message_id="one"), Message("two", message_id="two")])
        assert ns.get_queue_runtime_properties("src").dead_letter_message_count == 2  # forwarding failed at the send
    p = sq(root, "resubmit", "src")
    assert p.returncode == 1, p.stderr
    assert "Resubmitted 2 dead letter(s)" in p.stdout
    assert "2 resubmitted message(s) came straight back" in " ".join(p.stderr.split())
    with Namespace(root) as ns:
        rp = ns.get_queue_runtime_properties("src")
        assert (rp.active_message_count, rp.dead_letter_message_count) == (0, 2)
        assert ns.broker.entity("queue", "src").table.log.load().version < 20  # a few commits, not thousands


def test_resubmit_keeps_duplicates_and_needs_via_topic(root: Path) -> None:
    """A copy dropped by duplicate detection leaves its dead letter in place; subscriptions need --via-topic."""
    with Namespace(root) as ns:
        ns.create_queue("dd", requires_duplicate_detection=True)
        with ns.get_queue_sender("dd") as s:
            s.send_messages([Message("a", message_id="1"), Message("b", message_id="2")])
        dead_letter_all(ns, "dd", 2)
        ns.create_topic("t")
        ns.create_subscription("t", "s")
    p, sub, empty = sq_all(root, ("resubmit", "dd"), ("resubmit", "t/s"), ("resubmit", "t/s", "--via-topic"))
    assert p.returncode == 1 and "2 dead letter(s) were not resubmitted" in p.stderr and "duplicate detection" in p.stderr
    assert "Resubmitted" not in p.stdout  # nothing claims success
    assert empty.returncode == 0 and "No dead letters" in empty.stdout
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("dd").dead_letter_message_count == 2
    assert sub.returncode == 1 and "--via-topic" in sub.stderr


ERROR_CASES: list[tuple[tuple[str, ...], int, str]] = [
    (("show", "nosuch"), 1, "'nosuch'"),
    (("peek", "nosuch/sub"), 1, "'nosuch/sub'"),
    (("create", "queue", "bad name!"), 1, "invalid queue name 'bad name!'"),
    (("create", "subscription", "nosuch", "s"), 1, "topic 'nosuch' does not exist"),
    (("create", "queue", "q", "--lock-duration", "600"), 1, "lock_duration"),
    (("peek", "t"), 1, "'t' is a topic"),
    (("send", "t/s", "--file", __file__), 1, "send to its topic 't'"),
    (("send", "q", "--file", "/nonexistent/file.txt"), 2, "does not exist"),
    (("create", "queue", "w", "--duplicate-window", "60"), 2, "--duplicate-detection"),
    (("create", "topic", "w", "--duplicate-window", "60"), 2, "--duplicate-detection"),
    (("resubmit", "q", "--via-topic"), 1, "is a queue"),
]


def test_errors(root: Path) -> None:
    """Expected errors: one red line naming the problem, exit 1 (2 for usage errors), never a traceback."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        ns.create_topic("t")
        ns.create_subscription("t", "s")
    missing = root.parent / "typo"
    with ThreadPoolExecutor(len(ERROR_CASES) + 1) as pool:
        no_root = pool.submit(sq, missing, "list")
        results = list(pool.map(lambda args: sq(root, *args), [args for args, _, _ in ERROR_CASES]))
    assert no_root.result().returncode == 1 and "does not exist" in no_root.result().stderr
    assert not missing.exists()  # only `create` creates a namespace root
    for (args, code, expected), p in zip(ERROR_CASES, results, strict=True):
        assert p.returncode == code, f"{args}: rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
        assert "Traceback" not in p.stderr + p.stdout
        assert expected in p.stderr, f"{args}: {p.stderr}"
        if code == 1:
            assert p.stderr.startswith("Error: ") and p.stderr.count("\n") == 1, p.stderr
    with Namespace(root) as ns:
        assert [q.name for q in ns.list_queues()] == ["q"]  # nothing was created by the failed commands


def test_message_from_json() -> None:
    """JSON-lines records: exactly one body field, known fields only, typed TTL and schedule."""
    m = ops.message_from_json({"body": "x", "scheduled_enqueue_time_utc": "2030-01-01T00:00:00Z", "time_to_live": 1.5})
    assert m.scheduled_enqueue_time_utc is not None and m.scheduled_enqueue_time_utc.year == 2030
    assert m.time_to_live == timedelta(seconds=1.5)
    bad_records: list[object] = [
        {"message_id": "no body"},
        {"body": "a", "body_base64": "YQ=="},
        {"body": None},
        {"body": "a", "time_to_live": "1"},
        {"body": "a", "scheduled_enqueue_time_utc": "soon"},
        {"body_base64": "***"},
        ["not", "an", "object"],
    ]
    for bad in bad_records:
        with pytest.raises(ValueError):
            ops.message_from_json(bad)


def test_rule_commands(root: Path) -> None:
    """rule create (SQL, correlation, action), list (table and JSON), delete; the rules then route messages."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "s")
    ok(root, "rule", "create", "t", "s", "big", "--sql", "region = 'eu' AND qty > 10", "--action", "SET routed = 'big'")
    ok(root, "rule", "create", "t", "s", "vip", "--correlation-id", "c-1", "--property", "tier=vip", "-p", "level=3")
    ok(root, "rule", "delete", "t", "s", "$Default")
    table, listed = ok_all(root, ("rule", "list", "t", "s"), ("rule", "list", "t", "s", "--json"))
    rules = {r["name"]: r for r in as_json(listed)}
    assert sorted(rules) == ["big", "vip"]
    assert rules["big"]["filter"]["sql_expression"] == "region = 'eu' AND qty > 10"
    assert rules["big"]["action"] == {"sql_expression": "SET routed = 'big'"}
    assert rules["vip"]["filter"]["correlation_id"] == "c-1"
    assert rules["vip"]["filter"]["properties"] == {"tier": "vip", "level": 3}  # numbers stay numbers
    assert "region = 'eu' AND qty > 10" in table and 'correlation_id = "c-1"' in table
    with Namespace(root) as ns:
        with ns.get_topic_sender("t") as s:
            s.send_messages([
                Message("eu", application_properties={"region": "eu", "qty": 20}),
                Message("small", application_properties={"region": "eu", "qty": 2}),
                Message("vip", correlation_id="c-1", application_properties={"tier": "vip", "level": 3}),
                Message("vip-as-text", correlation_id="c-1", application_properties={"tier": "vip", "level": "3"}),
            ])  # fmt: skip
        with ns.get_subscription_receiver("t", "s") as r:
            got = {str(m): m for m in r.receive_messages(10, max_wait_time=2)}
    assert sorted(got) == ["eu", "vip"]
    assert got["eu"].application_properties["routed"] == "big"
    bad = sq_all(
        root,
        ("rule", "create", "t", "s", "x", "--sql", "a = 1", "--property", "b=2"),
        ("rule", "create", "t", "s", "y", "--sql", "a = = 1"),
        ("rule", "create", "t", "s", "z", "--property", "novalue"),
        ("rule", "delete", "t", "s", "nosuch"),
        ("rule", "list", "t", "nosuch"),
    )
    for p in bad:
        assert p.returncode == 1 and p.stderr.startswith("Error: ") and "Traceback" not in p.stderr, p.stderr
    with Namespace(root) as ns:
        assert sorted(r.name for r in ns.list_rules("t", "s")) == ["big", "vip"]  # failed commands changed nothing


def test_relative_root_works_from_another_directory(tmp_path: Path) -> None:
    """A namespace created with a relative --root opens by absolute path, and by another relative path, elsewhere."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()

    def run(cwd: Path, *args: str) -> str:
        env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
        env.pop("SPARKQUEUE_ROOT", None)
        p = subprocess.run([sys.executable, "-m", "sparkqueue.cli", *args], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=CLI_TIMEOUT_S)  # fmt: skip
        assert p.returncode == 0, f"{args}: {p.stderr}"
        return p.stdout

    run(home, "--root", "cli-data", "create", "queue", "q")
    (home / "lines.txt").write_text("a\nb\nc\n")
    run(home, "--root", "cli-data", "send", "q", "--file", "lines.txt")
    for root in (str(home / "cli-data"), "../home/cli-data"):
        shown = as_json(run(elsewhere, "--root", root, "show", "q", "--json"))
        assert shown["runtime"]["active_message_count"] == 3


def test_purge_and_any_session_on_a_session_queue(root: Path) -> None:
    """purge of a session queue purges every session and exits 0, also when empty; receive and peek with
    --session '*' on an empty queue wait --wait and report no messages, exit 0, as without sessions."""
    with Namespace(root) as ns:
        ns.create_queue("sq", requires_session=True)
        with ns.get_queue_sender("sq") as s:
            s.send_messages([Message(f"m{i}", session_id=f"s{i % 3}") for i in range(7)])
    assert "Purged 7 message(s)" in ok(root, "purge", "sq")
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("sq").active_message_count == 0
    empty = ok_all(
        root,
        ("purge", "sq"),
        ("receive", "sq", "--session", "*", "--wait", "1"),
        ("peek", "sq", "--session", "*"),
        ("receive", "sq", "--session", "*", "--json"),
    )
    assert "Purged 0 message(s)" in empty[0]
    assert "No messages in queue 'sq'." in empty[1] and "No messages in queue 'sq'." in empty[2]
    assert as_json(empty[3]) == []


def test_stdin_send_failing_midway_says_how_many_were_sent(root: Path) -> None:
    """A bad record read from stdin after some batches were sent fails with an error saying how many were sent."""
    with Namespace(root) as ns:
        ns.create_queue("q")
    lines = "".join(f'{{"body": "m{i}"}}\n' for i in range(3)) + '{"body": "x", "bogus": 1}\n'
    p = sq(root, "send", "q", "--file", "-", "--jsonl", "--batch", "2", stdin=lines)
    assert p.returncode == 1 and "line 4" in p.stderr, p.stderr
    assert "the first 2 message(s) were already sent to queue 'q'" in p.stderr, p.stderr
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").active_message_count == 2


def test_rule_list_shows_typed_correlation_properties(root: Path) -> None:
    """rule list (table) shows datetime, timedelta and UUID correlation properties as --json does."""
    when, uid = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC), uuid.UUID(int=7)
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "s")
        props = {"when": when, "wait": timedelta(seconds=3), "id": uid}
        ns.create_rule("t", "s", "typed", filter=CorrelationRuleFilter(properties=props))
    table = ok(root, "rule", "list", "t", "s")
    assert f'when = "{when.isoformat()}"' in table and "wait = 3.0" in table and f'id = "{uid}"' in table, table


@pytest.mark.parametrize("item", ["a=1e999", "a=-1e999"])
def test_property_out_of_range_for_a_number_is_refused(item: str) -> None:
    """--property a=1e999 would be an infinity, which no rule can store: a one-line CLI error."""
    with pytest.raises(CliError, match="out of range"):
        property_value(item)


def test_receive_settles_nothing_when_its_output_cannot_be_written(root: Path) -> None:
    """A reader that closed its end of the pipe: the messages were completed (and so lost) or left locked until expiry."""
    assert sq(root, "create", "queue", "q").returncode == 0
    assert sq(root, "send", "q", "--file", "-", stdin="".join(f"m{i}\n" for i in range(20))).returncode == 0
    env = {**os.environ, "SPARKQUEUE_ROOT": str(root), "NO_COLOR": "1"}
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "sparkqueue.cli", "receive", "q", "-n", "20", "--json"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )
    finally:
        os.close(w)
    assert done.returncode == 1
    assert "the output could not be written" in done.stderr and "20 message(s) were abandoned" in done.stderr
    with Namespace(str(root)) as ns, ns.get_queue_receiver("q", max_wait_time=1) as rcv:
        got = rcv.receive_messages(20)  # at once: abandoned, not locked until their locks expire
        assert sorted(str(m) for m in got) == sorted(f"m{i}" for i in range(20))


def test_reading_commands_never_make_a_namespace_of_an_existing_folder(tmp_path: Path) -> None:
    """`list` and `check` on any existing folder wrote _catalog and _sparkqueue.json into it (a table's folder too)."""
    folder = tmp_path / "not-a-namespace"
    folder.mkdir()
    for args in (("list",), ("check",), ("peek", "q")):
        done = sq(folder, *args)
        assert done.returncode == 1 and "there is no sparkqueue namespace" in done.stderr, (args, done.stderr)
    assert list(folder.iterdir()) == []
    assert sq(folder, "create", "queue", "q").returncode == 0  # creating is what makes one
    assert sq(folder, "list").returncode == 0


def test_what_peek_json_prints_sends_again_with_jsonl(root: Path, tmp_path: Path) -> None:
    """Its broker-assigned fields (sequence_number, state, ...) were refused as unknown, so a peek could not be replayed."""
    ok(root, "create", "queue", "src")
    ok(root, "create", "queue", "dst")
    src = tmp_path / "in.jsonl"
    src.write_text('{"body": "a", "subject": "s", "application_properties": {"n": 1}}\n{"body_base64": "AP8="}\n')
    ok(root, "send", "src", "-f", str(src), "--jsonl")
    peeked = json.loads(ok(root, "peek", "src", "--count", "10", "--json"))
    again = tmp_path / "again.jsonl"
    again.write_text("".join(json.dumps(m) + "\n" for m in peeked))
    ok(root, "send", "dst", "-f", str(again), "--jsonl")
    with Namespace(str(root)) as ns, ns.get_queue_receiver("dst") as r:
        got = sorted(r.peek_messages(10), key=lambda m: m.body)
    assert [(m.body, m.subject, m.application_properties) for m in got] == [(b"\x00\xff", None, None), (b"a", "s", {"n": 1})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x", "sequence_numbr": 1}\n')  # a misspelt field is still refused
    assert "unknown field(s) sequence_numbr" in sq(root, "send", "dst", "-f", str(bad), "--jsonl").stderr


def test_peek_from_a_sequence_number_says_what_it_looked_for(root: Path) -> None:
    """With --from-sequence past every message, the CLI said "No messages in queue 'q'" though the queue held some."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            (seq,) = s.send_messages(Message("m"))
    assert "No messages numbered" in ok(root, "peek", "q", "--from-sequence", str(seq + 1))
    assert "Peeked 1 message(s)" in ok(root, "peek", "q", "--from-sequence", str(seq))


def test_damaged_storage_is_one_line_without_verbose(root: Path) -> None:
    """A lost data file: peek, receive and show printed the library's damage log (wrapped over three lines, three times for
    show --json) before their error. Without --verbose the command's one-line error is all; --verbose shows the log."""
    ok(root, "create", "queue", "q", "--no-partitioning")
    ok(root, "send", "q", "-f", "-", stdin="x\n")
    for f in Path(root, "entities").rglob("*.parquet"):
        f.unlink()
    for args in (("peek", "q"), ("receive", "q")):
        p = sq(root, *args)
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error:"), (args, p.returncode, p.stderr)
    shown = sq(root, "show", "q", "--json")  # reports the partition's state, as runtime properties do
    assert (shown.returncode, shown.stderr.strip()) == (0, "") and "Limited" in shown.stdout
    verbose = sq(root, "--verbose", "peek", "q")
    assert "storage damage" in verbose.stderr and verbose.returncode == 1


@pytest.mark.parametrize(("wait", "said"), [("nan", "nan is not a number of seconds"), ("5000", "not between 0 and 3600")])
def test_receive_wait_out_of_range_says_why(root: Path, wait: str, said: str) -> None:
    """--wait nan was refused as "should be less than or equal to 3600"."""
    ok(root, "create", "queue", "q")
    p = sq(root, "receive", "q", "--wait", wait)
    assert p.returncode == 2 and said in p.stderr


def test_a_duration_under_a_microsecond_says_so(root: Path) -> None:
    """--ttl 0.0000001 said "must be positive, got 0:00:00": the value was rounded to 0 before the check."""
    p = sq(root, "create", "queue", "q", "--ttl", "0.0000001")
    assert p.returncode == 1 and "1e-07 seconds is under a microsecond" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_rule_create_names_the_action_it_stored(root: Path) -> None:
    ok(root, "create", "topic", "t")
    ok(root, "create", "subscription", "t", "s")
    assert "action: SET x = 1" in ok(root, "rule", "create", "t", "s", "r", "--action", "SET x = 1")


# ---- review of the CLI: data loss, batch sizes, damaged storage, refused creates ----------------------------------


def dlq_receivable(ns: Namespace, topic: str, sub: str) -> int:
    """How many dead letters of a subscription a receiver gets at once (locked ones it does not)."""
    with ns.get_subscription_receiver(topic, sub, sub_queue=SubQueue.DEAD_LETTER) as r:
        got = r.receive_messages(max_message_count=50, max_wait_time=1)
        r.abandon_messages(got)
        return len(got)


def test_resubmit_via_topic_leaves_dead_letters_no_subscription_stored(root: Path) -> None:
    """A copy that matched no subscription stored nothing, yet its dead letter was completed: the message was lost."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "s1")
        with ns.get_topic_sender("t") as s:
            s.send_messages([Message(b) for b in "abc"])
        with ns.get_subscription_receiver("t", "s1") as r:
            for m in r.receive_messages(max_message_count=3, max_wait_time=2):
                r.dead_letter_message(m, reason="Poison")
        ns.create_rule("t", "s1", "eu", filter=CorrelationRuleFilter(properties={"region": "eu"}))
        ns.delete_rule("t", "s1", "$Default")  # the dead letters (no region) now match no rule
    p = sq(root, "resubmit", "t/s1", "--via-topic")
    assert p.returncode == 1, p.stdout + p.stderr
    said = " ".join(p.stderr.split())
    assert "3 dead letter(s) were not resubmitted" in said and "no subscription of topic 't' stored a copy" in said, said
    with Namespace(root) as ns:
        assert dlq_receivable(ns, "t", "s1") == 3  # still there, and released (not left locked)


def test_resubmit_via_topic_keeps_the_locks_of_a_short_lock_subscription_until_each_copy_is_sent(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies to a topic go one by one while the receive's batch of dead letters stays locked: with a 1 s lock the
    locks lapsed midway, the run failed, and a dead letter already copied stayed in the dead-letter queue too.

    Each copy is slowed by 0.1 s, so the run outlasts the 5 s lock several times on any machine (a race of a short
    lock against a loaded machine's renewer proved nothing but the machine's load).
    """
    from sparkqueue.sender import Sender

    lock = timedelta(seconds=5)
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "s")
        with ns.get_topic_sender("t") as s:
            s.send_messages([Message(f"body {i}", message_id=f"m{i}") for i in range(150)])
        with ns.get_subscription_receiver("t", "s") as r:
            left = 150
            while left:
                got = r.receive_messages(max_message_count=left, max_wait_time=2)
                for m in got:
                    r.dead_letter_message(m, reason="Poison")
                left -= len(got)
        ns.update_subscription("t", ns.get_subscription("t", "s"), lock_duration=lock)
    send = Sender.send_messages

    def slow_send(self: Sender, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.1)
        return send(self, *args, **kwargs)

    monkeypatch.setattr(Sender, "send_messages", slow_send)
    with Namespace(root) as ns:
        target = ops.resolve(ns, "t/s")
        result = ops.ResubmitResult(ops.resubmit_destination(ns, target, via_topic=True))
        began = time.monotonic()
        ops.resubmit(ns, target, result)
        took = time.monotonic() - began
    monkeypatch.undo()
    assert took > 2 * lock.total_seconds()  # the run outlasted the lock: the renewer kept the dead letters locked
    assert result.at_least_once == 150
    with Namespace(root) as ns:
        with ns.get_subscription_receiver("t", "s") as r:
            main = Counter(m.message_id for m in peek_all(r))
        with ns.get_subscription_receiver("t", "s", sub_queue=SubQueue.DEAD_LETTER) as r:
            dead = Counter(m.message_id for m in peek_all(r))
    assert main == Counter(f"m{i}" for i in range(150)) and not dead


def test_send_fills_batches_by_size_not_only_by_count(root: Path, tmp_path: Path) -> None:
    """1,000 lines of 1,000 bytes are each a valid message, but 500 of them do not fit one send: the file was refused."""
    ok(root, "create", "queue", "q")
    src = tmp_path / "big.txt"
    src.write_text("".join(str(i).ljust(1000, "x") + "\n" for i in range(1000)))
    assert "Sent 1000 message(s)" in ok(root, "send", "q", "-f", str(src))
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").active_message_count == 1000


def test_resubmit_fills_sends_and_transactions_by_size(root: Path) -> None:
    """100 dead letters of 3 KB (one send of 300 KB) and 60 keyed ones of 6 KB (a 50-message transaction of 300 KB)
    could not be resubmitted: each send must fit one batch."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            for i in range(0, 100, 40):
                s.send_messages([Message(str(j).ljust(3000, "u")) for j in range(i, min(i + 40, 100))])
            for i in range(0, 60, 30):
                s.send_messages([Message(str(j).ljust(6000, "k"), partition_key="key") for j in range(i, i + 30)])
        dead_letter_all(ns, "q", 160)
    out = ok(root, "resubmit", "q")
    assert "Resubmitted 160 dead letter(s)" in out and "60 in transactions" in out, out
    with Namespace(root) as ns:
        rp = ns.get_queue_runtime_properties("q")
        assert (rp.active_message_count, rp.dead_letter_message_count) == (160, 0)


def test_resubmit_failing_midway_releases_the_dead_letters_it_received(root: Path) -> None:
    """An error midway (here an interrupt after the first send) left the dead letters received but not yet moved locked
    until their locks expired, so a second run skipped them; they are abandoned, and the result says what was moved."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            for i in range(10):
                s.send_messages(Message(str(i).ljust(100_000, "x")))  # two fill a send
        dead_letter_all(ns, "q", 10)

    def interrupt(_: int) -> None:
        raise KeyboardInterrupt

    with Namespace(root) as ns:
        target = ops.resolve(ns, "q")
        result = ops.ResubmitResult(ops.resubmit_destination(ns, target, via_topic=False))
        with pytest.raises(KeyboardInterrupt):
            ops.resubmit(ns, target, result, batch=10, progress=interrupt)
        assert result.resubmitted == 2
        with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as r:
            assert len(r.receive_messages(max_message_count=20, max_wait_time=1)) == 8  # not locked: available at once


def damage_partition(root: Path, entity: str = "queue") -> int:
    """Delete the data files of the first partition of the namespace's only queue (or topic) that has any; its id."""
    (table,) = Path(root, "entities").glob(f"{entity}-*")
    part = next(p for p in sorted(table.glob("partition_id=*")) if any(p.glob("*.parquet")))
    for f in part.glob("*.parquet"):
        f.unlink()
    return int(part.name.split("=")[1])


def test_purge_and_resubmit_with_a_damaged_partition_say_what_they_did(tmp_path: Path) -> None:
    """Both did their work on the readable partitions, then failed saying "nothing was received"."""
    roots = {kind: tmp_path / kind for kind in ("purge", "resubmit")}
    left = {}
    for kind, root in roots.items():
        with Namespace(root) as ns:
            ns.create_queue("q")
            with ns.get_queue_sender("q") as s:
                s.send_messages([Message(f"m{i}", partition_key=f"k{i}") for i in range(40)])
            if kind == "resubmit":
                dead_letter_all(ns, "q", 40)
            parts = ns.get_queue_runtime_properties("q").partitions
        down = damage_partition(root)
        left[kind] = parts[down].total_message_count
    with ThreadPoolExecutor(2) as pool:
        purged = pool.submit(sq, roots["purge"], "purge", "q")
        moved = pool.submit(sq, roots["resubmit"], "resubmit", "q")
    p, r = purged.result(), moved.result()
    assert p.returncode == 1 and p.stderr.startswith(f"Error: Purged {40 - left['purge']} message(s) from queue 'q'; then:")
    assert "sparkqueue check" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert r.returncode == 1 and r.stderr.startswith(f"Error: Resubmitted {40 - left['resubmit']} dead letter(s)"), r.stderr
    assert "Then:" in r.stderr and "sparkqueue check" in r.stderr, r.stderr


def test_a_refused_create_makes_no_namespace(tmp_path: Path) -> None:
    """A refused create at a new root made the namespace all the same (and fixed its tier to standard)."""
    new, fwd, sized = tmp_path / "new", tmp_path / "fwd", tmp_path / "sized"
    bad_name, bad_forward, too_big = sq_all(
        new,
        ("create", "queue", "bad name"),
        ("--root", str(fwd), "create", "queue", "q", "--forward-to", "nothere"),
        ("--root", str(sized), "create", "topic", "t", "--max-size", "81920"),
    )
    assert bad_name.returncode == 1 and "invalid queue name" in bad_name.stderr
    assert bad_forward.returncode == 1 and "'nothere'" in bad_forward.stderr, bad_forward.stderr
    assert too_big.returncode == 1 and "standard tier" in too_big.stderr
    assert not new.exists() and not fwd.exists() and not sized.exists()
    ok(sized, "--tier", "premium", "create", "topic", "t", "--max-size", "81920")  # the retry in the right tier works
    with Namespace(sized) as ns:
        assert (ns.tier, ns.get_topic("t").max_size_in_megabytes) == ("premium", 81920)


def test_send_file_checks_the_entity_rules_before_sending_anything(root: Path, tmp_path: Path) -> None:
    """A session queue: the record without a session id, after the first batch, failed only once 500 were sent."""
    ok(root, "create", "queue", "s", "--sessions")
    src = tmp_path / "orders.jsonl"
    src.write_text("".join(json.dumps({"body": f"m{i}", "session_id": "cart-1"}) + "\n" for i in range(600)) + '{"body": "x"}\n')
    p = sq(root, "send", "s", "-f", str(src), "--jsonl")
    assert p.returncode == 1 and "line 601" in p.stderr and "session_id" in p.stderr and "already sent" not in p.stderr
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("s").active_message_count == 0


def test_show_and_list_mark_the_counts_of_an_unreadable_partition_as_lower_bounds(root: Path) -> None:
    """A missing data file: show and list printed 0 (not "at least 0") for the damaged partition's counts."""
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message("a"), Message("b")])
    damage_partition(root)
    shown, listed, table = sq_all(root, ("show", "q"), ("list", "--json"), ("list",))
    assert shown.returncode == 0 and "≥0" in shown.stdout and "lower bounds" in shown.stderr, shown.stdout + shown.stderr
    assert "sparkqueue check" in shown.stderr
    (q,) = as_json(listed.stdout)["queues"]
    assert (q["counts_complete"], q["availability_status"]) == (False, "Limited")
    assert table.returncode == 0 and "≥0" in table.stdout and "lower bounds" in table.stderr


def test_list_shows_a_queue_whose_log_is_torn_as_unknown_and_the_others(root: Path) -> None:
    """One queue's torn newest log entry made `list` exit 1 without listing anything: it lists every entity, that one
    with availability Unknown and its counts as lower bounds."""
    import glob

    with Namespace(root) as ns:
        for name in ("bad", "good"):
            ns.create_queue(name, enable_partitioning=False)
            with ns.get_queue_sender(name) as s:
                s.send_messages([Message("a"), Message("b")])
        bad_log = ns.broker.entity("queue", "bad").table.uri + "/_delta_log"
    newest = sorted(glob.glob(bad_log + "/*.json"))[-1]
    Path(newest).write_bytes(Path(newest).read_bytes()[:20])
    listed, table = sq_all(root, ("list", "--json"), ("list",))
    assert listed.returncode == 0, listed.stderr
    by_name = {q["name"]: q for q in as_json(listed.stdout)["queues"]}
    assert (by_name["bad"]["availability_status"], by_name["bad"]["counts_complete"]) == ("Unknown", False)
    assert (by_name["good"]["active_message_count"], by_name["good"]["counts_complete"]) == (2, True)
    assert table.returncode == 0 and "good" in table.stdout and "≥0" in table.stdout, table.stdout + table.stderr


def test_rule_create_refuses_a_repeated_property_and_echoes_subject(root: Path) -> None:
    """--property region=eu --property region=us kept only "us"; --subject was echoed as `label`."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "s")
    twice, subject, param = sq_all(
        root,
        ("rule", "create", "t", "s", "r", "--property", "region=eu", "--property", "region=us"),
        ("rule", "create", "t", "s", "r2", "--subject", "orders"),
        ("rule", "create", "t", "s", "r3", "--sql", "a = @p"),
    )
    assert twice.returncode == 1 and "'region' is given twice" in twice.stderr, twice.stderr
    assert subject.returncode == 0 and 'subject = "orders"' in subject.stdout and "label" not in subject.stdout
    assert param.returncode == 1 and "parameters=" not in param.stderr and "@p" in param.stderr, param.stderr
    with Namespace(root) as ns:
        assert sorted(r.name for r in ns.list_rules("t", "s")) == ["$Default", "r2"]


def test_peek_of_a_session_another_receiver_holds_says_why(root: Path) -> None:
    """peek browses a session through a session receiver (SDK semantics): the help says so, and so does the error."""
    with Namespace(root) as ns:
        ns.create_queue("s", requires_session=True)
        ns.create_queue("plain")
        with ns.get_queue_sender("s") as snd:
            snd.send_messages(Message("x", session_id="s1"))
        with ns.get_queue_receiver("s", session_id="s1"):
            held, no_sessions, helped = sq_all(
                root, ("peek", "s", "--session", "s1"), ("peek", "plain", "--session", "s1"), ("peek", "--help")
            )
    assert held.returncode == 1 and "locked by another receiver" in held.stderr
    assert "Browsing a session takes its lock" in " ".join(held.stderr.split()), held.stderr
    assert no_sessions.returncode == 1 and "--session" in no_sessions.stderr and "requires_session" not in no_sessions.stderr
    assert "session is locked while it is browsed" in " ".join(helped.stdout.split())


def test_topic_send_says_stored_not_delivered(root: Path, tmp_path: Path) -> None:
    """A session subscription dead-letters copies without a session id on arrival: "3 copies in subscriptions" read as
    delivered. The send cannot tell which copies were dead-lettered, so the output says what it knows: stored."""
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "orders", requires_session=True)
    src = tmp_path / "m.txt"
    src.write_text("a\nb\nc\n")
    out = ok(root, "send", "t", "-f", str(src))
    assert "its subscriptions stored 3 copies" in out and "in subscriptions" not in out, out


def test_small_things(root: Path) -> None:
    """A pipe given as --file was refused; the message table's times had no year; `python -m sparkqueue` did not run."""
    ok(root, "create", "queue", "q")
    piped = sq(root, "send", "q", "-f", "/dev/stdin", stdin="one\ntwo\n")  # a pipe, not a regular file
    assert piped.returncode == 0 and "Sent 2 message(s)" in piped.stdout, piped.stderr
    assert f"{datetime.now(UTC).year}-" in ok(root, "peek", "q")
    env = {**os.environ, "SPARKQUEUE_ROOT": str(root)}
    main = subprocess.run([sys.executable, "-m", "sparkqueue", "--version"], capture_output=True, text=True, env=env,
                          timeout=CLI_TIMEOUT_S, check=False)  # fmt: skip
    assert main.returncode == 0 and main.stdout.startswith("sparkqueue "), main.stderr
