"""Auto-forwarding (docs/semantics.md §9): move messages from a queue or subscription to another queue or topic, exactly once.

A move spans two Delta tables, so it is made idempotent rather than atomic. In each source
partition messages are forwarded in sequence order, a leading run at a time: (1) the copies are
appended to the destination with a Delta txn recording the highest source sequence number
forwarded, (2) the originals are deleted at the source. A process that dies between (1) and (2)
leaves originals whose sequence numbers the destination already records; the next forwarder
only deletes them. Messages that must not travel (hop limit, a session id contradicting the
partition key, a missing, full or disabled destination) are dead-lettered, and expired ones
expire, at the source in step (2) instead.

Dead letters enter their sub-queue in any sequence order, so for them a sequence-number fence
cannot tell what was forwarded: each batch is first claimed at the source (see
`_forward_dead_letters`) and appended under a txn app id naming the claim.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import EntityNotFoundError, MessagingEntityDisabledError, QuotaExceededError, SparkQueueError
from sparkqueue.model import lifecycle, limits
from sparkqueue.model.entity import ROW_COLUMNS, Entity, utcnow
from sparkqueue.model.partitioning import partition_key
from sparkqueue.model.properties import check_status
from sparkqueue.model.topics import sessionless_dead_lettered
from sparkqueue.storage.log import MARK_PREFIX, Fence, Snapshot
from sparkqueue.storage.retry import retry_commit
from sparkqueue.storage.schema import (
    ENTITY_SCHEMA,
    PARTITION_COLUMN,
    STATE_ACTIVE,
    SUB_QUEUE_DEAD_LETTER,
    SUB_QUEUE_MAIN,
    TIMESTAMP,
    constant,
    member_of,
    with_columns,
)
from sparkqueue.storage.table import OP_SET, Expand, empty_changes

log = logging.getLogger(__name__)

MAX_HOPS = 4
HOP_LIMIT_REASON = "MaxTransferHopCountExceeded"
MISSING_REASON = "ForwardingDestinationNotFound"
FULL_REASON = "ForwardingDestinationQuotaExceeded"
DISABLED_REASON = "ForwardingDestinationDisabled"
KEYS_REASON = "ForwardingPartitionKeyConflict"  # a rule action gave a copy a session id its partition key contradicts
BATCH = 1000
DELIVERED, CANCELLED = 1, 2  # txn versions of a dead-letter claim's app id at its destination (an append skips both)
CLAIM_PREFIX = "forward:"  # lock token of dead letters claimed by a forwarder (never a receiver's token): Claim

# Resolves a destination name to (entity, fan-out for topics), or raises EntityNotFoundError.
Resolver = Callable[[str], tuple[Entity, Expand | None]]


@dataclass(frozen=True)
class Route:
    """One forwarding route: which sub-queue of the source moves to which destination."""

    sub_queue: str
    destination: str


def routes(entity: Entity) -> list[Route]:
    """The entity's forwarding routes: arriving messages, and dead letters."""
    out = []
    fwd = getattr(entity.props, "forward_to", None)
    if fwd:
        out.append(Route(SUB_QUEUE_MAIN, fwd))
    dlq = getattr(entity.props, "forward_dead_lettered_messages_to", None)
    if dlq:
        out.append(Route(SUB_QUEUE_DEAD_LETTER, dlq))
    return out


def forward(
    entity: Entity,
    resolve: Resolver,
    partitions: list[int] | None = None,
    until: float | None = None,
    *,
    first_free: bool = False,
) -> list[str]:
    """Move everything waiting on the entity's routes; returns the destinations that may have received messages.

    `until` (a time.monotonic() value): start no batch after it (with `first_free`, but the first); what is left
    waits for the next forward.
    """
    reached: list[str] = []
    dt = entity.table.snapshot()
    first = first_free
    for route in routes(entity):
        for p in partitions if partitions is not None else range(entity.partition_count):
            if not entity.available(p) or not entity.table.may_hold_messages(dt, p, route.sub_queue, entity.subscription):
                continue  # (file statistics: a partition with nothing of the route's costs no read)
            while True:
                if not first and until is not None and time.monotonic() >= until:
                    return reached
                first = False
                moved = _forward_batch(entity, route, p, resolve)
                if moved and route.destination not in reached:
                    reached.append(route.destination)
                if moved < BATCH:
                    break
    return reached


