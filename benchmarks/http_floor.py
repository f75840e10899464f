"""The HTTP floor for big bodies: the same server stack as slotserve (Litestar on uvicorn, uvloop +
httptools) doing nothing but move bytes, so a benchmark can print what moving a slot state's bytes
over HTTP costs on this machine with its client, apart from anything slotserve does.

``GET /blob/{n}`` answers ``n`` bytes (made once, kept); ``POST /sink`` reads the body with Litestar's
``Request.body()`` and answers its length.  Run: ``python benchmarks/http_floor.py --port N``.
"""

from __future__ import annotations

import argparse
import os

import uvicorn
from litestar import Litestar, Request, Response, get, post

_BLOBS: dict[int, bytes] = {}


@get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/blob/{n:int}")
async def blob(n: int) -> Response[bytes]:
    if n not in _BLOBS:
        _BLOBS.clear()
        _BLOBS[n] = os.urandom(n)
    return Response(_BLOBS[n], media_type="application/octet-stream")


@post("/sink", status_code=200)
async def sink(request: Request) -> dict[str, int]:
    return {"n": len(await request.body())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    app = Litestar([health, blob, sink], request_max_body_size=None)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop", http="httptools")


if __name__ == "__main__":
    main()
