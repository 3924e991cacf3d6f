"""The collectives that keep TP ranks and DP shards in lockstep during a round.

Lagged inputs alone do not make every rank decide the same thing. In the consensus state the
TP ranks of a DP shard adopt TP rank 0's draft confidences, so prefix allocation admits the
same rows everywhere; in the sample state they adopt its sampled target token ids, so every
rank commits the same tokens. Between rounds the host agrees on the front's plan and, with
DP shards, gathers what every shard retired, so all decide one G from the same feedback
(``dp_agree_rows`` checks a G against every rank's). A rank that diverged would issue
different collectives later and hang the job, so divergence and dead peers surface here as
``ConsensusMismatch`` and ``CollectiveError`` instead.

Rank layout: world = dp_size * tp_size; DP shard s owns the ranks s*tp_size .. s*tp_size +
tp_size - 1; the TP rank is rank % tp_size; the DP group of a rank is the ranks with its TP
rank in every shard.
"""

import datetime
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, unstubbed

from adaspec.availability import require_device
from adaspec.errors import CollectiveError, ConfigError, ConsensusMismatch, rank_runs
from adaspec.runtime.devices.liveness import Liveness
from adaspec.runtime.devices.rendezvous import (
    STOPPED,
    Connecting,
    Gathering,
    agent_hosts_the_store,
    arrive,
    await_every_rank,
    backend_store,
    client,
    host_store,
    join_store,
    publish_layout,
    reached,
    silence_s,
    tcp_address,
    tell_failure,
    watch,
)

Device = Literal["cpu", "cuda", "npu"]

DEVICE_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""The torch.distributed backend of the launch device's collectives (host agreement is gloo)."""

_MAX_REASON = 200


class Collectives(Protocol):
    """What the round runtime needs from the ranks around it; one rank needs nothing."""

    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def dp_size(self) -> int: ...

    def tp_broadcast(self, tensor: Tensor) -> None:
        """Overwrite ``tensor`` in place with TP rank 0's values on every TP rank of this DP
        shard, enqueued on the launch device without a host read."""

    def tp_all_reduce(self, tensor: Tensor) -> None:
        """Sum ``tensor`` in place over the TP ranks of this DP shard (the row-parallel
        projections of a model split across them), on the launch device."""

    def dp_agree_rows(self, num_rows: int) -> int:
        """Return G when every rank (every DP shard and TP rank) chose it; raise
        ``ConsensusMismatch`` with each rank's value otherwise."""

    def share_from_first_rank(self, data: bytes, op: str = "share_from_first_rank") -> bytes:
        """Rank 0's ``data`` on every rank, on the host: the cost table installed everywhere
        before ready, and the front's plan once per loop turn. ``op`` names it in errors."""

    def gather_from_every_rank(self, data: bytes, op: str = "gather_from_every_rank"
                               ) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank, on the host: what each DP
        shard retired and will decode next, once per loop turn. Only DP shards need it."""

    def close(self) -> None:
        """Release the process groups; calling it again does nothing."""


class LocalCollectives:
    """One process, one TP rank, one DP shard: every agreement is trivially reached."""

    tp_rank = 0
    tp_size = 1
    dp_rank = 0
    dp_size = 1

    def tp_broadcast(self, tensor: Tensor) -> None:
        """TP rank 0 is this process, so the tensor already holds its values."""

    def tp_all_reduce(self, tensor: Tensor) -> None:
        """One TP rank holds the whole sum already."""

    def dp_agree_rows(self, num_rows: int) -> int:
        return num_rows

    def share_from_first_rank(self, data: bytes, op: str = "share_from_first_rank") -> bytes:
        return data

    def gather_from_every_rank(self, data: bytes, op: str = "gather_from_every_rank"
                               ) -> list[bytes]:
        return [data]

    def close(self) -> None:
        """Nothing was opened."""


def backend_reason(error: BaseException) -> str:
    """The first line of a backend message without gloo's ``[file.cc:123]`` prefix, so
    ``CollectiveError`` stays one line while the chained cause keeps the full report."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = lines[0] if lines else type(error).__name__
    if reason.startswith("[") and "] " in reason:
        reason = reason.split("] ", 1)[1].strip() or reason
    # gloo's advice to read the remote worker's logs: adaspec names the rank that stopped.
    reason = reason.split(" This is typically caused by a remote worker", 1)[0]
    if len(reason) > _MAX_REASON:
        reason = reason[: _MAX_REASON - 3] + "..."
    return reason


