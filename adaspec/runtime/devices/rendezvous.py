"""Where the ranks of a launch meet before the backend connects them.

torch's ``tcp://`` rendezvous waits in C++ until the whole world has arrived. A rank that died
after arriving, ranks given another layout or one --node_rank twice, and a stop() during the
wait all look to it like a rank not there yet: it gives up at the rendezvous timeout and
names no one, and no signal reaches the waiting thread meanwhile. So rank 0 hosts the store
itself (or, under torchrun, joins the agent's) and writes its layout there. Every rank checks
that layout, counts its arrival, starts its heartbeat and waits in short steps until all have
arrived, watching the heartbeats of those that have. The first rank to see a fault writes it
down, so every other rank fails with the same reason. The backend then connects the ranks
over the same store, under a prefix of its own.

Every operation on the store runs where the caller can stop waiting for it (``answered``): a
store client has no timeout of its own, so a frozen rank 0 would hold it forever.
"""

import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from adaspec.errors import CollectiveError, ConfigError, rank_runs
from adaspec.runtime.devices.liveness import (
    BEATS_TO_WAIT,
    StoreCall,
    alive_key,
    answered,
    scope,
)

T = TypeVar("T")

STEP_S = 0.1
OP = "init_process_group"
MIN_SILENCE_S = 3.0  # a start-up on a loaded host may starve an idle heartbeat thread briefly
STOPPED = "the start was stopped while waiting for the ranks"
GONE = "rank 0 stopped: its rendezvous store is gone"


@dataclass(frozen=True, slots=True)
class Gathering:
    """One start's wait for the ranks: until ``deadline`` (monotonic), ``timeout_s`` in all,
    ended early once ``stopped()`` turns true. Once the store has answered, a call on it that
    gives no answer for ``answer_s`` (None: no such limit) means rank 0, which hosts it, is
    frozen: its wait ends then, not at the deadline."""

    deadline: float
    timeout_s: float
    stopped: Callable[[], bool]
    answer_s: float | None = None

    def over(self) -> bool:
        return time.monotonic() >= self.deadline


def silence_s(beat_s: float) -> float:
    """How long a peer's heartbeat, or the store's answer, may be missing before the start
    counts the rank behind it as stopped."""
    return max((BEATS_TO_WAIT + 2) * beat_s, MIN_SILENCE_S)


def _key(name: str) -> str:
    return f"{scope()}start/{name}"


def arrived_key(rank: int) -> str:
    """The key a rank's arrival is counted under (what a launcher may wait on)."""
    return _key(f"arrived/{rank}")


def tcp_address(init_method: str) -> tuple[str, int]:
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def agent_hosts_the_store() -> bool:
    """Under torchrun the agent already hosts a store at MASTER_ADDR:MASTER_PORT, and says
    so: every rank, rank 0 too, joins it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def host_store(init_method: str, timeout: datetime.timedelta) -> TCPStore:
    """Rank 0's store, listening at the address's port on every interface of this machine.
    Its own connection goes over the loopback, so a host name that reaches rank 0 only from
    elsewhere (a service name, a forwarded address) serves as well."""
    host, port = tcp_address(init_method)
    _check_resolves(init_method.removeprefix("tcp://"), host)
    try:
        return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                        timeout=timeout)
    except RuntimeError as error:
        if "EADDRINUSE" not in str(error):
            raise
        # Rank 0 listens there for the rendezvous: the flag is what to change.
        raise ConfigError("--master_node_addr", init_method.removeprefix("tcp://"),
                          "rank 0 cannot listen there for the rendezvous: the port is in use; "
                          "expected a free port") from None


def _check_resolves(address: str, host: str) -> None:
    """A host that names nothing (a typo) is refused on rank 0 before any rank waits for it."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        reason = "no valid host name" if isinstance(error, UnicodeError) else error.strerror
        raise ConfigError("--master_node_addr", address, f"rank 0's host cannot be resolved "
                          f"({reason}); expected a name or address of rank 0's machine"
                          ) from None


