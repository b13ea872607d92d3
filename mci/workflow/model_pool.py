"""The models of one process or Ray replica, by spec: built on first use, shared by every step
that names the same model (so a model is loaded once)."""

from __future__ import annotations

from collections.abc import Iterable

from mci.tracing import Tracing
from mci.workflow.engine_model import EngineModel
from mci.workflow.models import ModelClient, ModelSpec
from mci.workflow.server_model import ServerModel


class ModelPool:
    def __init__(self, tracing: Tracing):
        self.tracing = tracing
        self._clients: dict[ModelSpec, ModelClient] = {}

    def client(self, spec: ModelSpec) -> ModelClient:
        if spec not in self._clients:
            kind = ServerModel if spec.url else EngineModel
            self._clients[spec] = kind(spec, self.tracing)
        return self._clients[spec]

    def load(self, specs: Iterable[ModelSpec]) -> None:
        """Build the in-process engines of `specs` now (blocking: a served workflow is ready,
        and a Ray replica takes calls, once they are)."""
        for spec in specs:
            client = self.client(spec)
            if isinstance(client, EngineModel):
                client.engine()

    def engines(self) -> list:
        """The in-process engines built so far (for their stats: KV in use)."""
        clients = self._clients.values()
        return [c.loaded for c in clients if isinstance(c, EngineModel) and c.loaded]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