@contextmanager
def _collective(op: str, group: tuple[int, ...], liveness: Liveness | None = None
                ) -> Iterator[None]:
    """Re-raise a backend failure (dead peer, timeout, broken transport) as CollectiveError,
    naming the peers that stopped when the heartbeats tell."""
    try:
        yield
    except (RuntimeError, ValueError) as error:  # DistError and its kinds are RuntimeErrors
        reason = backend_reason(error)
        stopped = [] if liveness is None else liveness.stopped_peers(group)
        if stopped:
            reason += f"; rank {rank_runs(tuple(stopped))} stopped"
        raise CollectiveError(op, group, reason) from error


def _check_layout(rank: int, world_size: int, tp_size: int, dp_size: int) -> None:
    for name, size in (("tp_size", tp_size), ("dp_size", dp_size)):
        if size < 1:
            raise ConfigError(name, size, "expected a positive number of ranks")
    if world_size != tp_size * dp_size:
        raise ConfigError("world_size", world_size,
                          f"expected tp_size*dp_size={tp_size * dp_size} "
                          f"(tp_size={tp_size}, dp_size={dp_size})")
    if not 0 <= rank < world_size:
        raise ConfigError("rank", rank, f"expected 0 <= rank < world_size={world_size}")


def _check_timeout(name: str, timeout: datetime.timedelta) -> None:
    if timeout <= datetime.timedelta(0):
        raise ConfigError(name, f"{timeout.total_seconds():g}s", "expected a positive duration")


def _check_existing_group(rank: int, world_size: int) -> None:
    """The engine's default group must be the world this object was told about."""
    actual = (dist.get_rank(), dist.get_world_size())
    if actual != (rank, world_size):
        raise ConfigError("rank, world_size", f"{rank}, {world_size}",
                          f"expected the existing default process group's {actual[0]}, "
                          f"{actual[1]}")


def shard_ranks(tp_size: int, dp_size: int) -> list[list[int]]:
    """The TP group of each DP shard: shard s owns s*tp_size .. s*tp_size + tp_size - 1."""
    return [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(dp_size)]


def dp_ranks(tp_size: int, dp_size: int) -> list[list[int]]:
    """The DP group of each TP rank: the ranks holding that TP rank in every DP shard."""
    return [list(range(t, tp_size * dp_size, tp_size)) for t in range(tp_size)]


