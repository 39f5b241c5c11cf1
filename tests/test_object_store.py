"""The core contract on a local disk and on a real object store (Azurite), and the store's failure modes.

Every test taking `store` runs twice: on a local directory and on an Azurite container. Child
processes open `Namespace(root)` from the store's environment variables, as a Spark executor or
a second job would.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from azurite import Store
from deltalake import DeltaTable
from lossy_proxy import LossyProxy
from procs import drain_all, peek_all, receive_and_complete, send_and_lock_until_killed, send_dying_at_commit

from sparkqueue import Message, Namespace, ReceiveMode, SubQueue
from sparkqueue.errors import InvalidOperationError, StorageError
from sparkqueue.storage.files import encode_parquet
from sparkqueue.storage.store import open_store

CTX = mp.get_context("spawn")


def _table(ns: Namespace, name: str = "q") -> str:
    return ns.table_uri(ns.broker.entry("queue", name).table_path)


def test_send_receive_settle_and_delta_rs_reads_the_same_table(store: Store) -> None:
    with store.open() as ns:
        ns.create_queue("q", max_delivery_count=2)
        with ns.get_queue_sender("q") as s:
            seqs = s.send_messages([Message(f"m{i}", message_id=f"m{i}", partition_key=f"k{i % 5}") for i in range(40)])
            seqs += s.send_messages([Message(f"u{i}", message_id=f"u{i}") for i in range(20)])
        assert len(set(seqs)) == 60
        with ns.get_queue_receiver("q", max_wait_time=1) as r:
            got = drain_all(r)
            assert sorted(m.message_id for m in got) == sorted([f"m{i}" for i in range(40)] + [f"u{i}" for i in range(20)])
            for m in got[:30]:
                r.complete_message(m)
            for m in got[30:40]:
                r.dead_letter_message(m, reason="bad")
            for m in got[40:]:
                r.abandon_message(m)
            again = drain_all(r)
            assert sorted(m.message_id for m in again) == sorted(m.message_id for m in got[40:])
            first = {m.message_id: m.delivery_count for m in got}
            assert all(m.delivery_count == first[m.message_id] + 1 for m in again)
        rp = ns.get_queue_runtime_properties("q")
        assert (rp.active_message_count, rp.dead_letter_message_count) == (20, 10)
        with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as d:
            assert sorted(m.message_id for m in drain_all(d)) == sorted(m.message_id for m in got[30:40])
        dt = DeltaTable(_table(ns), storage_options=store.storage_options)
        rows = dt.to_pyarrow_table(columns=["message_id", "sub_queue"]).to_pylist()
        assert Counter(r["sub_queue"] for r in rows) == {"main": 20, "deadletter": 10}


def test_duplicate_detection_drops_repeats(store: Store) -> None:
    with store.open() as ns:
        ns.create_queue("q", requires_duplicate_detection=True)
        with ns.get_queue_sender("q") as s:
            assert len(s.send_messages([Message("a", message_id=f"id{i}") for i in range(10)])) == 10
            assert s.send_messages([Message("b", message_id=f"id{i}") for i in range(10)]) == []
        with ns.get_queue_receiver("q", max_wait_time=1) as r:
            got = drain_all(r)
            for m in got:
                r.complete_message(m)
        with ns.get_queue_sender("q") as s:
            assert s.send_messages([Message("c", message_id=f"id{i}") for i in range(10)]) == []
        assert len(got) == 10


def test_a_namespace_reopens_from_another_process_and_lists_its_entities(store: Store) -> None:
    with store.open() as ns:
        ns.create_queue("a")
        ns.create_topic("t")
        ns.create_subscription("t", "s")
    with store.open() as again:
        assert [q.name for q in again.list_queues()] == ["a"]
        assert [s.name for s in again.list_subscriptions("t")] == ["s"]


def test_competing_receiver_processes_complete_each_message_exactly_once(store: Store) -> None:
    total = 300
    with store.open() as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            for start in range(0, total, 100):
                s.send_messages([Message(str(i), message_id=f"m{i}") for i in range(start, start + 100)])
    barrier, done, results = CTX.Barrier(3), CTX.Value("i", 0), CTX.Queue()
    procs = [CTX.Process(target=receive_and_complete, args=(store.root, "q", barrier, done, total, results, w)) for w in range(3)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    delivered = Counter(mid for _, d, _, _ in reports for mid, _ in d)
    assert [mid for mid, n in delivered.items() if n > 1] == [], "a message was delivered twice under a 60 s lock"
    assert sum(lost for *_, lost in reports) == 0
    completed = [mid for _, _, c, _ in reports for mid in c]
    assert len(completed) == total
    assert Counter(completed) == Counter(f"m{i}" for i in range(total))


def test_a_sender_killed_mid_operation_loses_and_duplicates_nothing(store: Store, tmp_path: Path) -> None:
    with store.open() as ns:
        ns.create_queue("q")
    sent, locked = tmp_path / "sent", tmp_path / "locked"
    proc = CTX.Process(target=send_and_lock_until_killed, args=(store.root, "q", str(sent), str(locked), 5))
    proc.start()
    give_up = time.monotonic() + 120
    while (not sent.exists() or len(sent.read_text().split()) < 40) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    acknowledged = set(sent.read_text().split())
    assert len(acknowledged) >= 40
    with store.open() as ns:
        rp = ns.get_queue_runtime_properties("q")
        stored = Counter(m.message_id for m in _peek_all(ns))
    assert all(n == 1 for n in stored.values())  # no duplicates, no half batch written twice
    assert acknowledged <= set(stored)  # every acknowledged message is there
    assert len(stored) % 5 == 0  # batches are whole
    assert rp.total_message_count == len(stored)


def _peek_all(ns: Namespace) -> list[Any]:
    with ns.get_queue_receiver("q") as r:
        out = r.peek_messages(500, sequence_number=0)
        while True:
            more = r.peek_messages(500)
            if not more:
                return out
            out += more


def test_a_sender_killed_between_its_data_files_and_its_commit_leaves_nothing_visible(store: Store) -> None:
    """A real process killed half-way through a commit: its files are on the store, none of its messages is seen."""
    with store.open() as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages(Message("kept", message_id="kept"))
        before = {e.path for e in ns.broker.entity("queue", "q").table.store.list() if e.path.endswith(".parquet")}
    proc = CTX.Process(target=send_dying_at_commit, args=(store.root, "q", 40))
    proc.start()
    proc.join(180)
    assert proc.exitcode == -signal.SIGKILL
    with store.open() as ns:
        table = ns.broker.entity("queue", "q").table
        written = {e.path for e in table.store.list() if e.path.endswith(".parquet")} - before
        assert written and not written & {f.path for f in table.snapshot().files}  # files written, none committed
        assert ns.get_queue_runtime_properties("q").total_message_count == 1
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"y{i}", message_id=f"y{i}", partition_key=f"x{i}") for i in range(40)])
        with ns.get_queue_receiver("q", max_wait_time=1) as r:
            got = sorted(m.message_id for m in drain_all(r))
        assert got == sorted(["kept", *(f"y{i}" for i in range(40))])
        ids = DeltaTable(_table(ns), storage_options=store.storage_options).to_pyarrow_table(columns=["message_id"])
        assert not [i for i in ids.column("message_id").to_pylist() if i.startswith("x")]


def test_a_data_file_written_without_its_commit_is_invisible_and_vacuumed(store: Store) -> None:
    """A commit that failed half-way (file written, log entry not) shows nothing; vacuum removes the orphan once old."""
    with store.open() as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages(Message("kept"))
        entity = ns.broker.entity("queue", "q")
        orphan = "partition_id=3/part-orphan.parquet"
        entity.table.store.put(orphan, encode_parquet(entity.table.data.read(next(iter(entity.table.snapshot().files)).path)))
        assert ns.get_queue_runtime_properties("q").total_message_count == 1
        from datetime import timedelta

        ns.run_maintenance(vacuum_retention=timedelta(0))
        assert entity.table.store.exists(orphan)  # young: it may still belong to a live writer
        from sparkqueue.storage import maintenance

        maintenance.ORPHAN_RETENTION, saved = timedelta(0), maintenance.ORPHAN_RETENTION
        try:
            ns.run_maintenance(vacuum_retention=timedelta(0))
        finally:
            maintenance.ORPHAN_RETENTION = saved
        assert not entity.table.store.exists(orphan)
        with ns.get_queue_receiver("q", max_wait_time=1) as r:
            assert [str(m) for m in r.receive_messages(5)] == ["kept"]


def test_wrong_credentials_and_missing_containers_are_clear_errors(azurite: Any) -> None:
    container = azurite.create_container()
    bad_key = azurite.storage_options(key="A" * 86 + "==")
    with pytest.raises(StorageError, match=container):
        Namespace(f"az://{container}/ns", storage_options=bad_key)
    with pytest.raises(StorageError, match="no-such-container"):
        Namespace("az://no-such-container/ns", storage_options=azurite.storage_options())


def _lossy(azurite: Any, kind: str) -> tuple[LossyProxy, Namespace, Namespace, list[bool]]:
    """A namespace reaching Azurite through a proxy that, once armed, drops the reply of one conditional log-entry create.

    kind "entity": an entity table's entry; "catalog": the catalog's. Returns the proxy, the namespace
    behind it, one reaching Azurite directly (another process's view), and the arming switch.
    """
    armed = [False]
    folder = "/_catalog/_delta_log/" if kind == "catalog" else "/entities/"

    def rule(method: str, path: str, headers: dict[str, str]) -> bool:
        hit = armed[0] and method == "PUT" and folder in path and ".json" in path and "if-none-match" in headers
        if hit and "_delta_log/" in path:
            armed[0] = False
            return True
        return False

    proxy = LossyProxy(azurite.port, rule)
    container = azurite.create_container()
    root = f"az://{container}/ns"
    Namespace(root, storage_options=azurite.storage_options()).create_queue("q")
    return (
        proxy,
        Namespace(root, storage_options=proxy.storage_options(azurite.storage_options())),
        Namespace(root, storage_options=azurite.storage_options()),
        armed,
    )


def test_a_commit_whose_reply_was_lost_counts_as_landed(azurite: Any) -> None:
    """The log entry's conditional create succeeded, its reply was lost, and obstore's retry was refused as existing.

    Before, that refusal read as a lost race: the send's data file was deleted under the entry that
    named it (the partition damaged, the acknowledged message gone), and a completion that landed was
    reported as not applied. The entry carries a unique id, so the refused create recognizes its own.
    """
    proxy, ns, direct, armed = _lossy(azurite, "entity")
    try:
        with ns.get_queue_sender("q") as s:
            s.send_messages(Message("first"))
            armed[0] = True
            s.send_messages(Message("second"))
        assert proxy.dropped == 1
        assert direct.check() == []
        with ns.get_queue_receiver("q") as r:
            got = r.receive_messages(10, max_wait_time=5)
            assert sorted(str(m) for m in got) == ["first", "second"]
            armed[0] = True
            r.complete_messages(got)  # lands with its reply lost: no MessageLockLostError
        assert proxy.dropped == 2
        assert direct.get_queue_runtime_properties("q").total_message_count == 0
    finally:
        proxy.stop()


def test_a_create_that_landed_but_timed_out_counts_as_landed(azurite: Any) -> None:
    """The log entry's create landed, its reply came after the client's timeout, and obstore did not retry it.

    The send raised StorageError though its message was stored, so a caller sending again stored it twice.
    """
    armed = [False]

    def slow_reply(method: str, path: str, headers: dict[str, str]) -> bool:
        if armed[0] and method == "PUT" and "/entities/" in path and "_delta_log/" in path and "if-none-match" in headers:
            armed[0] = False
            time.sleep(2.5)  # the store did the work; the reply comes after the client gave up
        return False

    proxy = LossyProxy(azurite.port, slow_reply)
    root = f"az://{azurite.create_container()}/ns"
    direct = Namespace(root, storage_options=azurite.storage_options())
    direct.create_queue("q")
    ns = Namespace(root, storage_options={**proxy.storage_options(azurite.storage_options()), "timeout": "1s"})
    try:
        with ns.get_queue_sender("q") as s:
            armed[0] = True
            s.send_messages(Message("once", message_id="once"))
        with direct.get_queue_receiver("q") as r:
            assert [m.message_id for m in peek_all(r)] == ["once"]
        assert direct.check() == []
    finally:
        proxy.stop()


def _outage_after_entity_commit(azurite: Any, hold_s: float, outage_s: float, folder: str) -> tuple[LossyProxy, list[bool]]:
    """A proxy that, once armed, holds the next entity log-entry create `hold_s`, lets it land, then refuses every
    request under `folder` for `outage_s` (the store unreachable right after a commit landed)."""
    armed, until = [False], [0.0]

    def refuse(method: str, path: str, headers: dict[str, str]) -> bool:
        if not armed[0]:
            return False
        if until[0]:
            return folder in path and time.monotonic() < until[0]
        if method == "PUT" and "/entities/" in path and "_delta_log/" in path and "if-none-match" in headers:
            time.sleep(hold_s)
            until[0] = time.monotonic() + outage_s
        return False

    return LossyProxy(azurite.port, lambda *_: False, refuse), armed


def test_a_receive_that_meets_a_store_fault_after_taking_messages_returns_them(azurite: Any) -> None:
    """RECEIVE_AND_DELETE over several partitions: the first partition's deletion landed, the next read failed.

    The receive raised and dropped what it had already deleted: lost. It returns those now.
    """
    proxy, armed = _outage_after_entity_commit(azurite, 0.0, 6.0, "/entities/")
    root = f"az://{azurite.create_container()}/ns"
    direct = Namespace(root, storage_options=azurite.storage_options())
    direct.create_queue("q")
    with direct.get_queue_sender("q") as s:
        for i in range(4):
            s.send_messages(Message(f"m{i}"))  # one send each: round-robin over 4 partitions
    ns = Namespace(root, storage_options=proxy.storage_options(azurite.storage_options()), operation_timeout=3)
    try:
        with ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
            ns.get_queue_runtime_properties("q")  # settings cached before the outage
            armed[0] = True
            got = [str(m) for m in r.receive_messages(10, max_wait_time=1)]
        print("GOT", got, "UNTIL", proxy.refuse)
        assert got
        with direct.get_queue_receiver("q") as left:
            rest = [str(m) for m in peek_all(left)]
        assert sorted(got + rest) == [f"m{i}" for i in range(4)]
    finally:
        proxy.stop()


def test_a_send_that_landed_is_not_reported_failed_when_the_catalog_is_unreachable_right_after(azurite: Any) -> None:
    """The send's entry landed after its cached settings went stale; forwarding's catalog read after it then failed.

    The send raised StorageError though it had stored the message, so a caller sending again stored it twice.
    """
    proxy, armed = _outage_after_entity_commit(azurite, 1.2, 4.0, "/_catalog/")
    root = f"az://{azurite.create_container()}/ns"
    direct = Namespace(root, storage_options=azurite.storage_options())
    direct.create_queue("q")
    ns = Namespace(root, storage_options=proxy.storage_options(azurite.storage_options()), operation_timeout=3)
    try:
        with ns.get_queue_sender("q") as s:
            ns.get_queue_runtime_properties("q")
            armed[0] = True
            s.send_messages(Message("once", message_id="once"))
        with direct.get_queue_receiver("q") as r:
            assert [m.message_id for m in peek_all(r)] == ["once"]
    finally:
        proxy.stop()


def test_a_catalog_commit_whose_reply_was_lost_counts_as_landed(azurite: Any) -> None:
    """Before, the create's catalog file was deleted under the entry that had made it live: every call of every process
    then failed with "namespace catalog …: live file … is missing"."""
    proxy, ns, direct, armed = _lossy(azurite, "catalog")
    try:
        armed[0] = True
        ns.create_queue("q2")
        assert proxy.dropped == 1
        assert [q.name for q in direct.list_queues()] == ["q", "q2"]
        assert direct.check() == []
    finally:
        proxy.stop()


def test_a_create_whose_catalog_commit_landed_unacknowledged_keeps_its_table(azurite: Any) -> None:
    """The catalog entry landed but every reply was lost for a while: the create failed and deleted the new table.

    The queue was then listed, could not be created again, and refused every send for good. Now the
    table stays (it is removed only when the catalog is read and does not name it).
    """
    until = [0.0]

    def lose_catalog_replies(method: str, path: str, headers: dict[str, str]) -> bool:
        if "/_catalog/" not in path:
            return False
        if not until[0] and method == "PUT" and "_delta_log/" in path and "if-none-match" in headers:
            until[0] = time.monotonic() + 8.0  # longer than the create's tries
        return bool(until[0]) and time.monotonic() < until[0]

    proxy = LossyProxy(azurite.port, lose_catalog_replies)
    root = f"az://{azurite.create_container()}/ns"
    direct = Namespace(root, storage_options=azurite.storage_options())
    ns = Namespace(root, storage_options=proxy.storage_options(azurite.storage_options()), operation_timeout=1)
    try:
        with contextlib.suppress(StorageError):  # the outcome was unknown to it: an error, or success once it could tell
            ns.create_queue("orders")
        time.sleep(max(0.0, until[0] - time.monotonic()))
        assert [q.name for q in direct.list_queues()] == ["orders"]
        direct.get_queue_sender("orders").send_messages(Message("works"))
        with direct.get_queue_receiver("orders") as r:
            assert [str(m) for m in r.receive_messages(1, max_wait_time=5)] == ["works"]
        assert direct.check() == []
    finally:
        proxy.stop()


def test_a_container_deleted_under_an_open_namespace_is_an_error_not_a_stale_view(azurite: Any) -> None:
    """Before, its 404s read as "no newer log entry": the open namespace kept showing the queue and its messages."""
    from azure.storage.blob import BlobServiceClient
    from azurite import ACCOUNT, KEY

    container = azurite.create_container()
    with Namespace(f"az://{container}/ns", storage_options=azurite.storage_options()) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message("a"), Message("b")])
        assert ns.get_queue_runtime_properties("q").active_message_count == 2
        conn = f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={azurite.endpoint};"
        BlobServiceClient.from_connection_string(conn).delete_container(container)
        with pytest.raises(StorageError, match="container or bucket does not exist"):
            ns.get_queue_runtime_properties("q")
        with pytest.raises(StorageError, match="container or bucket does not exist"), ns.get_queue_receiver("q") as r:
            r.peek_messages(5)


@pytest.mark.parametrize("key", ["azure_allow_http", "AZURE_ALLOW_HTTP"])
def test_a_client_option_with_its_store_prefix_works_as_delta_rs_takes_it(azurite: Any, key: str) -> None:
    """delta-rs takes "azure_allow_http" (and "aws_allow_http"); obstore panicked on it, past `except Exception`."""
    container = azurite.create_container()
    options = azurite.storage_options()
    options[key] = options.pop("allow_http")
    with Namespace(f"az://{container}/ns", storage_options=options) as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages(Message("x"))
        assert ns.get_queue_runtime_properties("q").active_message_count == 1


@pytest.mark.parametrize("uri", ["az://c/a%20b", "s3://bucket/ns%2Fq"])
def test_an_object_store_root_with_a_url_escape_is_refused(uri: str) -> None:
    """The store decodes it: before, 'az://c/a%20b' opened (and wrote) the namespace stored at 'a b'."""
    with pytest.raises(InvalidOperationError, match="URL escape"):
        Namespace(uri)


@pytest.mark.parametrize("tail", [" ", "/ ", " /", "\\b"])
def test_an_object_store_root_ending_in_a_space_or_holding_a_backslash_is_refused(azurite: Any, tail: str) -> None:
    """obstore drops a space at a URI's end and delta-rs reads a backslash as '/': 'az://c/ns ' wrote its tables under
    'ns ' and its marker into 'ns' (a neighbour namespace, which then reported itself damaged); 'az://c/ns\\b' had
    delta-rs write a catalog under 'ns/b'. Both are refused, and the namespace at 'ns' stays as it was."""
    container = azurite.create_container()
    with Namespace(f"az://{container}/ns", storage_options=azurite.storage_options()) as ns:
        ns.create_queue("q")
    with pytest.raises(InvalidOperationError, match="ends in a space or holds a backslash"):
        Namespace(f"az://{container}/ns{tail}", storage_options=azurite.storage_options())
    with Namespace(f"az://{container}/ns", storage_options=azurite.storage_options(), create=False) as ns:
        assert [q.name for q in ns.list_queues()] == ["q"]
        assert ns.check() == []


@pytest.mark.parametrize("uri", ["abfss://c@/x", "abfss://@acct.dfs.core.windows.net/x"])
def test_an_abfs_uri_without_container_or_account_is_refused(uri: str) -> None:
    with pytest.raises(InvalidOperationError, match="names no container"):
        Namespace(uri)


@pytest.mark.parametrize("key", ["container_name", "azure_container_name"])
def test_an_option_naming_another_container_than_the_root_is_refused(azurite: Any, key: str) -> None:
    """obstore let such an option win over the URI and delta-rs did not: one namespace split over two containers."""
    here, other = azurite.create_container(), azurite.create_container()
    Namespace(f"az://{other}/ns", storage_options=azurite.storage_options()).create_queue("in_other")
    with pytest.raises(InvalidOperationError, match=f"names container {other!r}"):
        Namespace(f"az://{here}/ns", storage_options={**azurite.storage_options(), key: other})
    assert open_store(f"az://{here}", azurite.storage_options()).list() == []  # nothing written
    same = Namespace(f"az://{here}/ns", storage_options={**azurite.storage_options(), key: here})  # agreeing: fine
    assert same.list_queues() == []


def test_an_abfss_root_names_its_account_and_container(tmp_path: Path) -> None:
    """An account option other than the one an abfss:// URI names is refused before any request."""
    uri = "abfss://data@acct.dfs.core.windows.net/ns"
    with pytest.raises(InvalidOperationError, match="names account 'other'"):
        Namespace(uri, storage_options={"account_name": "other", "account_key": "a2V5"})
    with pytest.raises(InvalidOperationError, match="names container 'logs'"):
        Namespace(uri, storage_options={"azure_storage_account_name": "acct", "container_name": "logs"})


@pytest.mark.parametrize("configured_by", ["options", "environment"])
def test_a_hung_store_fails_within_about_the_operation_timeout(
    azurite: Any, monkeypatch: pytest.MonkeyPatch, configured_by: str
) -> None:
    """A frozen store (connections accepted, no replies) held a send with operation_timeout=3 for minutes.

    obstore's own settings wait 30 s per request and retry for 3 minutes. A namespace configured by
    environment variables alone still waited the 30 s of one request: its request timeout was not set.
    """
    import signal
    import time

    container = azurite.create_container()
    options = azurite.storage_options()
    if configured_by == "environment":
        from azurite import ACCOUNT, KEY

        env = {"ACCOUNT_NAME": ACCOUNT, "ACCOUNT_KEY": KEY, "ENDPOINT": azurite.endpoint}
        for name, value in env.items():
            monkeypatch.setenv(f"AZURE_STORAGE_{name}", value)
        monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
        options = {}
    with Namespace(f"az://{container}/ns", storage_options=options, operation_timeout=3) as ns:
        ns.create_queue("q")
        os.kill(azurite.proc.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            with pytest.raises(StorageError):
                ns.get_queue_sender("q").send_messages(Message("x"))
            took = time.monotonic() - began
        finally:
            os.kill(azurite.proc.pid, signal.SIGCONT)
    assert took < 20  # a bound far below the 30 s or minutes it took, not a performance figure


def test_an_unreachable_store_is_a_clear_error() -> None:
    from azurite import ACCOUNT, KEY, free_port

    options = {
        "account_name": ACCOUNT,
        "account_key": KEY,
        "azure_storage_endpoint": f"http://127.0.0.1:{free_port()}/{ACCOUNT}",
        "allow_http": "true",
    }
    with pytest.raises(StorageError, match="az://c1x/ns"):
        Namespace("az://c1x/ns", storage_options=options)


def test_nothing_is_written_outside_the_namespace_root(tmp_path: Path) -> None:
    root = tmp_path / "inside" / "ns"
    with Namespace(root) as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages([Message("x") for _ in range(5)])
        with ns.get_queue_receiver("q") as r:
            r.complete_messages(r.receive_messages(5))
        ns.run_maintenance()
    outside = [p for p in tmp_path.rglob("*") if not str(p).startswith(str(root)) and p != root.parent]
    assert outside == []


def test_a_namespace_configured_by_the_environment_alone_pickles_and_reopens(store: Store) -> None:
    """Its own request settings (fitted to the operation timeout) are not what it pickles: they replaced the environment's."""
    import pickle

    with Namespace(store.root) as ns:  # no storage options: the store's environment variables (set by the fixture)
        ns.create_queue("q")
        assert ns.storage_options == {}
        again = pickle.loads(pickle.dumps(ns))
        assert [q.name for q in again.list_queues()] == ["q"]
        with again.get_queue_sender("q") as s:
            s.send_messages(Message("x"))
        assert ns.get_queue_runtime_properties("q").active_message_count == 1


def test_options_given_in_part_take_the_rest_from_the_environment(azurite: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Account and key as options, endpoint and plain HTTP from the environment, as delta-rs takes them.

    The request timeout sparkqueue adds replaced every client option obstore read from the
    environment (AZURE_ALLOW_HTTP): the namespace failed with "builder error".
    """
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azurite.endpoint)
    monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
    given = {k: v for k, v in azurite.storage_options().items() if k in ("account_name", "account_key")}
    with Namespace(f"az://{azurite.create_container()}/ns", storage_options=given) as ns:
        ns.create_queue("q")
        ns.get_queue_sender("q").send_messages(Message("x"))
        assert ns.get_queue_runtime_properties("q").active_message_count == 1
        assert ns.storage_options == given  # what it pickles: as given


def test_a_path_naming_a_missing_bucket_code_is_still_just_a_missing_object(tmp_path: Path) -> None:
    """The missing-container check reads the service's error code, not the message, which holds the path too."""
    from sparkqueue.storage.store import ObjectStore

    (tmp_path / "NoSuchBucket-ContainerNotFound" / "ns").mkdir(parents=True)
    store = ObjectStore(f"file://{tmp_path}/NoSuchBucket-ContainerNotFound/ns", {})
    assert store.exists("_delta_log/00000000000000000001.json") is False


PLAIN_HTTP = {"account_name": "devstoreaccount1", "account_key": "a2V5", "endpoint": "http://127.0.0.1:9/devstoreaccount1"}


@pytest.mark.parametrize("root", ["az://c/ns", "s3://b/ns"])
def test_a_plain_http_endpoint_without_allow_http_is_refused_by_name(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """obstore refused it with a bare "builder error" at the first request; now the namespace says what to set."""
    for name in ("AZURE_ALLOW_HTTP", "AWS_ALLOW_HTTP", "AZURE_STORAGE_USE_EMULATOR"):
        monkeypatch.delenv(name, raising=False)
    options = dict(PLAIN_HTTP) if root.startswith("az") else {"aws_endpoint": "http://127.0.0.1:9", "region": "us-east-1"}
    with pytest.raises(InvalidOperationError, match=r"plain HTTP.*allow_http='true'"):
        Namespace(root, storage_options=options)


@pytest.mark.parametrize(
    ("extra", "environment"),
    [
        ({"allow_http": "true"}, {}),
        ({"allow_http": True}, {}),
        ({"azure_allow_http": "1"}, {}),
        ({"use_emulator": "true"}, {}),
        ({}, {"AZURE_ALLOW_HTTP": "true"}),
        ({}, {"AZURE_STORAGE_USE_EMULATOR": "yes"}),
        ({"endpoint": "https://127.0.0.1:9/devstoreaccount1"}, {}),
    ],
)
def test_plain_http_is_accepted_when_allowed_by_option_or_environment(
    extra: dict[str, Any], environment: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """allow_http (any provider prefix, a bool too), use_emulator, their environment variables, or https: no refusal."""
    from sparkqueue.storage.store import check_storage_options

    for name in ("AZURE_ALLOW_HTTP", "AZURE_STORAGE_USE_EMULATOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    options = {**PLAIN_HTTP, **extra}
    assert check_storage_options(options, "az://c/ns")["endpoint"] == options["endpoint"]
