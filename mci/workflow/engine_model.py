"""A model run in this process: an `mci.Engine` (built on first use, on its own loop thread)."""

from __future__ import annotations

import threading
from contextlib import aclosing
from pathlib import Path

from mci.tracing import Tracing
from mci.workflow.errors import WorkflowError
from mci.workflow.models import Delta, ModelClient, ModelSpec

# the KV pool unless the model's settings size it: several engines may share a process
DEFAULT_WORKFLOW_KV_TOKENS = 65_536


class EngineModel(ModelClient):
    """An in-process engine. The request's deadline is the engine's own timeout for it: the
    engine aborts it at the deadline and frees its KV; a consumer that stops aborts it too."""

    def __init__(self, spec: ModelSpec, tracing: Tracing):
        super().__init__(spec, tracing)
        self._engine = None
        self._lock = threading.Lock()

    @property
    def loaded(self):
        """The engine if it has been built, else None."""
        return self._engine

    def engine(self):
        """The engine, built once (thread-safe: steps may first call it concurrently)."""
        with self._lock:
            if self._engine is None:
                from mci.engine.config import engine_config_from_fields
                from mci.engine.engine import Engine

                flags = dict(self.spec.engine_flags)
                if self.spec.path is not None:
                    flags["model_path"] = Path(self.spec.path)
                if not {"max_total_tokens", "kv_cache_gb"} & set(flags):
                    flags["max_total_tokens"] = DEFAULT_WORKFLOW_KV_TOKENS
                self._engine = Engine(engine_config_from_fields(flags))
            return self._engine

    async def _deltas(self, prompt, sampling, call, step, span):
        import asyncio

        from mci.core.outputs import REQUEST_TIMEOUT
        from mci.core.sampling_params import SamplingParams
        from mci.errors import UserError

        engine = self._engine or await asyncio.to_thread(self.engine)
        try:
            params = SamplingParams(
                max_new_tokens=sampling.get("max_tokens", 64),
                temperature=sampling.get("temperature", 0.0),
                top_p=sampling.get("top_p", 1.0),
                stop=tuple(sampling.get("stop") or ()),
                seed=sampling.get("seed"),
                ignore_eos=sampling.get("ignore_eos", False),
            )
            outputs = engine.stream(prompt, params, timeout_s=call.remaining_s())
            async with aclosing(outputs):
                async for out in outputs:
                    if out.error == REQUEST_TIMEOUT:
                        raise WorkflowError(
                            "deadline_exceeded", step, f"{self.name} passed the deadline"
                        )
                    if out.error:
                        raise WorkflowError("model_error", step, f"{self.name}: {out.error}")
                    yield Delta(
                        out.delta_text,
                        out.finish_reason if out.finished else None,
                        out.num_prompt_tokens or None,
                        len(out.output_token_ids),
                    )
        except UserError as exc:  # the prompt or a parameter is wrong: retrying cannot help
            message = f"{self.name}: {exc}"
            raise WorkflowError("model_error", step, message, retryable=False) from None
        except RuntimeError as exc:  # the engine has shut down
            raise WorkflowError("model_error", step, f"{self.name}: {exc}") from None

    async def close(self) -> None:
        import asyncio

        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
