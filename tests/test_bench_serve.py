"""`mci bench serve` against a live server of the bundled model (the README's `make run`)."""

from __future__ import annotations

import json
import subprocess
import sys

from server_helpers import LiveServer


def test_bench_serve_reports_and_plots(tmp_path):
    with LiveServer(None, "--max-total-tokens", "8192") as s:  # `mci serve` with no model flag
        out, png = tmp_path / "r.json", tmp_path / "r.png"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "mci",
                "bench",
                "serve",
                "--base-url",
                s.url,
                "--num-prompts",
                "8",
                "--input-len",
                "16",
                "--output-len",
                "8",
                "--request-rate",
                "20",
                "--ignore-eos",
                "--slo-ttft-ms",
                "60000",
                "--slo-tpot-ms",
                "60000",
                "--output-json",
                str(out),
                "--plot",
                str(png),
                "--disable-tqdm",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "TTFT (ms)" in result.stdout and "goodput" in result.stdout
        report = json.loads(out.read_text())
        assert report["completed"] == 8 and report["failed"] == 0
        assert report["output_tokens"] == 64 and report["goodput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(report[key]) == {"mean", "p50", "p90", "p99"}
        assert png.stat().st_size > 10_000


def test_bench_serve_unreachable_server_is_one_line_error():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mci",
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--num-prompts",
            "1",
            "--disable-tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stderr.strip().startswith("mci: error:")


def test_sse_reader_takes_long_lines_split_anywhere():
    """The client's event reader against a real aiohttp server on loopback: a 300 kB event
    line (a chunk with many logprobs, say), CRLF line ends, and writes that split lines
    mid-way all come through, up to `[DONE]` and nothing after it."""
    import asyncio

    from aiohttp import ClientSession, web

    from mci.bench.serve import _sse_data

    long_text = "x" * 300_000
    events = [json.dumps({"n": 1}), json.dumps({"text": long_text}), json.dumps({"n": 3})]
    wire = "".join(f"data: {e}\r\n\r\n" for e in events).encode() + b"data: [DONE]\n\ndata: 4\n\n"

    async def stream(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(wire), 7919):  # pieces that end inside lines
            await response.write(wire[start : start + 7919])
        return response

    async def main():
        app = web.Application()
        app.router.add_get("/", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as r:
                return [data async for data in _sse_data(r)]
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == events


def test_sse_reader_joins_pieces_split_in_a_character_or_a_crlf():
    """Pieces chosen to end inside a UTF-8 character and between CR and LF (a server's writes
    and TCP may cut anywhere): each event arrives whole and decoded."""
    import asyncio

    from mci.bench.serve import _sse_data

    events = [json.dumps({"text": "héllo ☃"}, ensure_ascii=False), json.dumps({"n": 2})]
    wire = "".join(f"data: {e}\r\n\r\n" for e in events).encode() + b"data: [DONE]\n\n"
    snowman = wire.index("☃".encode()) + 1  # inside the three bytes of U+2603
    crlf = wire.index(b"\r\n") + 1  # between the first CR and its LF
    cuts = sorted({crlf, snowman, len(wire) - 3})
    pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]

    class Body:  # what `_sse_data` reads of an aiohttp response: its content's pieces
        async def iter_any(self):
            for piece in pieces:
                yield piece

    class Response:
        content = Body()

    async def read():
        return [data async for data in _sse_data(Response())]

    assert asyncio.run(read()) == events
