"""What the routes share: the engine, the settings and the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxkv_serve.config import ServeConfig
from mlxkv_serve.engine import Finished, ServeEngine
from mlxkv_serve.metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    engine: ServeEngine
    config: ServeConfig
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))

    def record(self, done: Finished) -> None:
        self.metrics.prompt_tokens.inc(done.prompt_tokens)
        self.metrics.cached_tokens.inc(done.cached_tokens)
        self.metrics.resumed_tokens.inc(done.resumed_tokens)
        self.metrics.completion_tokens.inc(done.completion_tokens)
        self.metrics.draft_tokens.inc(done.draft_tokens)
        self.metrics.accepted_tokens.inc(done.accepted_tokens)
        self.metrics.ttft.observe(done.ttft_s)
