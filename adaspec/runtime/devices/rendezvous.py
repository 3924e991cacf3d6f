"""Where the ranks of a launch meet before the backend connects them.

torch's ``tcp://`` rendezvous waits in C++ until the whole world has arrived. A rank that died
after arriving, ranks given different --nnodes or one --node_rank twice, and a stop() during
the wait all look to it like a rank not there yet: it gives up at the rendezvous timeout and
names no one, and no signal reaches the waiting thread meanwhile. So rank 0 hosts the store
itself and writes its world size there. Every rank checks that size, counts its arrival,
starts its heartbeat and waits in short steps until all have arrived, watching the
heartbeats of those that have. The first rank to see a fault writes it down, so every other
rank fails with the same reason. The backend then connects the ranks over the same store,
under a prefix of its own.
"""

import datetime
import json
import socket
import threading
import time
from collections.abc import Callable

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from adaspec.errors import CollectiveError, ConfigError, rank_runs
from adaspec.runtime.devices.liveness import BEATS_TO_WAIT, T, answered
from adaspec.runtime.devices.liveness import PREFIX as ALIVE

LAYOUT = "adaspec/start/layout"
ARRIVED = "adaspec/start/arrived/"
FAILED = "adaspec/start/failed"
BACKEND_PREFIX = "adaspec/backend"
STEP_S = 0.1
OP = "init_process_group"
MIN_SILENCE_S = 3.0  # a start-up on a loaded host may starve an idle heartbeat thread briefly


def tcp_address(init_method: str) -> tuple[str, int]:
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def host_store(init_method: str, layout: dict[str, int], timeout: datetime.timedelta
               ) -> TCPStore:
    """Rank 0's store, listening at the address for the others, with its ``layout`` (the
    launch flags every rank must share to create the same groups: --nnodes and the rest)."""
    host, port = tcp_address(init_method)
    _check_own_host(init_method.removeprefix("tcp://"), host)
    try:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    except RuntimeError as error:
        if "EADDRINUSE" not in str(error):
            raise
        # Rank 0 listens there for the rendezvous: the flag is what to change.
        raise ConfigError("--master_node_addr", init_method.removeprefix("tcp://"),
                          "rank 0 cannot listen there for the rendezvous: the port is in use; "
                          "expected a free port") from None
    store.set(LAYOUT, json.dumps(layout))
    return store


