"""Start ``adaspec serve`` as a process of its own on 127.0.0.1, wait for its "ready" line,
and stop it with SIGTERM. A server that never gets ready fails the test at a hard limit."""

import http.client
import json
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from gloo_job import PROCESS_LIMIT_S, REPO, peer_environment
from rank_launch import free_port

MODEL = "builtin:target"


@dataclass(slots=True)
class Served:
    process: subprocess.Popen[str]
    port: int
    lines: list[dict[str, Any]] = field(default_factory=list)
    """Every JSON line the server wrote on stderr so far."""
    other: list[str] = field(default_factory=list)
    """Its other stderr lines (an error, calibration progress)."""
    ready: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    logged: threading.Condition = field(default_factory=threading.Condition)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    def wait_for(self, name: str, count: int) -> None:
        """Block until the server has logged ``count`` events called ``name``."""
        with self.logged:
            if not self.logged.wait_for(lambda: len(self.events(name)) >= count
                                        or self.ended.is_set(), PROCESS_LIMIT_S):
                raise AssertionError(f"the server did not log {count} {name!r} events")
        assert len(self.events(name)) >= count, self.other[-5:]

    def request(self, method: str, path: str, body: bytes | str | dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """One HTTP exchange: status, headers (lower-case names), body."""
        if isinstance(body, dict):
            body = json.dumps(body)
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PROCESS_LIMIT_S)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return (response.status, {k.lower(): v for k, v in response.getheaders()},
                    response.read())
        finally:
            connection.close()

    def request_lines(self, path: str, body: bytes, headers: list[tuple[str, str]]
                      ) -> tuple[int, dict[str, str], bytes]:
        """A POST whose header lines are sent as given, a name repeated included."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PROCESS_LIMIT_S)
        try:
            connection.putrequest("POST", path)
            for name, value in [*headers, ("Content-Length", str(len(body)))]:
                connection.putheader(name, value)
            connection.endheaders(body)
            response = connection.getresponse()
            return (response.status, {k.lower(): v for k, v in response.getheaders()},
                    response.read())
        finally:
            connection.close()

    def post(self, body: bytes | str | dict[str, Any]) -> tuple[int, dict[str, Any]]:
        status, _, data = self.request("POST", "/v1/completions", body)
        return status, json.loads(data)

    def stop(self) -> int:
        """SIGTERM, then the exit status once it has drained and ended."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=PROCESS_LIMIT_S)
        finally:
            self.ended.wait(PROCESS_LIMIT_S)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=PROCESS_LIMIT_S)


def _read(served: Served) -> None:
    assert served.process.stderr is not None
    for line in served.process.stderr:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        with served.logged:
            if isinstance(record, dict):
                served.lines.append(record)
                if record.get("event") == "ready":
                    served.ready.set()
            else:
                served.other.append(line.rstrip("\n"))
            served.logged.notify_all()
    served.process.stderr.close()
    with served.logged:
        served.ended.set()
        served.logged.notify_all()
    served.ready.set()  # a server that ended before it was ready: the waiter sees it


def start_server(*flags: str, program: tuple[str, ...] = ("-m", "adaspec", "serve"),
                 port: int | None = None) -> Served:
    """``adaspec serve`` with ``flags`` on a free port (or on ``port``, which the flags
    already give, when it is given), once ready."""
    given = port is not None
    port = port or free_port()
    own = [] if given else [f"--port={port}"]
    process = subprocess.Popen([sys.executable, *program, *own, *flags],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=peer_environment(), cwd=REPO)
    served = Served(process=process, port=port)
    threading.Thread(target=_read, args=(served,), daemon=True).start()
    if not served.ready.wait(PROCESS_LIMIT_S) or not served.events("ready"):
        served.kill()
        raise AssertionError(f"adaspec serve did not get ready: {served.other[-5:]}")
    return served
