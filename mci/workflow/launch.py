"""`mci workflow run | serve | deploy FILE:ENTRY` (docs/workflows.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from mci.errors import UserError
from mci.tracing import Tracing
from mci.workflow.config import WorkflowConfig
from mci.workflow.errors import WorkflowError
from mci.workflow.local import LocalWorkflow
from mci.workflow.steps import load_entry

log = logging.getLogger("mci")
EXIT_FAILED = 1


def run_once(target: str, input_json: str, config: WorkflowConfig) -> int:
    """Run the workflow once in this process; print its output as JSON (a streaming entry:
    one JSON line per item, as each comes). A failure prints one line and exits 1 (2 for
    input that does not match the entry's type)."""
    try:
        value = json.loads(input_json)
    except json.JSONDecodeError as exc:
        raise UserError(f"--input is not JSON: {exc}") from None
    entry = load_entry(target)
    logging.getLogger("mci").setLevel(logging.WARNING)  # engines' start-up logs are a server's

    async def main() -> int:
        tracing = Tracing(config.otlp_traces_endpoint, "mci-workflow")
        workflow = LocalWorkflow(entry, tracing)
        try:
            await workflow.start()
            if workflow.entry.spec.streaming:
                async for item in workflow.entry.stream(value, config.default_timeout):
                    print(item.model_dump_json(), flush=True)
            else:
                out = await workflow.entry.call(value, config.default_timeout)
                print(out.model_dump_json(), flush=True)
            return 0
        except WorkflowError as err:
            if err.kind == "invalid_input":
                raise UserError(str(err)) from None
            print(f"mci: workflow failed: {err} ({err.kind})", file=sys.stderr)
            return EXIT_FAILED
        finally:
            await workflow.close()
            tracing.shutdown()

    return asyncio.run(main())


def serve(target: str, config: WorkflowConfig) -> int:
    """Serve the workflow over HTTP in this process (every step local) until SIGTERM/SIGINT."""
    import uvicorn

    from mci.workflow.http_app import build_app

    entry = load_entry(target)

    async def main() -> None:
        tracing = Tracing(config.otlp_traces_endpoint, "mci-workflow")
        workflow = LocalWorkflow(entry, tracing)
        started = asyncio.Event()
        app = build_app(workflow.entry, config.default_timeout, ready=started.is_set)
        server = uvicorn.Server(
            uvicorn.Config(app, host=config.host, port=config.port, log_level="warning")
        )
        try:
            serving = asyncio.ensure_future(server.serve())
            await workflow.start()
            started.set()
            log.info(
                "workflow %s on http://%s:%d (POST /run)", entry.__name__, config.host, config.port
            )
            await serving
        finally:
            await workflow.close()
            tracing.shutdown()

    asyncio.run(main())
    return 0