def _check_own_host(address: str, host: str) -> None:
    """Rank 0 listens at the address and connects there itself: a host that does not resolve,
    or that is no address of this machine, would fail in c10d's retries, in C++ frames."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError("--master_node_addr", address, f"rank 0 listens there, but its host "
                          f"cannot be resolved ({reason}); expected a name or address of "
                          "rank 0's machine") from None
    for family, kind, _, _, where in found:
        try:
            with socket.socket(family, kind) as probe:
                probe.bind((where[0], 0))
            return
        except OSError:
            continue
    raise ConfigError("--master_node_addr", address, "rank 0 listens there, but its host is no "
                      "address of this machine; expected a name or address of rank 0's machine")


def join_store(init_method: str, world_size: int, timeout: datetime.timedelta,
               stopped: Callable[[], bool] = lambda: False) -> TCPStore:
    """A rank other than 0: a client of rank 0's store, once it answers at the address,
    within ``timeout``. c10d would wait in silence on a listener that is no store (another
    service on the port), and print pages of C++ stack frames while nothing listens; either
    is one CollectiveError here, saying which it was."""
    host, port = tcp_address(init_method)
    deadline = time.monotonic() + timeout.total_seconds()
    group = tuple(range(world_size))
    while True:
        _check_stopped(stopped, group)
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise CollectiveError(OP, group, (
                    f"nothing listens at {host}:{port} after {timeout.total_seconds():g} s; "
                    "is rank 0 started, with this --master_node_addr?")) from None
            time.sleep(STEP_S)
    answered: list[object] = []

    def handshake() -> None:
        try:
            answered.append(TCPStore(host, port, is_master=False, wait_for_workers=False,
                                     timeout=timeout))
        except (RuntimeError, ValueError) as error:
            answered.append(error)

    worker = threading.Thread(target=handshake, name="adaspec-rendezvous-check", daemon=True)
    worker.start()
    while worker.is_alive() and time.monotonic() < deadline:
        _check_stopped(stopped, group)
        worker.join(STEP_S)
    if not answered or not isinstance(answered[0], TCPStore):
        raise CollectiveError(OP, group, (
            f"{host}:{port} accepts connections but no rendezvous store answered there within "
            f"{timeout.total_seconds():g} s; is another service on that port?"))
    return answered[0]


def arrive(store: TCPStore, rank: int, layout: dict[str, int], limit_s: float) -> None:
    """Count this rank in, once its layout is known to be rank 0's."""
    group = tuple(range(layout["--nnodes"]))
    theirs = json.loads(_answer(lambda: store.get(LAYOUT), limit_s, group))
    for flag, mine in layout.items():
        if theirs.get(flag) != mine:
            _fail(store, f"rank {rank} was started with {flag}={mine}, rank 0 with "
                         f"{flag}={theirs.get(flag)}")
            raise ConfigError(flag, mine, f"expected {theirs.get(flag)}, as rank 0 was "
                              "started with: every rank of a launch gives the same")
    if _answer(lambda: store.add(f"{ARRIVED}{rank}", 1), limit_s, group) > 1:
        _fail(store, f"two ranks were started with --node_rank={rank} (a rank that stopped "
                     "cannot be started again: the launch starts over)")
        raise ConfigError("--node_rank", rank, "expected a rank no other rank of this launch "
                          "was started with (a rank that stopped cannot be started again: "
                          "start the launch over)")


