"""An HTTP proxy in front of Azurite that can lose a reply (the store did the work, the client never hears) or a request.

A lost reply is what a network fault does to a request that succeeded; obstore then retries it.
`rule(method, path, headers)` picks the requests whose reply is dropped (True). One upstream
connection per request keeps the relay simple.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

Rule = Callable[[str, str, dict[str, str]], bool]


class LossyProxy:
    """Relays requests to 127.0.0.1:`upstream_port`; drops the reply of those `rule` picks. `dropped` counts them.

    `refuse` picks requests that never reach the store (it is unreachable for them); it may also
    sleep to hold a request up before it is relayed.
    """

    def __init__(self, upstream_port: int, rule: Rule, refuse: Rule | None = None) -> None:
        self.upstream_port = upstream_port
        self.rule = rule
        self.refuse = refuse
        self.dropped = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def storage_options(self, direct: dict[str, str]) -> dict[str, str]:
        """`direct` (options reaching Azurite) with the endpoint moved to this proxy."""
        account = direct["account_name"]
        return {**direct, "azure_storage_endpoint": f"http://127.0.0.1:{self.port}/{account}"}

    def stop(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, contextlib.suppress(OSError):
            request = _read_request(client)
            if request is None:
                return
            method, path, headers, raw = request
            if self.refuse is not None and self.refuse(method, path, headers):
                return  # closed unanswered: the store never saw it
            with socket.create_connection(("127.0.0.1", self.upstream_port)) as upstream:
                upstream.sendall(raw)
                reply = b"".join(iter(lambda: upstream.recv(65536), b""))
            if self.rule(method, path, headers):
                self.dropped += 1
                return  # the store did the work; the client's connection closes without a reply
            client.sendall(reply)


def _read_request(sock: socket.socket) -> tuple[str, str, dict[str, str], bytes] | None:
    """One HTTP request from `sock`, rewritten to close the upstream connection after its reply."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        data = sock.recv(65536)
        if not data:
            return None
        body += data
    kept = [line for line in lines[1:] if not line.lower().startswith("connection:")]
    raw = "\r\n".join([lines[0], *kept, "Connection: close"]).encode("latin1") + b"\r\n\r\n" + body[:length]
    return method, path, headers, raw