def _app_id(entity: Entity, route: Route, p: int) -> str:
    """The destination txn app id recording how far this source partition has forwarded on this route."""
    source = f"{entity.table.uri.rsplit('/', 1)[-1]}.{entity.subscription or ''}.{route.sub_queue}.{p}"
    return f"{MARK_PREFIX}{source}"


def _forward_batch(entity: Entity, route: Route, p: int, resolve: Resolver) -> int:
    """Forward (or dead-letter) one leading run of a source partition; returns how many messages left the source.

    Every message of the run leaves: those past the hop limit or whose keys no partition can take
    are dead-lettered, those the destination already holds (an earlier forwarder died before
    removing them) are removed, expired ones expire as at a receive, and the rest travel, or are
    dead-lettered when the destination is missing, full or disabled. Only a destination that is
    unavailable for now (a partition down, a timeout) leaves the run for a later attempt.
    """
    if route.sub_queue == SUB_QUEUE_DEAD_LETTER:
        return _forward_dead_letters(entity, route, p, resolve)
    left = 0
    while True:
        moved, expired_only = _forward_run(entity, route, p, resolve)
        left += moved
        if not expired_only:
            return left


def _forward_run(entity: Entity, route: Route, p: int, resolve: Resolver) -> tuple[int, bool]:
    """One commit of `_forward_batch`: (messages that left the source, whether they were only expired ones to drop first)."""
    dt = entity.table.snapshot()
    now = utcnow()
    if entity.route_rest_left_s(dt) > 0:  # the update that changed the route forwards once the rest is over
        return 0, False
    run = _leading_run(entity, dt, p, route.sub_queue, now)
    if run.num_rows == 0:
        return 0, False
    app = _app_id(entity, route, p)
    dest: Entity | None = None
    try:
        dest, expand = resolve(route.destination)
        done = dest.table.snapshot().transaction_version(app)
    except EntityNotFoundError:
        done = None
    except SparkQueueError as exc:  # destination unavailable for now: leave everything for a later attempt
        log.warning("forwarding %s -> %s deferred: %s", entity.name, route.destination, exc)
        return 0, False
    over, conflict, movable = _stuck(run)
    held = pc.less_equal(run.column("sequence_number"), -1 if done is None else done)  # delivered by an earlier attempt
    expired = pc.and_(pc.and_(movable, pc.invert(held)), lifecycle.expired_rows(run, now))
    if pc.any(expired).as_py():
        # Expired first, in a commit of their own: the fence of the copies below must cover no message that stays
        # behind, or a forwarder finishing this run after a crash would take it as delivered and remove it.
        changes = lifecycle.expire(run.filter(expired), now, entity.policy)
        retry_commit(lambda: _settle_source(entity, p, changes, run), entity.deadline(), f"expire on {entity.name}")
        return int(changes.num_rows), True
    travels = pc.and_(movable, pc.invert(held))
    failure = MISSING_REASON if dest is None else None
    appended = pa.array([], pa.string())  # message ids of the copies this forwarder's own append stored
    try:
        if dest is not None:
            check_status(dest.props, "send", dest.name)
            travel = run.filter(travels)
            if travel.num_rows:
                now_dt = entity.table.snapshot()
                if entity.route_rest_left_s(now_dt) > 0:  # the route changed since the read: no copy by the old one
                    return 0, False
                if len(_as_read(entity, now_dt, p, travel)) < travel.num_rows:
                    return 0, True  # another forwarder expired, or settled, some of them since the read: read again
                top = pc.max(run.column("sequence_number")).as_py()
                appended = _deliver(dest, expand, _copies(travel, now, dest), Fence(app, top)).column("message_id")
    except QuotaExceededError:
        failure = FULL_REASON
    except MessagingEntityDisabledError:
        failure = DISABLED_REASON
    except SparkQueueError as exc:
        log.warning("forwarding %s -> %s deferred: %s", entity.name, route.destination, exc)
        return 0, False
    dead = [(over, HOP_LIMIT_REASON), (conflict, KEYS_REASON)] + ([(travels, failure)] if failure else [])
    gone = pc.and_(movable, held) if failure else pc.or_(pc.and_(movable, held), travels)
    changes = _source_changes(entity, run, dead, gone, now)
    whole = retry_commit(lambda: _settle_source(entity, p, changes, run), entity.deadline(), f"forward from {entity.name}")
    if not whole and len(appended):  # a concurrent forwarder changed some of those this one appended
        mine = run.filter(travels)
        _drop_dead_twins(entity, p, mine.filter(pc.is_in(mine.column("message_id"), value_set=appended)))
    log.debug("%d message(s) left %s for %s (partition %d)", changes.num_rows, entity.name, route.destination, p)
    return int(changes.num_rows), False


