"""The server's Prometheus metrics, in the text format of the standard client library.

The runtime's own counts are read from ``Runtime.statistics()`` when ``/metrics`` is scraped,
so the two always agree; what only the server sees (latencies, finish reasons as the client
got them, requests waiting) and the per-round choices (G, depth) are counted as they happen.
"""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from adaspec.runtime.engine import Runtime
from adaspec.runtime.events.types import Event, RoundRetired, ShardRetired

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256,
                  0.512, 1.0)

# Runtime counters (``Counters`` fields) exposed as ``adaspec_<name>_total``.
_RUNTIME_COUNTERS = {
    "rounds_submitted": "decode rounds enqueued",
    "rounds_retired": "decode rounds whose feedback reached the host",
    "rounds_failed": "decode rounds that failed",
    "requests_finished": "requests the runtime ended (stop, length or cancelled)",
    "requests_failed": "requests the runtime failed",
    "tokens_generated": "tokens committed",
    "drafted_verified": "drafted tokens the target verified",
    "drafted_accepted": "drafted tokens accepted",
    "request_rounds": "request-rounds (each round counts each request it advanced)",
    "rows_verified": "padded target rows G summed over retired rounds",
}


class RuntimeCollector(Collector):
    """Reads the runtime's statistics at each scrape."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        try:
            stats = self._runtime.statistics()
        except RuntimeError:  # not started yet: nothing counted
            return
        for name, about in _RUNTIME_COUNTERS.items():
            yield CounterMetricFamily(f"adaspec_{name}", about, value=getattr(stats, name))
        verified = CounterMetricFamily(
            "adaspec_position_verified", "request-rounds that verified drafted position k",
            labels=["position"])
        accepted = CounterMetricFamily(
            "adaspec_position_accepted", "request-rounds whose drafts 1..k were all accepted",
            labels=["position"])
        for position, (checked, taken) in sorted(position_counts(stats.outcomes).items()):
            verified.add_metric([str(position)], checked)
            accepted.add_metric([str(position)], taken)
        yield verified
        yield accepted
        yield GaugeMetricFamily("adaspec_acceptance_length",
                                "mean acceptance length per request and round (accepted + 1: "
                                "it counts the residual or bonus token)",
                                value=stats.mean_acceptance_length)


def position_counts(outcomes: "dict[tuple[int, int], int]") -> dict[int, tuple[int, int]]:
    """Per drafted position k: request-rounds that verified k, and those that accepted
    drafts 1..k, from the (verify length, accepted) -> request-rounds counts."""
    width = max((length for length, _ in outcomes), default=0)
    return {k: (sum(n for (length, _), n in outcomes.items() if length >= k),
                sum(n for (_, taken), n in outcomes.items() if taken >= k))
            for k in range(1, width + 1)}


class ServerMetrics:
    def __init__(self, runtime: Runtime) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(RuntimeCollector(runtime))
        r = self.registry
        self.rounds_by_rows = Counter("adaspec_rounds_by_rows", "retired rounds by the padded "
                                      "target rows G they verified", ["rows"], registry=r)
        self.rounds_by_depth = Counter("adaspec_rounds_by_depth", "retired rounds by the "
                                       "draft steps d they ran", ["depth"], registry=r)
        self.http_requests = Counter("adaspec_http_requests", "completion requests answered, "
                                     "by HTTP status", ["status"], registry=r)
        self.finished = Counter("adaspec_completions_finished", "completions by the finish "
                                "reason their client got (stop, length, cancelled, error)",
                                ["reason"], registry=r)
        self.waiting = Gauge("adaspec_requests_waiting", "requests queued that have no token "
                             "yet", registry=r)
        self.running = Gauge("adaspec_requests_running", "requests with tokens that have not "
                             "ended", registry=r)
        self.ttft = Histogram("adaspec_time_to_first_token_seconds", "from arrival to the "
                              "first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("adaspec_time_per_output_token_seconds", "mean time per output "
                              "token after the first, per request", buckets=_TOKEN_BUCKETS,
                              registry=r)
        self.e2e = Histogram("adaspec_e2e_request_latency_seconds", "from arrival to the last "
                             "token", buckets=_LATENCY_BUCKETS, registry=r)

    def observe(self, event: Event) -> None:
        """A runtime event subscriber: counts each retired round's G and depth."""
        if isinstance(event, RoundRetired | ShardRetired):
            self.rounds_by_rows.labels(str(event.feedback.num_rows)).inc()
            self.rounds_by_depth.labels(str(event.feedback.depth)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