def await_every_rank(store: TCPStore, rank: int, world_size: int, beat_s: float,
                     timeout: datetime.timedelta,
                     stopped: Callable[[], bool] = lambda: False) -> None:
    """Wait until every rank has arrived, within ``timeout``; fail at once, with the reason
    the first rank to see it wrote down, when one arrived and then stopped beating, when a
    rank's launch differs, or when ``stopped()`` says this start is abandoned."""
    group = tuple(range(world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    silence_s = max((BEATS_TO_WAIT + 2) * beat_s, MIN_SILENCE_S)
    beats: dict[int, tuple[bytes, float]] = {}  # a peer's last counter, and when it moved
    while True:
        reason, arrived = _answer(lambda: _look(store, rank, world_size, beats, silence_s),
                                  silence_s, group)
        if reason is not None:
            raise CollectiveError(OP, group, reason)
        if len(arrived) == world_size:
            return
        if time.monotonic() >= deadline:
            missing = tuple(peer for peer in group if peer not in arrived)
            raise CollectiveError(OP, group, (
                f"rank {rank_runs(missing)} did not arrive within "
                f"{timeout.total_seconds():g} s; are they started, with this "
                "--master_node_addr and --nnodes?"))
        _check_stopped(stopped, group)
        time.sleep(STEP_S)


def _look(store: TCPStore, rank: int, world_size: int, beats: dict[int, tuple[bytes, float]],
          silence_s: float) -> tuple[str | None, list[int]]:
    """The start's failure, if any rank wrote one or a peer fell silent; who has arrived."""
    if store.check([FAILED]):
        return store.get(FAILED).decode(), []
    arrived = [peer for peer in range(world_size) if store.check([f"{ARRIVED}{peer}"])]
    quiet = _quiet_peers(store, arrived, rank, beats, silence_s)
    if quiet:
        return _fail(store, f"rank {rank_runs(tuple(quiet))} arrived, then stopped: no "
                            f"heartbeat for {silence_s:g} s"), arrived
    return None, arrived


class Connecting(threading.Thread):
    """``connect`` (the backend connecting the ranks, which waits in C++ for all of them)
    in a thread of its own, so the starting thread can watch the others meanwhile. Nothing
    interrupts that wait: when the watch fails first, the thread is left to the backend's
    timeout, as a daemon that does not hold the process open."""

    def __init__(self, connect: Callable[[], None]) -> None:
        super().__init__(name="adaspec-connect", daemon=True)
        self._connect = connect
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self._connect()
        except BaseException as error:  # handed to the watching thread
            self.error = error


def watch(connecting: Connecting, watcher: TCPStore, rank: int, world_size: int,
          beat_s: float, stopped: Callable[[], bool] = lambda: False) -> None:
    """Wait for ``connecting`` to end, raising what it raised; fail first, as in
    await_every_rank, when a rank wrote a failure or fell silent, or the start is stopped."""
    group = tuple(range(world_size))
    silence_s = max((BEATS_TO_WAIT + 2) * beat_s, MIN_SILENCE_S)
    beats: dict[int, tuple[bytes, float]] = {}
    while connecting.is_alive():
        connecting.join(STEP_S)
        if not connecting.is_alive():
            break
        reason, _ = _answer(lambda: _look(watcher, rank, world_size, beats, silence_s),
                            silence_s, group)
        if reason is not None:
            raise CollectiveError(OP, group, reason)
        _check_stopped(stopped, group)
    if connecting.error is not None:
        raise connecting.error


def client(host: str, port: int, timeout: datetime.timedelta) -> TCPStore:
    """Another connection to rank 0's store: one client serves one thread at a time, and a
    backend waiting on a key holds its own."""
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def tell_failure(store: TCPStore, rank: int, error: Exception) -> None:
    """Write this rank's failed start down for the others (unless a failure stands already,
    which this one follows from). Rank 0 hosts the store, so it waits a few polling steps for
    them to read it before its exit takes the store away."""
    reason = error.reason if isinstance(error, CollectiveError) else str(error)
    if reason == STOPPED:
        reason = "it was stopped (a signal, or stop()) while the ranks gathered"
    _fail(store, f"rank {rank} failed to start: {reason}")
    if rank == 0:
        time.sleep(5 * STEP_S)


def backend_store(store: TCPStore) -> PrefixStore:
    """The keys the backend connects over, apart from the start's own."""
    return PrefixStore(BACKEND_PREFIX, store)


def _quiet_peers(store: TCPStore, arrived: list[int], rank: int,
                 beats: dict[int, tuple[bytes, float]], silence_s: float) -> list[int]:
    now = time.monotonic()
    quiet = []
    for peer in arrived:
        key = f"{ALIVE}{peer}"
        if peer == rank or not store.check([key]):
            continue
        count = store.get(key)
        last = beats.get(peer)
        if last is None or last[0] != count:
            beats[peer] = (count, now)
        elif now - last[1] > silence_s:
            quiet.append(peer)
    return quiet


def _answer(work: Callable[[], T], limit_s: float, group: tuple[int, ...]) -> T:
    """What store operations return, read on rank 0's store: a store that is gone, or that
    gives no answer within ``limit_s`` (rank 0 frozen), fails the start naming rank 0."""
    try:
        return answered(work, limit_s)
    except TimeoutError:
        raise CollectiveError(OP, group, f"rank 0 stopped: its rendezvous store gave no "
                              f"answer for {limit_s:g} s") from None
    except (RuntimeError, ValueError):
        raise CollectiveError(OP, group, "rank 0 stopped: its rendezvous store is gone"
                              ) from None


def _fail(store: TCPStore, reason: str) -> str:
    """Write the start's failure down for every other rank; the reason that stands (the
    first one written) is returned."""
    try:
        stood: bytes = answered(lambda: store.compare_set(FAILED, "", reason), 2.0)
    except (TimeoutError, RuntimeError, ValueError):  # no store to tell: no one to tell
        return reason
    return stood.decode()


STOPPED = "the start was stopped while waiting for the ranks"


def _check_stopped(stopped: Callable[[], bool], group: tuple[int, ...]) -> None:
    if stopped():
        raise CollectiveError(OP, group, STOPPED)