def _stuck(run: pa.Table) -> tuple[pa.Array, pa.Array, pa.Array]:
    """Masks of a run: past the hop limit, keys in conflict, movable (by the rows alone, so every attempt decides alike)."""
    over = pc.greater(pc.add(run.column("transfer_hop_count"), 1), MAX_HOPS)
    conflict = pc.and_(pc.invert(over), _key_conflicts(run))
    return over, conflict, pc.invert(pc.or_(over, conflict))


def settle_delivered(entity: Entity, destination: str, resolve: Resolver) -> int:
    """Settle the originals a forwarder delivered to `destination`, the entity's old forward_to, and died before settling.

    Only the destination records that they went (its fence for this source), so once the route
    changed or was removed no forwarder would look there: the originals would travel again, or stay
    receivable. Each partition's leading run up to that fence is settled as the dead forwarder
    would have: the copies' originals removed, those past the hop limit or with conflicting keys
    dead-lettered. Returns how many left; a destination gone or unavailable settles nothing.
    """
    try:
        dest, _ = resolve(destination)
        fences = dest.table.snapshot()
    except SparkQueueError as exc:
        log.info("%s: cannot tell what reached %s, its old destination: %s", entity.name, destination, exc)
        return 0
    route, left = Route(SUB_QUEUE_MAIN, destination), 0
    for p in range(entity.partition_count):
        done = fences.transaction_version(_app_id(entity, route, p))
        while done is not None and entity.available(p):
            now = utcnow()
            run = _leading_run(entity, entity.table.snapshot(), p, SUB_QUEUE_MAIN, now)
            held = pc.less_equal(run.column("sequence_number"), done)
            if not pc.any(held).as_py():
                break
            over, conflict, movable = _stuck(run)
            dead = [(pc.and_(held, over), HOP_LIMIT_REASON), (pc.and_(held, conflict), KEYS_REASON)]
            changes = _source_changes(entity, run, dead, pc.and_(held, movable), now)
            retry_commit(functools.partial(_settle_source, entity, p, changes, run), entity.deadline(), f"settle {entity.name}")
            left += int(changes.num_rows)
    if left:
        log.info("%d message(s) %s had forwarded to %s before its route changed left it", left, entity.name, destination)
    return left


def _drop_dead_twins(entity: Entity, p: int, delivered: pa.Table) -> None:
    """Remove dead letters another forwarder made of messages this one has just appended itself.

    Between this forwarder's read and its append, a concurrent one may have dead-lettered some of the
    same messages (they expired meanwhile, or it found the destination full or missing). Their copies
    went out all the same, so the dead letters go, unless a receiver or a dead-letter forwarder holds one.
    Only copies this forwarder's append stored count: one its fence skipped (another forwarder's run
    covered them, which may have expired a message rather than delivered it) proves nothing.
    """
    dt = entity.table.snapshot()
    now_rows = entity.table.rows_by_sequence(dt, p, delivered.column("sequence_number"), ROW_COLUMNS, entity.subscription)
    dead = pc.and_(pc.equal(now_rows.column("sub_queue"), SUB_QUEUE_DEAD_LETTER), pc.is_null(now_rows.column("lock_token")))
    twins = now_rows.filter(dead)
    if twins.num_rows == 0:
        return
    changes = lifecycle.changes(twins, lifecycle.removal(entity.policy))
    retry_commit(lambda: _settle_source(entity, p, changes, twins), entity.deadline(), f"forward from {entity.name}")
    log.warning(
        "%d message(s) of %s dead-lettered by a concurrent forwarder while delivered here: the dead letters were removed",
        twins.num_rows,
        entity.name,
    )


