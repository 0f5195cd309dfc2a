"""``specmesh serve gateway``: the OpenAI-compatible app under uvicorn, drained gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from gateway_svc.app import create_app
from gateway_svc.config import GatewayConfig, parse_args


async def run(config: GatewayConfig) -> None:
    host, _, port = config.address.rpartition(":")
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=host.strip("[]"),
            port=int(port),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(config.grace_s),  # SIGTERM: stop accepting, let streams finish
            timeout_keep_alive=30,
            ssl_certfile=config.tls_cert or None,
            ssl_keyfile=config.tls_key or None,
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()
        scheme = "https" if config.tls_cert else "http"
        print(f"gateway on {scheme}://{bound[0]}:{bound[1]}/v1 (verifier {config.verifier})", flush=True)
    await task


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
