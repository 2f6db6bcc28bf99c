"""Prometheus metrics of a drafter's global memory (suffix decoding), read from the engine at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cosine.engine.suffix import SuffixIndex


class MemoryCollector(Collector):
    """The size of one drafter's global index against its bound, and what it evicted. Reads a few ints the
    model worker thread updates; a scrape may see one release half-applied, never a torn number."""

    def __init__(self, drafter: str, memory: SuffixIndex):
        self.drafter = drafter
        self.memory = memory

    def collect(self):
        m, labels = self.memory, [self.drafter]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["drafter"])
            g.add_metric(labels, value)
            return g

        yield gauge("cosine_drafter_memory_tokens", "tokens of earlier outputs held in the drafter's global index", m.tokens)
        yield gauge("cosine_drafter_memory_limit_tokens", "the global index's bound, in tokens", m.max_tokens or 0)
        yield gauge("cosine_drafter_memory_sequences", "earlier requests' outputs held in the global index", m.sequences)
        yield gauge("cosine_drafter_memory_index_entries", "n-gram positions the global index holds", m.entries)
        evicted = CounterMetricFamily("cosine_drafter_memory_evicted_tokens", "tokens evicted from the global index (oldest first)",
                                      labels=["drafter"])
        evicted.add_metric(labels, m.evicted_tokens)
        yield evicted