def _key_conflicts(rows: pa.Table) -> pa.Array:
    """Per row: a session id and a different partition key, which no send accepts (model.partitioning.partition_key)."""
    sessions, keys = rows.column("session_id"), rows.column("partition_key")
    both = pc.and_(pc.is_valid(sessions), pc.is_valid(keys))
    return pc.and_(both, pc.fill_null(pc.not_equal(sessions, keys), False))


def _forward_dead_letters(entity: Entity, route: Route, p: int, resolve: Resolver) -> int:
    """Forward a batch of a partition's dead letters (after finishing any abandoned claim); returns how many left.

    (1) A source commit claims the batch: its rows get a claim token as lock token and no
    availability, so receivers skip them. (2) The copies are appended to the destination under
    the txn app id of that claim, once. (3) The rows are removed at the source. A forwarder that
    finds claimed rows for this destination (their forwarder died, or is still at work) finishes
    that claim: the app id tells whether (2) already happened. A claim that lapsed (a lock
    duration old) and that its destination cannot finish is cancelled (`_cancel_lapsed_claims`).
    Dead letters that cannot travel stay where they are.
    """
    _cancel_lapsed_claims(entity, p, resolve, route.destination)
    try:
        dest, expand = resolve(route.destination)
        check_status(dest.props, "send", dest.name)
    except (EntityNotFoundError, MessagingEntityDisabledError):  # they stay receivable dead letters here
        return 0
    except SparkQueueError as exc:
        log.warning("forwarding dead letters %s -> %s deferred: %s", entity.name, route.destination, exc)
        return 0
    total = 0
    while True:
        batch, claim, abandoned = retry_commit(
            lambda: _claim(entity, p, route.destination), entity.deadline(), f"claim in {entity.name}"
        )
        if claim is None:
            return total
        now = utcnow()
        claimed = with_columns(batch, lock_token=constant(claim.token, pa.string(), batch.num_rows))  # as the claim left them
        app = claim.app_id(entity, p)
        try:
            _deliver(dest, expand, _copies(batch, now, dest, dead_letters=True), Fence(app, DELIVERED), dead_letters=True)
            outcome = dest.table.snapshot().transaction_version(app)
        except (EntityNotFoundError, QuotaExceededError):  # they stay dead letters here
            _cancel(entity, p, claimed, app, route.destination, resolve)
            return total
        except SparkQueueError as exc:  # destination unavailable: the claim stays for a later forwarder
            log.warning("forwarding dead letters %s -> %s deferred: %s", entity.name, route.destination, exc)
            return total
        if outcome != DELIVERED:  # another process cancelled the claim first: its rows are released, not removed
            _cancel(entity, p, claimed, app, route.destination, resolve)
            return total
        changes = lifecycle.changes(batch, lifecycle.removal(entity.policy))
        retry_commit(
            functools.partial(_settle_source, entity, p, changes, claimed), entity.deadline(), f"forward from {entity.name}"
        )
        total += int(batch.num_rows)
        if not abandoned:
            return total


@dataclass(frozen=True)
class Claim:
    """A forwarder's claim on dead letters, held in their lock token: forward:<claimed at, ms>:<id>:<destination>.

    The token names the destination, so whoever resolves the claim later looks there, whatever the route is by then.
    """

    token: str
    claimed_ms: int
    key: str
    destination: str | None  # None: a token of an older version (forward:<id>), for the route's destination

    @classmethod
    def new(cls, now: datetime, destination: str) -> Claim:
        ms, key = int(now.timestamp() * 1000), uuid.uuid4().hex
        return cls(f"{CLAIM_PREFIX}{ms}:{key}:{destination}", ms, key, destination)

    @classmethod
    def parse(cls, token: str) -> Claim:
        parts = token.removeprefix(CLAIM_PREFIX).split(":", 2)
        if len(parts) < 3 or not parts[0].isdigit():
            return cls(token, 0, token.removeprefix(CLAIM_PREFIX), None)
        return cls(token, int(parts[0]), parts[1], parts[2])

    def lapsed(self, entity: Entity, now: datetime) -> bool:
        """True once the claim is a lock duration old: its forwarder is taken for dead."""
        return self.claimed_ms / 1000 + entity.policy.lock_duration.total_seconds() <= now.timestamp()

    def app_id(self, entity: Entity, p: int) -> str:
        """The destination txn app id recording that this claim's copies were appended (or never will be)."""
        return f"{_app_id(entity, Route(SUB_QUEUE_DEAD_LETTER, ''), p)}.{self.key}"


