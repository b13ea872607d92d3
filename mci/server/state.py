"""What the HTTP handlers share: the engine's supervisor, the request front, limits, metrics,
tracing, the drain flag. One per server; built by `mci serve` (launch.py) and handed to
`build_app`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from mci.disaggregation.config import DisaggregationConfig
from mci.engine.request_front import RequestFront
from mci.grammar.cache import xgrammar_cache
from mci.model_config import ModelConfig
from mci.process_memory import MemoryGauge
from mci.server.config import ServerConfig
from mci.server.engine_supervisor import EngineSupervisor
from mci.server.metrics import ServerMetrics
from mci.server.reasoning import END as THINK_END
from mci.server.tool_formats import DeepSeekV3Markup, JsonEnvelope, tool_format_for
from mci.tenancy.quotas import TenantQuotas
from mci.tenancy.tenants import TenantTable
from mci.tokenizer import TextTokenizer
from mci.tracing import Tracing

log = logging.getLogger("mci")


@dataclass
class ServerState:
    """The server's shared state; `draining` turns true on SIGTERM and never back."""

    engine: EngineSupervisor
    tokenizer: TextTokenizer
    model_config: ModelConfig
    config: ServerConfig
    model_name: str
    max_running: int
    metrics: ServerMetrics = field(init=False)
    front: RequestFront = field(init=False)
    tool_format: JsonEnvelope | DeepSeekV3Markup = field(init=False)
    think_end_id: int | None = field(init=False)  # `</think>`, if an added (whole) token
    tracing: Tracing = field(init=False)  # --otlp-traces-endpoint (a no-op tracer without)
    tenants: TenantTable = field(init=False)  # --tenants FILE, or the one tenant of --api-key
    quotas: TenantQuotas = field(default_factory=TenantQuotas)
    draining: bool = False
    hicache_store: str | None = None  # the id of the shared KV store (mci/cache/tiers.py)
    # prefill-decode disaggregation: this worker's role (the engine's section)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    memory_gauge: MemoryGauge = field(default_factory=MemoryGauge)

    def __post_init__(self):
        self.metrics = ServerMetrics(
            lambda: self.engine.stats,
            lambda: self.engine.restarts,
            lambda: self.engine.hangs,
            self.memory,
        )
        cfg = self.model_config
        grammar = xgrammar_cache(self.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))
        self.front = RequestFront(self.tokenizer, cfg.vocab_size, self.context_length, grammar)
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        self.tool_format = tool_format_for(vocab, self.config.tool_call_parser)
        added = self.tokenizer.backend.get_added_tokens_decoder().items()
        self.think_end_id = next((i for i, t in added if t.content == THINK_END), None)
        self.tracing = Tracing(self.config.otlp_traces_endpoint, "mci-serve")
        if self.config.tenants:
            self.tenants = TenantTable.load(Path(self.config.tenants))
        else:
            self.tenants = TenantTable.single(self.config.api_key)

    def reload_tenants(self) -> None:
        """SIGHUP: read the tenants file again. Requests in flight keep the tenant they were
        admitted as; a broken file keeps the old table (one log line, no keys in it)."""
        if not self.config.tenants:
            return
        try:
            self.tenants = TenantTable.load(Path(self.config.tenants))
        except Exception as exc:  # noqa: BLE001 - any problem with the file keeps the old
            log.error("tenants file not reloaded, the old one stays: %s", exc)
            return
        log.info("tenants file reloaded: %d tenants", len(self.tenants.tenants))

    def memory(self) -> dict:
        """The front end's RSS and heap, and its caches (the grammar cache of its 400s)."""
        grammars = self.front.grammar.size() if self.front.grammar is not None else None
        caches = {} if grammars is None else {"grammars": grammars}
        return {**self.memory_gauge.snapshot(), "caches": caches}

    @property
    def context_length(self) -> int:
        return self.config.context_length or self.model_config.max_position_embeddings