class DistributedCollectives:
    """Collectives over ``torch.distributed``, one process per rank.

    TP broadcasts run on the launch device's backend (gloo, nccl or hccl) so device tensors
    never visit the host. The G agreement runs on a separate gloo group over host integers:
    the host owns G, and a device collective plus ``.item()`` would stall the stream.
    Process groups are created for every shard on every rank, in one order, as
    ``new_group`` requires; size-1 groups are skipped on all ranks alike.

    ``timeout`` bounds every collective of a round. ``rendezvous_timeout`` (default:
    ``timeout``) bounds only the wait for all ranks to start, which may include loading
    weights and is often much longer than a round's collectives should ever take. With a
    ``tcp://`` address the ranks meet as the rendezvous module describes, and the wait ends
    early, as a CollectiveError, once ``stopped()`` turns true (a stop during the start).

    On cuda and npu a failed broadcast may only be reported asynchronously by the backend's
    watchdog (which aborts the process), because reporting it here would need a host sync.
    """

    def __init__(self, *, rank: int, world_size: int, tp_size: int, dp_size: int,
                 init_method: str, device: Device, timeout: datetime.timedelta,
                 rendezvous_timeout: datetime.timedelta | None = None,
                 stopped: Callable[[], bool] = lambda: False) -> None:
        _check_layout(rank, world_size, tp_size, dp_size)
        _check_timeout("timeout", timeout)
        if rendezvous_timeout is None:
            rendezvous_timeout = timeout
        _check_timeout("rendezvous_timeout", rendezvous_timeout)
        require_device(device)  # refuses unknown devices; the only path that imports torch_npu
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = timeout  # what a rank waiting for a peer waits at most
        self.tp_rank, self.tp_size = rank % tp_size, tp_size
        self.dp_rank, self.dp_size = rank // tp_size, dp_size
        self.tp_group_ranks = tuple(shard_ranks(tp_size, dp_size)[self.dp_rank])
        self.dp_group_ranks = tuple(dp_ranks(tp_size, dp_size)[self.tp_rank])
        self._closed = False
        self._liveness: Liveness | None = None
        self._groups: list[dist.ProcessGroup] = []
        self.calls: Counter[str] = Counter()
        """Collectives issued, by op: what a round costs in collectives, counted."""
        # An engine that already runs torch.distributed keeps its default group: we join it
        # and, on close, destroy only the groups we created.
        self._owns_default_group = not dist.is_initialized()
        self._store: TCPStore | None = None  # the start's own rendezvous, for tcp://
        self._connecting: Connecting | None = None  # a connection the start left waiting
        try:
            if not self._owns_default_group:
                _check_existing_group(rank, world_size)
                self._make_groups()
            elif init_method.startswith("tcp://"):
                self._meet(init_method, rendezvous_timeout, stopped)
            else:
                with _collective("init_process_group", tuple(range(world_size))):
                    dist.init_process_group(DEVICE_BACKENDS[device], init_method=init_method,
                                            rank=rank, world_size=world_size,
                                            timeout=rendezvous_timeout)
                self._make_groups()
        except BaseException:
            self.close()
            raise

    def _make_groups(self) -> None:
        self._tp_group = self._subgroup(shard_ranks(self.tp_size, self.dp_size), None,
                                        self.timeout)
        # G is compared over every rank, not only across DP shards: a TP rank that decided
        # differently would hang later collectives just the same.
        self._host_group = self._subgroup([list(range(self.world_size))], "gloo",
                                          self.timeout)

    def _meet(self, init_method: str, timeout: datetime.timedelta,
              stopped: Callable[[], bool]) -> None:
        """Meet every rank at the ``tcp://`` address (see rendezvous), beating from arrival
        on, then let the backend connect them over the same store while this thread
        watches the others' heartbeats. A failure here is written down for the others."""
        rank, world_size = self.rank, self.world_size
        group = tuple(range(world_size))
        beat_s = min(1.0, self.timeout.total_seconds() / 8)
        # The store's calls once it answered (the layout, the arrivals) wait for a frozen
        # rank 0 no longer than the heartbeats that follow them would.
        gathering = Gathering(time.monotonic() + timeout.total_seconds(),
                              timeout.total_seconds(), stopped, answer_s=silence_s(beat_s))
        # What every rank must share to create the same groups: a rank given another
        # layout would wait in new_group until the timeout, never reaching the launch check.
        layout = {"--nnodes": world_size, "--dp_size": self.dp_size, "--tp_size": self.tp_size}
        hosting = rank == 0 and not agent_hosts_the_store()
        with _collective("init_process_group", group):
            store = self._store = (host_store(init_method, timeout) if hosting
                                   else join_store(init_method, world_size, gathering))
        host, port = tcp_address(init_method)
        if hosting:  # its own store is on this machine, whatever the name says elsewhere
            host = "127.0.0.1"
        told = store  # the backend's connection holds its client: failures go by another
        connecting = None
        try:
            with _collective("init_process_group", group):
                watcher = told = reached(lambda: client(host, port, timeout), (host, port),
                                         gathering, group)
                if rank == 0:
                    publish_layout(store, layout, gathering)
                liveness = self._liveness = reached(
                    lambda: Liveness(host, port, rank, world_size, beat_s,
                                     connect_timeout=timeout), (host, port), gathering, group)
                arrive(store, rank, layout, gathering)
                await_every_rank(watcher, rank, world_size, liveness.beat_s, gathering)
            connecting = Connecting(self._connect_groups)
            watch(connecting, watcher, rank, world_size, liveness.beat_s, stopped)
            if stopped():  # connected as the start was stopped: leave nothing behind
                raise CollectiveError("init_process_group", group, STOPPED)
        except Exception as error:
            if connecting is not None and connecting.is_alive():
                # Its C++ wait cannot be interrupted: the groups are left to it as they are.
                self._connecting = connecting
            tell_failure(told, rank, error)
            raise

    def _connect_groups(self) -> None:
        """The backend's connections between the ranks, over the start's store."""
        assert self._store is not None
        with _collective("init_process_group", tuple(range(self.world_size))):
            dist.init_process_group(DEVICE_BACKENDS[self.device],
                                    store=backend_store(self._store), rank=self.rank,
                                    world_size=self.world_size, timeout=self.timeout)
        self._make_groups()

    def _subgroup(self, groups: Sequence[Sequence[int]], backend: str | None,
                  timeout: datetime.timedelta) -> dist.ProcessGroup | None:
        """This rank's group among ``groups`` (every rank creates all of them), or None
        when the groups have one rank each and no collective is needed."""
        if len(groups[0]) == 1:
            return None
        mine: dist.ProcessGroup | None = None
        with _collective("new_group", tuple(range(self.world_size)), self._liveness):
            for ranks in groups:
                group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
                if self.rank in ranks:
                    mine = group
                    self._groups.append(group)
        return mine

    def tp_broadcast(self, tensor: Tensor) -> None:
        if self._tp_group is None:
            return
        self.calls["tp_broadcast"] += 1
        with _collective("tp_broadcast", self.tp_group_ranks, self._liveness):
            dist.broadcast(tensor, src=self.tp_group_ranks[0], group=self._tp_group)

    def tp_all_reduce(self, tensor: Tensor) -> None:
        if self._tp_group is None:
            return
        self.calls["tp_all_reduce"] += 1
        with _collective("tp_all_reduce", self.tp_group_ranks, self._liveness):
            dist.all_reduce(tensor, group=self._tp_group)

    def dp_agree_rows(self, num_rows: int) -> int:
        if self._host_group is None:
            return num_rows
        self.calls["dp_agree_rows"] += 1
        mine = torch.tensor([num_rows], dtype=torch.int64)
        chosen = [torch.empty_like(mine) for _ in range(self.world_size)]
        with _collective("dp_agree_rows", tuple(range(self.world_size)), self._liveness):
            dist.all_gather(chosen, mine, group=self._host_group)
        values = tuple(int(value) for value in torch.cat(chosen).tolist())
        if len(set(values)) > 1:
            raise ConsensusMismatch("target graph rows G", values)
        return num_rows

    def share_from_first_rank(self, data: bytes, op: str = "share_from_first_rank") -> bytes:
        if self._host_group is None:
            return data
        self.calls[op] += 1
        box: list[object] = [data if self.rank == 0 else None]
        with _collective(op, tuple(range(self.world_size)), self._liveness):
            dist.broadcast_object_list(box, src=0, group=self._host_group)
        shared = box[0]
        assert isinstance(shared, bytes)
        return shared

    def gather_from_every_rank(self, data: bytes, op: str = "gather_from_every_rank"
                               ) -> list[bytes]:
        if self._host_group is None:
            return [data]
        self.calls[op] += 1
        gathered: list[object] = [None] * self.world_size
        with _collective(op, tuple(range(self.world_size)), self._liveness):
            dist.all_gather_object(gathered, data, group=self._host_group)
        assert all(isinstance(item, bytes) for item in gathered)
        return gathered  # type: ignore[return-value]

    def close(self) -> None:
        """Destroy the process groups this object created: all of them when it created the
        default group, only its own subgroups when it joined an engine's default group."""
        if self._closed:
            return
        self._closed = True
        liveness, self._liveness = self._liveness, None
        if not dist.is_initialized() or self._connecting is not None:
            if liveness is not None:
                liveness.close()
            self._store = None
            return
        with _collective("destroy_process_group", tuple(range(self.world_size))):
            for group in self._groups:  # wakes the ranks still waiting in them
                dist.destroy_process_group(group)
            if liveness is not None:
                liveness.linger()  # the store outlives the survivors' probes
                liveness.close()
            if self._owns_default_group:
                dist.destroy_process_group()
        self._store = None  # rank 0's: the others have read what they needed from it

    def __enter__(self) -> "DistributedCollectives":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_collectives(*, rank: int = 0, world_size: int = 1, tp_size: int = 1, dp_size: int = 1,
                     init_method: str | None = None, device: Device = "cpu",
                     timeout: datetime.timedelta = datetime.timedelta(minutes=10),
                     rendezvous_timeout: datetime.timedelta | None = None) -> Collectives:
    """LocalCollectives for a single rank (no rendezvous needed), else DistributedCollectives."""
    if world_size == 1 and tp_size == 1 and dp_size == 1 and rank == 0:
        return LocalCollectives()
    if init_method is None:
        raise ConfigError("init_method", init_method,
                          f"expected a rendezvous URL (tcp:// or file://) for {world_size} ranks")
    return DistributedCollectives(rank=rank, world_size=world_size, tp_size=tp_size,
                                  dp_size=dp_size, init_method=init_method, device=device,
                                  timeout=timeout, rendezvous_timeout=rendezvous_timeout)