def join_store(init_method: str, world_size: int, gathering: Gathering) -> TCPStore:
    """A client of the store at the address, once it answers, within the gathering.
    c10d would wait in silence on a listener that is no store (another service on the port),
    and print pages of C++ stack frames while nothing listens; either is one CollectiveError
    here, saying which it was."""
    host, port = tcp_address(init_method)
    group = tuple(range(world_size))
    while True:
        _check_stopped(gathering.stopped, group)
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except OSError as error:
            if gathering.over():
                raise CollectiveError(OP, group, _unreached(host, port, gathering, error)
                                      ) from None
            time.sleep(STEP_S)
    # A listener found at the very end still gets a second to answer.
    handshake = Gathering(max(gathering.deadline, time.monotonic() + 1.0),
                          gathering.timeout_s, gathering.stopped)
    timeout = datetime.timedelta(seconds=handshake.deadline - time.monotonic())
    try:
        return _until(lambda: client(host, port, timeout), handshake, group, (host, port))
    except CollectiveError as error:
        if error.reason == STOPPED:
            raise
        if _refused((host, port)):  # it accepted, then went away: rank 0 was killed
            raise CollectiveError(OP, group, GONE) from None
        raise CollectiveError(OP, group, (
            f"{host}:{port} accepts connections but no rendezvous store answered there within "
            f"{gathering.timeout_s:g} s; is another service on that port?")) from None


def _unreached(host: str, port: int, gathering: Gathering, error: OSError) -> str:
    """Why rank 0's store was not reached: a name that never resolved (a follower keeps
    asking, since a cluster's names may appear late) or a port nothing listened on."""
    if isinstance(error, socket.gaierror):
        return (f"rank 0's host {host} could not be resolved ({error.strerror}) within "
                f"{gathering.timeout_s:g} s; expected a name or address of rank 0's machine in "
                "--master_node_addr")
    host_hint = ("is the torchrun agent, which TORCHELASTIC_USE_AGENT_STORE=True says hosts it, "
                 "started there?" if agent_hosts_the_store() else
                 "is rank 0 started, with this --master_node_addr?")
    return f"nothing listens at {host}:{port} after {gathering.timeout_s:g} s; {host_hint}"


def client(host: str, port: int, timeout: datetime.timedelta) -> TCPStore:
    """A connection to the store. One client serves one thread at a time (a backend waiting
    on a key holds it), so the watching thread has its own."""
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def publish_layout(store: TCPStore, layout: dict[str, int], gathering: Gathering) -> None:
    """Rank 0: the launch flags every rank must share to create the same groups."""
    group = tuple(range(layout["--nnodes"]))
    _until(lambda: store.set(_key("layout"), json.dumps(layout)), gathering, group)


def arrive(store: TCPStore, rank: int, layout: dict[str, int], gathering: Gathering) -> None:
    """Count this rank in, once its layout is known to be rank 0's."""
    group = tuple(range(layout["--nnodes"]))
    theirs = _rank_0_layout(store, group, gathering)
    for flag, mine in layout.items():
        if theirs.get(flag) != mine:
            _fail(store, f"rank {rank} was started with {flag}={mine}, rank 0 with "
                         f"{flag}={theirs.get(flag)}")
            raise ConfigError(flag, mine, f"expected {theirs.get(flag)}, as rank 0 was "
                              "started with: every rank of a launch gives the same")
    if _until(lambda: store.add(arrived_key(rank), 1), gathering, group) > 1:
        _fail(store, f"two ranks were started with --node_rank={rank} (a rank that stopped "
                     "cannot be started again: the launch starts over)")
        raise ConfigError("--node_rank", rank, "expected a rank no other rank of this launch "
                          "was started with (a rank that stopped cannot be started again: "
                          "start the launch over)")
    _until(lambda: store.add(_key("arrivals"), 1), gathering, group)


def _rank_0_layout(store: TCPStore, group: tuple[int, ...], gathering: Gathering
                   ) -> dict[str, object]:
    key = _key("layout")
    while not _until(lambda: store.check([key]), gathering, group):
        if gathering.over():
            raise CollectiveError(OP, group, f"no adaspec launch wrote its layout in the store "
                                  f"there within {gathering.timeout_s:g} s; is another service, "
                                  "or another kind of job, on that port?")
        time.sleep(STEP_S)
    text = _until(lambda: store.get(key), gathering, group)
    try:
        layout = json.loads(text)
    except ValueError:
        layout = None
    if not isinstance(layout, dict):
        raise CollectiveError(OP, group, "the store there holds no layout adaspec wrote; is "
                              "another kind of job on that port?")
    return layout