def _claimed_rows(entity: Entity, dt: Snapshot, p: int) -> tuple[pa.Table, pa.Array]:
    """The partition's dead letters, and per row whether a forwarder's claim holds it."""
    rows = entity.table.scan(dt, p, ROW_COLUMNS, subscription=entity.subscription, sub_queue=SUB_QUEUE_DEAD_LETTER)
    return rows, pc.fill_null(pc.starts_with(rows.column("lock_token"), CLAIM_PREFIX), False)


def _claims(rows: pa.Table, claimed: pa.Array) -> Iterator[tuple[Claim, pa.Table]]:
    """Each claim among the dead letters (`_claimed_rows`) with the rows it holds."""
    for token in pc.unique(rows.filter(claimed).column("lock_token")).to_pylist():
        yield Claim.parse(token), rows.filter(pc.fill_null(pc.equal(rows.column("lock_token"), token), False))


def _claim(entity: Entity, p: int, destination: str) -> tuple[pa.Table, Claim | None, bool]:
    """Claim dead letters of a partition for forwarding: (rows, their claim or None, whether it is an earlier claim).

    An earlier claim for this destination is taken over (its forwarder died, or finishes it too:
    the txn app id appends the copies once). Dead letters that cannot travel (past the hop limit,
    keys no partition takes), deferred ones (a receiver of the sub-queue deferred them to take them
    by sequence number) and those another claim holds are never claimed.
    """
    dt = entity.table.snapshot()
    now = utcnow()
    rows, claimed = _claimed_rows(entity, dt, p)
    for claim, held in _claims(rows, claimed):
        if claim.destination in (None, destination):
            return held, claim, True
    free = pc.invert(pc.fill_null(pc.greater(rows.column("locked_until_utc"), pa.scalar(now, TIMESTAMP)), False))
    can_travel = pc.and_(pc.less_equal(pc.add(rows.column("transfer_hop_count"), 1), MAX_HOPS), pc.invert(_key_conflicts(rows)))
    can_travel = pc.and_(can_travel, pc.equal(rows.column("state"), STATE_ACTIVE))  # a deferred one waits for its receiver
    batch = rows.filter(pc.and_(pc.and_(free, pc.invert(claimed)), can_travel)).slice(0, BATCH)
    if batch.num_rows == 0:
        return batch, None, False
    claim = Claim.new(now, destination)
    hidden = lifecycle.changes(batch, OP_SET, lock_token=claim.token, locked_until_utc=None, available_at_utc=None)
    entity.table.apply(dt, p, hidden)
    return batch, claim, False


def cancel_lapsed_claims(entity: Entity, resolve: Resolver) -> None:
    """Cancel every lapsed dead-letter claim of the entity (for an entity that no longer forwards its dead letters)."""
    for p in range(entity.partition_count):
        if entity.available(p):
            _cancel_lapsed_claims(entity, p, resolve, None)


def _cancel_lapsed_claims(entity: Entity, p: int, resolve: Resolver, current: str | None) -> None:
    """Cancel the partition's lapsed claims that no forwarder will finish: for another destination than `current`
    (the route changed or is gone), or for one that is missing, disabled or full."""
    now = utcnow()
    for claim, held in _claims(*_claimed_rows(entity, entity.table.snapshot(), p)):
        if not claim.lapsed(entity, now):
            continue
        target = claim.destination or current  # an older claim was for the route's destination
        if target is not None and target == current:
            try:
                dest, _ = resolve(target)
                check_status(dest.props, "send", dest.name)
                continue  # the forwarding loop finishes it
            except (EntityNotFoundError, MessagingEntityDisabledError):
                pass
        _cancel(entity, p, held, claim.app_id(entity, p), target, resolve)


