"""AutoLockRenewer (SDK: azure.servicebus.AutoLockRenewer): keep message and session locks alive in the background.

Register a received message or a session receiver's session; the renewer renews each lock when it
is within `renew_period` seconds of expiring, until the message is settled, the receiver closes,
`max_lock_renewal_duration` elapses or the renewer is closed. When renewal stops for any other
reason (the lock was lost, a renewal failed) `on_lock_renew_failure(renewable, error)` is called,
as in the SDK; the error is also kept on the renewable's `auto_renew_error`.

One worker thread per renewer serves every registration. The messages of one receiver that are
due together are renewed in one call (one commit per partition): a receive's batch shares a data
file, and renewing its messages one commit each made the commits conflict with one another, so
that a batch of 100 took longer to renew than its locks had left.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sparkqueue.errors import (
    AutoLockRenewFailed,
    AutoLockRenewTimeout,
    InvalidArgumentTypeError,
    InvalidOperationError,
    MessageAlreadySettled,
    MessageLockLostError,
)
from sparkqueue.message import is_settled, is_settling, lock_expired
from sparkqueue.model import limits

if TYPE_CHECKING:
    from sparkqueue.receiver import Receiver

log = logging.getLogger(__name__)

LockRenewFailureCallback = Callable[[Any, BaseException | None], None]
RENEW_PERIOD_S = 10.0  # renew when the lock has this long left, as the SDK does
SLEEP_S = 0.5  # how often the worker looks at the registrations
SETTLED_RETRIES = 3  # renewal calls a pass tries while messages in its batch are being settled


def _duration(value: object, field: str) -> float:
    return limits.check_seconds(value, field)


@dataclass(eq=False)
class _Registration:
    """One renewable under renewal: what renews it, until when, and whom to tell when renewal stops unasked."""

    receiver: Receiver
    renewable: Any
    start: datetime
    duration: float
    callback: LockRenewFailureCallback | None

    @property
    def is_session(self) -> bool:
        return hasattr(self.renewable, "renew_lock")


class AutoLockRenewer:
    """Renews the locks of registered messages and sessions until they are settled, released or time runs out."""

    def __init__(
        self,
        max_lock_renewal_duration: float = 300,
        on_lock_renew_failure: LockRenewFailureCallback | None = None,
        executor: object = None,
        max_workers: int | None = None,
    ) -> None:
        self._max_duration = _duration(max_lock_renewal_duration, "max_lock_renewal_duration")
        if on_lock_renew_failure is not None and not callable(on_lock_renew_failure):
            raise InvalidArgumentTypeError("on_lock_renew_failure must be callable")
        if max_workers is not None:
            limits.check_int(max_workers, "max_workers")
        # executor/max_workers are accepted for SDK parity: one worker thread serves every registration.
        self._on_failure = on_lock_renew_failure
        self._shutdown = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._registrations: list[_Registration] = []
        self._worker: threading.Thread | None = None
        self.renew_period = RENEW_PERIOD_S

    def __enter__(self) -> AutoLockRenewer:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        """InvalidOperationError once closed (a receiver checks this before it receives anything to register)."""
        if self._shutdown.is_set():
            raise InvalidOperationError("the AutoLockRenewer is closed; create a new one")

    def register(
        self,
        receiver: Receiver,
        renewable: Any,
        max_lock_renewal_duration: float | None = None,
        on_lock_renew_failure: LockRenewFailureCallback | None = None,
    ) -> None:
        """Keep renewing `renewable` (a ReceivedMessage of `receiver`, or its session) for up to the max duration."""
        from sparkqueue.message import ReceivedMessage
        from sparkqueue.receiver import Receiver, ReceiverSession

        self._check_open()
        if not isinstance(receiver, Receiver):
            raise InvalidArgumentTypeError(f"receiver must be a sparkqueue receiver, got {type(receiver).__name__}")
        if not isinstance(renewable, (ReceivedMessage, ReceiverSession)):
            raise InvalidArgumentTypeError(
                f"only a received message or a receiver's session can be registered, got {type(renewable).__name__}"
            )
        if isinstance(renewable, ReceivedMessage) and renewable.lock_token is None:
            raise InvalidOperationError("the message holds no lock (peeked, or received in RECEIVE_AND_DELETE mode)")
        if isinstance(renewable, ReceivedMessage) and receiver.session is not None:  # as the SDK refuses it
            raise InvalidOperationError("a session's messages hold no lock of their own: register receiver.session")
        duration = (
            self._max_duration
            if max_lock_renewal_duration is None
            else _duration(max_lock_renewal_duration, "max_lock_renewal_duration")
        )
        callback = on_lock_renew_failure if on_lock_renew_failure is not None else self._on_failure
        with self._lock:
            self._check_open()
            self._registrations.append(_Registration(receiver, renewable, datetime.now(UTC), duration, callback))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, daemon=True, name="sparkqueue-lock-renewer")
                self._worker.start()
        self._wake.set()

    def close(self, wait: bool = True) -> None:
        """Stop renewing; with wait=True, return once the worker has stopped."""
        self._shutdown.set()
        self._wake.set()
        with self._lock:
            worker = self._worker
        if wait and worker is not None and worker is not threading.current_thread():
            worker.join()

    # ---- the worker ------------------------------------------------------------------------------

    def _run(self) -> None:
        """Look at every registration each SLEEP_S: end the finished ones, renew the due ones, until closed."""
        while True:
            with self._lock:
                current = list(self._registrations)
            if self._shutdown.is_set():
                for reg in current:
                    self._finish(reg, None)
                return
            self._pass(current)
            self._wake.wait(SLEEP_S)
            self._wake.clear()

    def _pass(self, current: list[_Registration]) -> None:
        """One look at the registrations: those that ended or timed out are finished; due ones are renewed."""
        now = datetime.now(UTC)
        due: dict[int, list[_Registration]] = {}
        for reg in current:
            if not self._renewable(reg):
                self._finish(reg, None)
            elif now - reg.start >= timedelta(seconds=reg.duration):
                self._finish(reg, AutoLockRenewTimeout(f"auto-renew period ({reg.duration} seconds) elapsed"))
            elif reg.renewable.locked_until_utc - now <= timedelta(seconds=self.renew_period):
                due.setdefault(id(reg.receiver), []).append(reg)
        for regs in due.values():
            self._renew(regs)

    def _renew(self, regs: list[_Registration]) -> None:
        """Renew one receiver's due locks: its messages in one call, its session by itself."""
        messages = [r for r in regs if not r.is_session]
        for reg in regs:
            if reg.is_session:
                try:
                    reg.renewable.renew_lock()
                except Exception as exc:  # a lost lock, a closed receiver, an unavailable partition: report it
                    self._finish(reg, exc)
        held: list[bool] | None = None
        for _ in range(SETTLED_RETRIES):
            # A message the application settled since `_pass` picked it ends its registration alone: the call refuses a
            # settled message for the whole batch, which stopped renewing every other message in it.
            for reg in [r for r in messages if is_settled(r.renewable)]:
                self._finish(reg, None)
            messages = [r for r in messages if not is_settled(r.renewable)]
            if not messages:
                return
            try:
                held = messages[0].receiver.renew_message_locks([r.renewable for r in messages])
                break
            except MessageAlreadySettled:
                continue  # one was settled between the look and the call: look again
            except Exception as exc:
                for reg in messages:
                    self._finish(reg, exc)
                return
        if held is None:
            return  # settled under it again and again: the next pass renews the rest
        for reg, ok in zip(messages, held, strict=True):
            if not ok:
                lost = MessageLockLostError(
                    f"the lock on message {reg.renewable.sequence_number} expired or was taken by a later delivery"
                )
                self._finish(reg, lost)

    def _renewable(self, reg: _Registration) -> bool:
        if reg.receiver.closed or is_settled(reg.renewable):
            return False
        return not lock_expired(reg.renewable.locked_until_utc)

    def _finish(self, reg: _Registration, error: BaseException | None) -> None:
        """Stop renewing `reg`; call its callback when the stop was not asked for (see the module's docstring)."""
        with self._lock:
            if reg not in self._registrations:
                return
            self._registrations.remove(reg)
        renewable = reg.renewable
        reported: BaseException | None = None
        if isinstance(error, AutoLockRenewTimeout):
            reported = renewable.auto_renew_error = error
            clean = not lock_expired(renewable.locked_until_utc)
        elif error is not None:
            log.debug("auto lock renewal failed: %r", error)
            # A close while a renewal ran released the lock, and a settlement in flight ends it: stops that were asked for.
            clean = reg.receiver.closed or is_settled(renewable) or is_settling(renewable)
            if not clean:
                reported = renewable.auto_renew_error = AutoLockRenewFailed("failed to auto-renew the lock", error=error)
        else:
            clean = not lock_expired(renewable.locked_until_utc) or is_settled(renewable) or self._shutdown.is_set()
        if reg.callback is not None and not clean:
            try:
                reg.callback(renewable, reported)
            except Exception:
                log.exception("on_lock_renew_failure callback raised")