def await_every_rank(watcher: TCPStore, rank: int, world_size: int, beat_s: float,
                     gathering: Gathering) -> None:
    """Wait until every rank has arrived, within the gathering; fail at once, with the reason the
    first rank to see it wrote down, when one arrived and then stopped beating, when a rank's
    launch differs, or when ``stopped()`` says this start is abandoned."""
    group = tuple(range(world_size))
    look = _Look(watcher, rank, world_size, beat_s)
    while True:
        arrived = look.step()
        if len(arrived) == world_size:
            return
        if gathering.over():
            missing = tuple(peer for peer in group if peer not in arrived)
            raise CollectiveError(OP, group, (
                f"rank {rank_runs(missing)} did not arrive within {gathering.timeout_s:g} s; "
                "are they started, with this --master_node_addr and --nnodes?"))
        _check_stopped(gathering.stopped, group)
        time.sleep(STEP_S)


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
          beat_s: float, stopped: Callable[[], bool]) -> None:
    """Wait for ``connecting`` to end, raising what it raised; fail first, as in
    await_every_rank, when a rank wrote a failure or fell silent, or the start is stopped.
    A connection that failed gets one more look first: the backend names a rank 0 killed
    meanwhile in socket terms, where the look names it (or a failure another rank wrote)."""
    group = tuple(range(world_size))
    look = _Look(watcher, rank, world_size, beat_s)
    while connecting.is_alive():
        connecting.join(STEP_S)
        if not connecting.is_alive():
            break
        look.step()
        _check_stopped(stopped, group)
    if connecting.error is not None:
        look.step()
        raise connecting.error


def tell_failure(store: TCPStore, rank: int, error: Exception) -> None:
    """Write this rank's failed start down for the others (unless a failure stands already,
    which this one follows from). Rank 0 hosts the store, so it waits, a few seconds at most,
    until every rank that arrived has read it, before its exit takes the store away."""
    if isinstance(error, CollectiveError) and error.reason == STOPPED:
        reason = f"rank {rank} failed to start: it was stopped (a signal, or stop()) while the " \
                 "ranks gathered"
    elif isinstance(error, CollectiveError) and error.op == OP:
        reason = error.reason  # about the gathering, maybe other ranks: as every rank says it
    else:
        reason = f"rank {rank} failed to start: {error}"
    _fail(store, reason)
    if rank == 0:
        until = time.monotonic() + MIN_SILENCE_S
        try:
            while answered(lambda: _unread(store), 1.0) and time.monotonic() < until:
                time.sleep(STEP_S)
        except Exception:  # no store to wait on
            return


def _unread(store: TCPStore) -> bool:
    arrived = int(store.add(_key("arrivals"), 0))
    return int(store.add(_key("failure-read"), 0)) < arrived


def backend_store(store: TCPStore) -> PrefixStore:
    """The keys the backend connects over, apart from the start's own."""
    return PrefixStore(f"{scope()}backend", store)


class _Look:
    """One rank's look at the others on the store, step after step: the heartbeats it saw
    move, and the silence after which an arrived peer counts as stopped."""

    def __init__(self, watcher: TCPStore, rank: int, world_size: int, beat_s: float) -> None:
        self.watcher, self.rank, self.world_size = watcher, rank, world_size
        self.group = tuple(range(world_size))
        self.silence_s = silence_s(beat_s)
        self.beats: dict[int, tuple[bytes, float]] = {}  # a peer's counter, and when it moved

    def step(self) -> list[int]:
        """The ranks that have arrived; a CollectiveError when the start failed."""
        reason, arrived = _answer(lambda: _look(self.watcher, self.rank, self.world_size,
                                                self.beats, self.silence_s),
                                  self.silence_s, self.group)
        if reason is not None:
            raise CollectiveError(OP, self.group, reason)
        return arrived


