"""Interpreter exit while other threads are inside sparkqueue calls: wait for them to leave native code first.

delta-rs and pyarrow run native code with the GIL released. A daemon thread that is inside such a
call when the interpreter finalizes is terminated when the call returns and asks for the GIL
back (CPython ends the thread with pthread_exit), and the forced unwinding through Rust or C++
frames aborts the whole process (SIGSEGV/SIGABRT) after a successful run. sparkqueue's own
threads are its file writers (storage/files.py), whose work ends before the call that started it
returns; this hook protects its users' daemon threads (receivers, senders).

At exit, `_at_exit` (registered when sparkqueue is imported) closes the gate `native_call()` guards,
so a thread that reaches a guarded call from then on parks in Python (where being ended is
harmless), flushes logging, and then waits, up to `EXIT_GRACE_S`, until no other thread is
inside a guarded call or inside sparkqueue/deltalake/pyarrow frames. It returns holding the GIL,
so no thread can enter native code between the check and finalization.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

EXIT_GRACE_S = 30.0  # longer than any single delta-rs call normally takes (one commit, one read)
_POLL_S = 0.002
_closing = threading.Event()
_active = 0
_active_lock = threading.Lock()
_parked = threading.Event()  # never set: parked threads wait here until the process ends


_parked_threads: set[int] = set()


def _park() -> None:
    """After exit has begun, a thread other than the main one waits here, in Python, until the process ends."""
    if _closing.is_set() and threading.current_thread() is not threading.main_thread():
        _parked_threads.add(threading.get_ident())
        _parked.wait()


@contextlib.contextmanager
def native_call() -> Iterator[None]:
    """Guard a call into native code (delta-rs, pyarrow): after exit has begun, other threads park here instead."""
    global _active
    _park()
    with _active_lock:
        _active += 1
    try:
        yield
    finally:
        with _active_lock:
            _active -= 1


def _library_dirs() -> tuple[str, ...]:
    """Directories of sparkqueue, deltalake and pyarrow (those imported by now)."""
    dirs = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for name in ("deltalake", "pyarrow"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _threads_in_library(dirs: tuple[str, ...]) -> list[int]:
    """Ids of other threads with a sparkqueue, deltalake or pyarrow frame on their stack."""
    me = threading.get_ident()
    busy = []
    for ident, frame in sys._current_frames().items():
        if ident == me or ident in _parked_threads:
            continue
        f: FrameType | None = frame
        while f is not None:
            if f.f_code.co_filename.startswith(dirs):
                busy.append(ident)
                break
            f = f.f_back
    return busy


def _gate_public_api() -> None:
    """Make every public method of senders, receivers and the namespace park other threads once exit has begun.

    Applied at exit only, so it costs nothing before; a thread already inside a call finishes it,
    and its next call parks at the entry, before any native code.
    """
    from sparkqueue.management import Management
    from sparkqueue.namespace import Namespace
    from sparkqueue.receiver import Receiver
    from sparkqueue.sender import Sender

    for cls in (Sender, Receiver, Namespace, Management):
        for name, attr in list(vars(cls).items()):
            if name.startswith("_") or not callable(attr) or isinstance(attr, (staticmethod, classmethod, type)):
                continue

            def gated(*args: object, __fn: Any = attr, **kwargs: object) -> object:
                _park()
                return __fn(*args, **kwargs)

            setattr(cls, name, gated)


def wait_for_library_threads(grace_s: float = EXIT_GRACE_S) -> bool:
    """Close the gate and wait until no other thread is inside a library call; False if the grace period ran out."""
    _closing.set()
    with contextlib.suppress(Exception):
        _gate_public_api()
    dirs = _library_dirs()
    deadline = time.monotonic() + grace_s
    while True:
        if _active == 0 and not _threads_in_library(dirs):
            return True  # checked holding the GIL: no thread can enter native code before we return
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)  # let them run to the end of their call


def _at_exit() -> None:
    """atexit hook: flush logging, then wait for threads inside library calls (see the module docstring)."""
    if threading.active_count() <= 1:
        return
    logging.shutdown()  # its I/O releases the GIL: done before the final check, not after
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if not wait_for_library_threads():  # the exit status is not known here, so finalization goes on regardless
        with contextlib.suppress(Exception):
            sys.stderr.write(f"sparkqueue: threads were still inside library calls {EXIT_GRACE_S:.0f} s after exit began\n")
            sys.stderr.flush()


atexit.register(_at_exit)
