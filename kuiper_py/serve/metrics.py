"""The server's Prometheus metrics (prometheus-client; names in the manner of vLLM's vllm:* set)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5,
                 1.0, 2.5)


class Metrics:
    """One registry per server (not the process-wide default), so tests can build several apps."""
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kuiper_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kuiper_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kuiper_prompt_tokens_cached",
                                     "Prompt tokens the KV cache already held (not prefilled again)", registry=r)
        # as vLLM's prefix_cache_queries / prefix_cache_hits: counted when a prompt is looked up, hits / queries
        # is the share of looked-up prompt tokens whose KV was reused
        self.prefix_cache_queries = Counter(
            "kuiper_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (each prompt's tokens before "
            "its last; with batching, the whole KV blocks of them)", registry=r)
        self.prefix_cache_hits = Counter("kuiper_prefix_cache_hits",
                                         "Looked-up prompt tokens found in the prefix cache (their KV reused, not "
                                         "computed)", registry=r)
        self.generation_tokens = Counter("kuiper_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("kuiper_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kuiper_time_per_output_token_seconds", "Between consecutive generated tokens",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("kuiper_e2e_request_latency_seconds", "From a request's arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("kuiper_num_requests_waiting", "Requests queued for the engine", registry=r)
        self.running = Gauge("kuiper_num_requests_running", "Requests the engine is generating", registry=r)
        self.cancelled = Counter("kuiper_requests_cancelled", "Generations cut short by a client that left",
                                 registry=r)
        # speculative decoding (--draft, --lookup), as vLLM's spec_decode counters
        self.spec_drafts = Counter("kuiper_spec_decode_num_drafts", "Verify steps of speculative decoding",
                                   registry=r)
        self.spec_draft_tokens = Counter("kuiper_spec_decode_num_draft_tokens", "Tokens proposed (guessed)",
                                         registry=r)
        self.spec_accepted_tokens = Counter("kuiper_spec_decode_num_accepted_tokens",
                                            "Proposed tokens the model accepted", registry=r)
        self.spec_fallbacks = Counter("kuiper_spec_decode_plain_requests",
                                      "Requests decoded plainly on a speculative server (they asked for logprobs)",
                                      registry=r)

    def count_speculative(self, stats) -> None:
        """A finished request's speculative.Stats added to the counters."""
        self.spec_drafts.inc(stats.steps)
        self.spec_draft_tokens.inc(stats.proposed)
        self.spec_accepted_tokens.inc(stats.accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