def _look(store: TCPStore, rank: int, world_size: int, beats: dict[int, tuple[bytes, float]],
          silence_s: float) -> tuple[str | None, list[int]]:
    """The start's failure, if any rank wrote one or a peer fell silent; who has arrived."""
    if store.check([_key("failed")]):
        store.add(_key("failure-read"), 1)
        return store.get(_key("failed")).decode(), []
    arrived = [peer for peer in range(world_size) if store.check([arrived_key(peer)])]
    quiet = _quiet_peers(store, arrived, rank, beats, silence_s)
    if quiet:
        return _fail(store, f"rank {rank_runs(tuple(quiet))} arrived, then stopped: no "
                            f"heartbeat for {silence_s:g} s"), arrived
    return None, arrived


def _quiet_peers(store: TCPStore, arrived: list[int], rank: int,
                 beats: dict[int, tuple[bytes, float]], silence_s: float) -> list[int]:
    """The arrived peers whose heartbeat has not moved for ``silence_s``: one that never beat
    counts from when it was first seen arrived."""
    now = time.monotonic()
    quiet = []
    for peer in arrived:
        if peer == rank:
            continue
        key = alive_key(peer)
        count = store.get(key) if store.check([key]) else b""
        last = beats.get(peer)
        if last is None or last[0] != count:
            beats[peer] = (count, now)
        elif now - last[1] > silence_s:
            quiet.append(peer)
    return quiet


def _answer(work: Callable[[], T], limit_s: float, group: tuple[int, ...]) -> T:
    """What store operations return: a store that is gone, or that gives no answer within
    ``limit_s`` (rank 0 frozen), fails the start naming rank 0, which hosts it."""
    try:
        return answered(work, limit_s)
    except TimeoutError:
        raise CollectiveError(OP, group, f"rank 0 stopped: its rendezvous store gave no "
                              f"answer for {limit_s:g} s") from None
    except (RuntimeError, ValueError):
        raise CollectiveError(OP, group, GONE) from None


def reached(connect: Callable[[], T], address: tuple[str, int], gathering: Gathering,
            group: tuple[int, ...]) -> T:
    """A connection to rank 0's store once it has answered, within the gathering (no answer
    limit: a loaded host may accept slowly). c10d's client keeps retrying a refused connect
    until its timeout: a store that refuses once it was found has gone away (rank 0 killed),
    which ends the wait at once."""
    whole = Gathering(gathering.deadline, gathering.timeout_s, gathering.stopped)
    return _until(connect, whole, group, address)


def _until(work: Callable[[], T], gathering: Gathering, group: tuple[int, ...],
           address: tuple[str, int] | None = None) -> T:
    """``work`` on the store, waited for in steps until a few seconds past the gathering's
    deadline, or its ``answer_s``, or until it is stopped, or until nothing listens at
    ``address`` any more. A store that goes away (rank 0 killed) fails the start naming
    rank 0, as the heartbeat watch does."""
    call = StoreCall(work)
    began = time.monotonic()
    while call.is_alive():
        call.join(STEP_S)
        _check_stopped(gathering.stopped, group)
        if not call.is_alive():
            break
        if address is not None and _refused(address):
            raise CollectiveError(OP, group, GONE)
        now = time.monotonic()
        if gathering.answer_s is not None and now - began >= gathering.answer_s:
            raise CollectiveError(OP, group, f"rank 0 stopped: its rendezvous store gave no "
                                  f"answer for {gathering.answer_s:g} s")
        if now >= gathering.deadline + MIN_SILENCE_S:
            raise CollectiveError(OP, group, "rank 0 stopped: its rendezvous store gave no "
                                  "answer")
    try:
        return call.result()
    except (RuntimeError, ValueError):
        raise CollectiveError(OP, group, GONE) from None


def _refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable for now, or slow: not known to be gone
        return False
    return False


def _fail(store: TCPStore, reason: str) -> str:
    """Write the start's failure down for every other rank; the reason that stands (the
    first one written) is returned."""
    try:
        stood = answered(lambda: store.compare_set(_key("failed"), "", reason), 2.0).decode()
        if stood == reason:  # read by its writer (a rank that read another's counted then)
            answered(lambda: store.add(_key("failure-read"), 1), 2.0)
    except (TimeoutError, RuntimeError, ValueError):  # no store to tell: no one to tell
        return reason
    return stood


def _check_stopped(stopped: Callable[[], bool], group: tuple[int, ...]) -> None:
    if stopped():
        raise CollectiveError(OP, group, STOPPED)