def _cancel(entity: Entity, p: int, held: pa.Table, app: str, destination: str | None, resolve: Resolver) -> None:
    """End a claim (txn app id `app`) without forwarding: its rows become receivable again, unless its copies went out.

    A forwarder of the claim may still be at work (paused, or it raced this one): the claim's app id is
    first recorded at its destination as CANCELLED, so its append is skipped from then on. If the app id
    is there as DELIVERED already, the copies went out, and the rows are removed instead. A destination
    that is gone (or unknown: an older claim whose route was removed) takes no copies.
    """
    delivered = False
    try:
        if destination is not None:
            dest = resolve(destination)[0]
            outcome = retry_commit(lambda: _record_cancel(dest, app), dest.deadline(), f"cancel a forward to {dest.name}")
            delivered = outcome == DELIVERED
    except EntityNotFoundError:  # gone: nothing can be appended there any more
        pass
    now = utcnow()
    if delivered:
        changes = lifecycle.changes(held, lifecycle.removal(entity.policy))
    else:
        changes = lifecycle.changes(held, OP_SET, lock_token=None, locked_until_utc=None, available_at_utc=now)
    retry_commit(functools.partial(_settle_source, entity, p, changes, held), entity.deadline(), f"cancel claim in {entity.name}")
    log.info("dead-letter claim on %d message(s) of %s %s", held.num_rows, entity.name, "finished" if delivered else "released")


def _record_cancel(dest: Entity, app: str) -> int:
    """Record txn `app` as CANCELLED at the destination unless it holds an outcome already; the outcome it holds now."""
    dt = dest.table.snapshot()
    done = dt.transaction_version(app)
    if done is not None:
        return done
    dest.table.commit(dt, [], [], [Fence(app, CANCELLED)], {app: None}, "WRITE")
    return CANCELLED


def _leading_run(entity: Entity, dt: Snapshot, p: int, sub_queue: str, now: datetime) -> pa.Table:
    """The sub-queue's messages in sequence order up to the first one that is locked, at most BATCH.

    Forwarding strictly in order keeps "highest sequence number forwarded" a complete record of
    what the destination already holds. Scheduled messages travel at once and keep their time.
    """
    rows = entity.table.scan(dt, p, ROW_COLUMNS, subscription=entity.subscription, limit=None)
    rows = rows.filter(pc.equal(rows.column("sub_queue"), sub_queue))
    locked = pc.fill_null(pc.greater(rows.column("locked_until_utc"), pa.scalar(now, TIMESTAMP)), False)
    first_locked = pc.index(locked, True).as_py()
    end = rows.num_rows if first_locked < 0 else first_locked
    return rows.slice(0, min(end, BATCH))


def _copies(rows: pa.Table, now: datetime, dest: Entity, *, dead_letters: bool = False) -> pa.Table:
    """Destination rows: the same message one hop further, unlocked and not yet delivered.

    Its TTL counts from its enqueue at the destination (as at a send, not from the first entity's),
    capped by the destination's default_message_time_to_live as a send there is. A dead letter
    travels without its own TTL: dead letters never expire (docs/semantics.md §9), and one that
    expired once would expire again at its destination, which usually gathers dead letters.
    """
    n = rows.num_rows
    ttl = pa.nulls(n, pa.int64()) if dead_letters else rows.column("time_to_live_ms").cast(pa.int64())
    cap = limits.ttl_ms(getattr(dest.props, "default_message_time_to_live", None))
    if cap is not None:
        ttl = pc.min_element_wise(ttl, pa.scalar(cap, pa.int64()), skip_nulls=True)
    out = rows.append_column(ENTITY_SCHEMA.field(PARTITION_COLUMN), constant(0, pa.int32(), n)).select(ENTITY_SCHEMA.names)
    visible = limits.visible_at(out.column("scheduled_enqueue_time_utc"), now)  # enqueued then, as a send there stores it
    values = {
        "transfer_hop_count": pc.add(rows.column("transfer_hop_count"), 1).cast(pa.int32()),
        "available_at_utc": visible,
        "sub_queue": constant(SUB_QUEUE_MAIN, pa.string(), n),
        "subscription": pa.nulls(n, pa.string()),
        "state": constant(STATE_ACTIVE, pa.string(), n),
        "enqueued_time_utc": visible,
        "time_to_live_ms": ttl.cast(rows.schema.field("time_to_live_ms").type),
        "expires_at_utc": limits.expiries(visible, ttl),
        "locked_until_utc": pa.nulls(n, TIMESTAMP),
        "lock_token": pa.nulls(n, pa.string()),
        "delivery_count": constant(0, pa.int32(), n),
    }
    return with_columns(out, **values).cast(ENTITY_SCHEMA)


