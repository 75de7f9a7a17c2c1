"""``tk serve``'s Prometheus metrics (``GET /metrics``): each replica's own registry, and the texts of
every replica summed into one answer.

Each replica counts in a registry of its own, labelled with the model and the replica; the replica
that answers ``/metrics`` reads every replica's latest text from the statistics board
(``tk.serve.stats``) and sums them (``merge_metrics``), so a scrape sees the model, not one replica.
``prometheus_client`` is imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

from collections.abc import Iterable


class Metrics:
    """The Prometheus metrics of one replica (its own registry, labelled with the replica)."""

    def __init__(self, model: str, replica: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        labels = {"model": model, "replica": replica}
        names = list(labels)
        self.requests = Counter(
            "tk_requests", "Inference requests answered, by HTTP status code", [*names, "code"], registry=self.registry
        )
        self.errors = Counter(
            "tk_errors", "Inference requests answered with an error", [*names, "code"], registry=self.registry
        )
        buckets_batch = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        self.batch = Histogram(
            "tk_batch_samples", "Samples per engine call", names, buckets=buckets_batch, registry=self.registry
        ).labels(**labels)
        self.batch_requests = Histogram(
            "tk_batch_requests", "Requests per batch", names, buckets=buckets_batch, registry=self.registry
        ).labels(**labels)
        seconds = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
        self.queue = Histogram(
            "tk_queue_seconds",
            "Time a request waited for its batch to start",
            names,
            buckets=seconds,
            registry=self.registry,
        ).labels(**labels)
        self.compute = Histogram(
            "tk_compute_seconds", "Engine time per call", names, buckets=seconds, registry=self.registry
        ).labels(**labels)
        self._labels = labels

    def answered(self, code: int) -> None:
        self.requests.labels(**self._labels, code=str(code)).inc()
        if code >= 400:
            self.errors.labels(**self._labels, code=str(code)).inc()

    def text(self) -> tuple[bytes, str]:
        """This replica's metrics as Prometheus text, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class GenerationMetrics:
    """A decoder's metrics besides every model's (in the same registry): tokens, time to first token, rows
    per decode step, engine time per kind of call."""

    def __init__(self, metrics: Metrics) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        labels, names, registry = metrics._labels, list(metrics._labels), metrics.registry
        self.tokens = Counter("tk_generated_tokens", "Tokens generated", names, registry=registry).labels(**labels)
        self.cancelled = Counter(
            "tk_cancelled_sequences", "Sequences that left the batch early: their client went away, or a stop string", names,
            registry=registry,
        ).labels(**labels)  # fmt: skip
        self.active = Gauge(
            "tk_active_sequences", "Sequences in the decode batch or waiting to join it", names, registry=registry
        ).labels(**labels)
        seconds = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
        self.ttft = Histogram(
            "tk_time_to_first_token_seconds", "From a request's arrival to its first token", names,
            buckets=seconds, registry=registry,
        ).labels(**labels)  # fmt: skip
        self.rows = Histogram(
            "tk_decode_rows", "Sequences per decode step (continuous batching)", names,
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry,
        ).labels(**labels)  # fmt: skip
        self.calls = Histogram(
            "tk_generation_call_seconds", "Engine time per call, by kind (prefill, decode)", [*names, "kind"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=registry,
        )  # fmt: skip
        self._labels = labels

    def called(self, kind: str, rows: int, seconds: float, active: int) -> None:
        self.active.set(active)
        self.calls.labels(**self._labels, kind=kind).observe(seconds)
        if kind == "decode":
            self.rows.observe(rows)

    def left(self, rows: int, active: int) -> None:
        self.cancelled.inc(rows)
        self.active.set(active)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def generated(self, tokens: int) -> None:
        self.tokens.inc(tokens)


def merge_metrics(texts: Iterable[bytes]) -> bytes:
    """Replicas' Prometheus texts as one: samples of equal name and labels (the ``replica`` label
    dropped) summed, counters' ``_created`` samples left out."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            into = values.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "replica"))
                into[(sample.name, labels)] = into.get((sample.name, labels), 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)

    class Merged:
        def collect(self) -> Iterable[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)
