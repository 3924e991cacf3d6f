"""Which peer stopped: every rank's heartbeat in the rendezvous store.

A failed collective tells a rank that the group broke, not which rank broke it: gloo reports
a closed connection or a timeout. So each rank keeps a counter in the rendezvous store at
``--master_node_addr`` (rank 0 hosts it), from its arrival there on, and bumps it every
``beat_s``. A rank whose collective failed reads every peer's counter twice, a few beats
apart: a peer whose counter did not move has stopped (died, or hangs with its process
frozen). When the store itself cannot be reached, rank 0, which hosts it, is the one gone.
The reads wait a few beats only after a failure; serving pays one small store write per beat.

The first rank to find the stopped peers writes them down (the verdict) and every later
one reads them: a rank whose collective failed only because another survivor left after
its own failure must not blame that survivor. So rank 0, whose exit would take the store
along, closes its process groups first (waking the ranks still waiting on it), waits a few
beats for every survivor to read the verdict, and only then lets the store go.
"""

import datetime
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, unstubbed

T = TypeVar("T")

def scope() -> str:
    """The prefix of every key adaspec writes in the rendezvous store. torchrun's own store
    outlives a restart of the workers (--max-restarts): each attempt keeps its own keys."""
    return f"adaspec/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def alive_key(rank: int) -> str:
    return f"{scope()}alive/{rank}"
BEATS_TO_WAIT = 3


class Liveness:
    """This rank's heartbeat, and the probe that names the peers that stopped."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, beat_s: float, *,
                 connect_timeout: datetime.timedelta | None = None) -> None:
        self.host, self.port, self.rank, self.beat_s = host, port, rank, beat_s
        self._connect_timeout = connect_timeout or self._timeout()
        self.world_size = world_size
        self.told: list[int] | None = None  # the verdict this rank read or wrote
        self._stopped = threading.Event()
        self._store: TCPStore | None = self._connect()
        # The probe's own connection, made now: one made after a failure would retry (and
        # log every retry) against a store whose host may be gone.
        self._probe: TCPStore | None = self._connect()
        self._thread = threading.Thread(target=self._beat, name=f"adaspec-alive{rank}",
                                        daemon=True)
        self._thread.start()

    def _connect(self) -> TCPStore:
        """A client that may take as long as the rendezvous to connect (a loaded host accepts
        slowly) but answers within a couple of beats once connected: a probe after a failure
        must not wait long for a store whose host may be gone."""
        store = TCPStore(self.host, self.port, is_master=False, timeout=self._connect_timeout,
                         wait_for_workers=False)
        store.set_timeout(self._timeout())
        return store

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(2.0, 2 * self.beat_s))

    def _beat(self) -> None:
        count = 0
        while not self._stopped.is_set() and self._store is not None:
            try:
                self._store.set(alive_key(self.rank), str(count))
            except Exception:  # the store's host (rank 0) is gone: nothing left to tell
                return
            count += 1
            self._stopped.wait(self.beat_s)

    def stopped_peers(self, group: Sequence[int]) -> list[int]:
        """The peers of ``group`` whose heartbeat stopped (empty when all still beat)."""
        peers = [rank for rank in group if rank != self.rank]
        try:
            told = answered(self._verdict, (BEATS_TO_WAIT + 4) * self.beat_s + 2.0)
        except Exception:  # no store, or one that does not answer: its host, rank 0, is gone
            return [0] if 0 in peers else []
        self.told = told
        return [rank for rank in told if rank in peers]

    def _verdict(self) -> list[int]:
        store = self._probe
        assert store is not None, "probed after close"
        verdict = f"{scope()}stopped"
        if store.check([verdict]):
            told = _ranks(store.get(verdict))
        else:
            before = _counters(store, range(self.world_size))
            time.sleep(BEATS_TO_WAIT * self.beat_s)  # only ever after a failure
            after = _counters(store, range(self.world_size))
            told = [rank for rank in range(self.world_size)
                    if rank != self.rank and before[rank] == after[rank]]
            store.set(verdict, ",".join(map(str, told)))
        store.add(f"{scope()}read", 1)
        return told

    def linger(self) -> None:
        """Rank 0, once a failure was seen: wait (a few beats at most) until every survivor
        read the verdict, so the store outlives their probes."""
        if self.rank != 0 or self.told is None:
            return
        survivors = self.world_size - len(self.told)
        deadline = time.monotonic() + (BEATS_TO_WAIT + 3) * self.beat_s
        store = self._probe
        try:
            while store is not None and store.add(f"{scope()}read", 0) < survivors \
                    and time.monotonic() < deadline:
                self._stopped.wait(self.beat_s / 4)
        except Exception:  # nothing to wait for without a store
            return

    def close(self) -> None:
        """Stop beating and let go of the store (its host may be closing it)."""
        self._stopped.set()
        self._thread.join(timeout=2 * self.beat_s + 1)
        self._store = self._probe = None


class StoreCall(threading.Thread, Generic[T]):
    """``work`` (store operations) in a daemon thread, started at once. A store whose host is
    frozen (SIGSTOP, a hung machine) never answers, and a client operation has no timeout of
    its own: the caller waits as long as it chooses, and leaves the thread behind after."""

    def __init__(self, work: Callable[[], T]) -> None:
        super().__init__(name="adaspec-store-op", daemon=True)
        self._work = work
        self._box: list[tuple[bool, object]] = []
        self.start()

    def run(self) -> None:
        try:
            self._box.append((True, self._work()))
        except Exception as error:  # handed to the caller
            self._box.append((False, error))

    def result(self) -> T:
        """What ``work`` returned, once the thread has ended; what it raised is raised."""
        done, value = self._box[0]
        if not done:
            assert isinstance(value, Exception)
            raise value
        return value  # type: ignore[return-value]


def answered(work: Callable[[], T], limit_s: float) -> T:
    """What ``work`` returns, or TimeoutError after ``limit_s`` (see StoreCall)."""
    call = StoreCall(work)
    call.join(limit_s)
    if call.is_alive():
        raise TimeoutError(f"no answer within {limit_s:g} s")
    return call.result()


def _ranks(text: bytes) -> list[int]:
    return [int(rank) for rank in text.decode().split(",") if rank]


def _counters(store: TCPStore, ranks: Sequence[int]) -> dict[int, bytes | None]:
    keys = {rank: alive_key(rank) for rank in ranks}
    return {rank: store.get(key) if store.check([key]) else None for rank, key in keys.items()}
