"""AutoLockRenewer (SDK: azure.servicebus.AutoLockRenewer): keep message and session locks alive in the background.

Register a received message or a session receiver's session; one daemon thread renews each lock
when it is within `renew_period` seconds of expiring, until the message is settled, the receiver
closes, `max_lock_renewal_duration` elapses or the renewer is closed. When renewal stops for any
other reason (the lock was lost, a renewal failed) `on_lock_renew_failure(renewable, error)` is
called, as in the SDK; the error is also kept on the renewable's `auto_renew_error`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sparkqueue.errors import (
    AutoLockRenewFailed,
    AutoLockRenewTimeout,
    InvalidArgumentTypeError,
    InvalidOperationError,
)
from sparkqueue.message import is_settled, lock_expired
from sparkqueue.model import limits

if TYPE_CHECKING:
    from sparkqueue.receiver import Receiver

log = logging.getLogger(__name__)

LockRenewFailureCallback = Callable[[Any, BaseException | None], None]
RENEW_PERIOD_S = 10.0  # renew when the lock has this long left, as the SDK does
SLEEP_S = 0.5  # how often a registration checks its lock


def _duration(value: object, field: str) -> float:
    return limits.check_seconds(value, field)


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
        # executor/max_workers are accepted for SDK parity: each registration runs on a daemon thread.
        self._on_failure = on_lock_renew_failure
        self._shutdown = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.renew_period = RENEW_PERIOD_S

    def __enter__(self) -> AutoLockRenewer:
        if self._shutdown.is_set():
            raise InvalidOperationError("the AutoLockRenewer is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

        if self._shutdown.is_set():
            raise InvalidOperationError("the AutoLockRenewer is closed; create a new one")
        if not isinstance(receiver, Receiver):
            raise InvalidArgumentTypeError(f"receiver must be a sparkqueue receiver, got {type(receiver).__name__}")
        if not isinstance(renewable, (ReceivedMessage, ReceiverSession)):
            raise InvalidArgumentTypeError(
                f"only a received message or a receiver's session can be registered, got {type(renewable).__name__}"
            )
        if isinstance(renewable, ReceivedMessage) and renewable.lock_token is None:
            raise InvalidOperationError("the message holds no lock (peeked, or received in RECEIVE_AND_DELETE mode)")
        duration = (
            self._max_duration
            if max_lock_renewal_duration is None
            else _duration(max_lock_renewal_duration, "max_lock_renewal_duration")
        )
        callback = on_lock_renew_failure if on_lock_renew_failure is not None else self._on_failure
        thread = threading.Thread(
            target=self._run,
            args=(receiver, renewable, datetime.now(UTC), duration, callback),
            daemon=True,
            name="sparkqueue-lock-renewer",
        )
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def close(self, wait: bool = True) -> None:
        """Stop renewing; with wait=True, return once every renewal thread has stopped."""
        self._shutdown.set()
        if wait:
            with self._lock:
                threads = list(self._threads)
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    # ---- the renewal loop ------------------------------------------------------------------------

    def _renewable(self, receiver: Receiver, renewable: Any) -> bool:
        if self._shutdown.is_set() or receiver.closed:
            return False
        if is_settled(renewable):
            return False
        return not lock_expired(renewable.locked_until_utc)

    def _run(
        self, receiver: Receiver, renewable: Any, start: datetime, duration: float, callback: LockRenewFailureCallback | None
    ) -> None:
        error: BaseException | None = None
        clean = False  # the callback is only for stops nobody asked for
        try:
            while self._renewable(receiver, renewable):
                if datetime.now(UTC) - start >= timedelta(seconds=duration):
                    raise AutoLockRenewTimeout(f"auto-renew period ({duration} seconds) elapsed")
                if renewable.locked_until_utc - datetime.now(UTC) <= timedelta(seconds=self.renew_period):
                    if hasattr(renewable, "renew_lock"):
                        renewable.renew_lock()
                    else:
                        receiver.renew_message_lock(renewable)
                self._shutdown.wait(SLEEP_S)
            clean = not lock_expired(renewable.locked_until_utc) or is_settled(renewable) or self._shutdown.is_set()
        except AutoLockRenewTimeout as exc:
            error = exc
            renewable.auto_renew_error = exc
            clean = not lock_expired(renewable.locked_until_utc)
        except Exception as exc:  # a lost lock, a closed receiver, an unavailable partition: report it
            log.debug("auto lock renewal failed: %r", exc)
            if receiver.closed:
                clean = True  # the receiver closed while a renewal ran (its lock was released): a stop that was asked for
            else:
                error = AutoLockRenewFailed("failed to auto-renew the lock", error=exc)
                renewable.auto_renew_error = error
        finally:
            if callback is not None and not clean:
                try:
                    callback(renewable, error)
                except Exception:
                    log.exception("on_lock_renew_failure callback raised")