def _deliver(dest: Entity, expand: Expand | None, rows: pa.Table, once: Fence, *, dead_letters: bool = False) -> pa.Table:
    """Send the copies to the destination, keeping each message's partition key; returns the rows it stored.

    A queue that requires sessions takes a copy without a session id into its dead letters
    (SessionIdRequired), as a session-requiring subscription does at fan-out. A duplicate-detecting
    destination drops forwarded messages whose id it accepted within its window, but never dead
    letters: they were accepted once already (often by this very entity), and their claim's txn
    app id already makes the append happen once.
    """
    if getattr(dest.props, "requires_session", False) and expand is None:
        rows = sessionless_dead_lettered(rows, "queue")
    dedupe = bool(getattr(dest.props, "requires_duplicate_detection", False))
    keys = [
        partition_key(s, k, m, dedupe)
        for s, k, m in zip(
            rows.column("session_id").to_pylist(),
            rows.column("partition_key").to_pylist(),
            rows.column("message_id").to_pylist(),
            strict=True,
        )
    ]
    return dest.send(rows, keys, expand, once, detect_duplicates=not dead_letters)


def _source_changes(entity: Entity, run: pa.Table, dead: list[tuple[pa.Array, str]], gone: pa.Array, now: datetime) -> pa.Table:
    """The run's changes at the source: dead letters (each mask with its reason), and removal of what travelled."""
    policy = entity.policy
    parts = []
    for mask, reason in dead:
        stuck = run.filter(mask)
        if stuck.num_rows:
            desc = f"The message could not be forwarded: {reason}."
            parts.append(lifecycle.settle(stuck, lifecycle.DEAD_LETTER, now, policy, reason, desc))
    if pc.any(gone).as_py():
        parts.append(lifecycle.changes(run.filter(gone), lifecycle.removal(policy)))
    return pa.concat_tables(parts) if parts else empty_changes()


def _settle_source(entity: Entity, p: int, changes: pa.Table, read: pa.Table) -> bool:
    """Apply the source changes to the rows still as this forwarder `read` them; False when some were not.

    A concurrent forwarder may have settled them, or expired one into the dead-letter queue, where
    a receiver may hold it now: a change computed from the old read would remove that dead letter or
    wipe its lock.
    """
    if changes.num_rows == 0:
        return True
    dt = entity.table.snapshot()
    seqs = changes.column("sequence_number")
    mine = read.filter(member_of(read.column("sequence_number"), seqs))
    still = changes.filter(member_of(seqs, _as_read(entity, dt, p, mine)))
    if still.num_rows:
        entity.table.apply(dt, p, still)
    return bool(still.num_rows == changes.num_rows)


_STATE = ["sequence_number", "sub_queue", "state", "lock_token"]  # what a concurrent change to a row alters


def _as_read(entity: Entity, dt: Snapshot, p: int, read: pa.Table) -> pa.ChunkedArray:
    """Sequence numbers of the `read` rows that snapshot `dt` still holds as they were read (sub-queue, state, lock)."""
    live = entity.table.rows_by_sequence(dt, p, read.column("sequence_number").to_pylist(), _STATE, entity.subscription)

    def keys(t: pa.Table) -> pa.Table:  # a join never matches nulls: an unlocked row's token is compared as ""
        return t.select(_STATE).set_column(3, "lock_token", pc.fill_null(t.column("lock_token"), ""))

    return keys(live).join(keys(read), keys=_STATE, join_type="inner").column("sequence_number")
