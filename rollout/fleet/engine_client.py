"""Async HTTP client for engines (or the router in front of them) speaking SGLang's native API.

Built on aiohttp, not httpx: at 64 requests in flight httpx's AsyncClient spent ~8 ms of CPU per
/generate call here against ~0.4 ms for aiohttp, which on two shared cores is more than the engine's
own cost per request. The session is created lazily on first use and belongs to that event loop:
make one client per loop and `aclose()` it (or use `async with`). Works against the torch engine
server, a real SGLang server and the sglang-router (which forwards /generate but has no
/abort_request: abort each worker's URL directly).

Bodies are rollout/sglang/protocol.py's models, dumped; answers are parsed once, from the raw bytes, into theirs.

Errors: an HTTP error status raises EngineError (status, message); no answer (refused, reset, timed out) raises
EngineUnreachable (EngineTimeout when the time limit ran out), whatever the transport underneath.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
from pydantic import BaseModel

from ..sglang import backend as sgl
from ..sglang.protocol import (AbortRequest, GenerateRequest, GenerateResponse, LoadsResponse, ModelInfo,
                               UpdateWeightsFromDiskRequest, UpdateWeightsResponse)

M = TypeVar("M", bound=BaseModel)

JSON_HEADERS = {"Content-Type": "application/json"}
CONTROL_PATHS = frozenset(sgl.ENDPOINTS[route] for route in sgl.CONTROL_ROUTES)
MEMORY_PATHS = frozenset(sgl.ENDPOINTS[route] for route in sgl.MEMORY_ROUTES)


def post_timeout_s(path: str, timeout: float | None) -> float | None:
    """A post's time limit: the caller's, else sgl.CONTROL_TIMEOUT_S on the control routes (pause/continue generation,
    begin/end weight update, flush_cache: a live engine answers them within seconds), sgl.MEMORY_TIMEOUT_S on the
    memory release and resume routes, else the client's own."""
    if timeout is None and path in CONTROL_PATHS:
        return sgl.CONTROL_TIMEOUT_S
    if timeout is None and path in MEMORY_PATHS:
        return sgl.MEMORY_TIMEOUT_S
    return timeout


class EngineError(RuntimeError):
    """An engine answered with an HTTP error; `status` and the engine's message are kept."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message


class EngineUnreachable(ConnectionError):
    """No answer from an engine: the connection was refused or reset, or no answer came in time (EngineTimeout)."""


class EngineTimeout(EngineUnreachable, TimeoutError):
    """No answer within the call's time limit."""


def _error_message(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode(errors="replace")
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", body))
        if isinstance(err, str):  # SGLang's /generate gate: {"error": "unknown field `x`, expected one of ..."}
            return err
        return str(body.get("message", body))
    return str(body)


@dataclass(frozen=True)
class RawResponse:
    """The answer of `post` / `get`: status and body, read like an httpx.Response."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class EngineClient:
    def __init__(self, url: str, timeout_s: float | None = None, max_connections: int = 1024):
        self.url = url.rstrip("/")
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=10.0))
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> tuple[int, bytes]:
        kwargs: dict[str, Any] = {}
        if json is not None:
            kwargs.update(data=orjson.dumps(json), headers=JSON_HEADERS)
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        url = self.url + path
        try:
            async with self._http().request(method, url, **kwargs) as resp:
                raw = await resp.read()
                status = resp.status
        except aiohttp.ClientConnectorError as err:
            raise EngineUnreachable(f"{url}: {err}") from err
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as err:
            limit = timeout if timeout is not None else self.timeout_s
            raise EngineTimeout(f"{method} {url}: no answer within {limit} s") from err
        except aiohttp.ClientError as err:
            raise EngineUnreachable(f"{url}: {err}") from err
        if status >= 400:
            raise EngineError(url, status, _error_message(raw))
        return status, raw

    async def _answer(self, model: type[M], method: str, path: str, body: Any = None) -> M:
        return model.model_validate_json((await self._request(method, path, body))[1])

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """One /generate call (the request needs its rid: abort matches by it)."""
        return await self._answer(GenerateResponse, "POST", "/generate", request.body())

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort requests whose id starts with rid, or all of them (this URL must be an engine)."""
        if not rid and not abort_all:
            raise ValueError("abort needs a rid or abort_all=True")
        await self._request("POST", "/abort_request", AbortRequest(rid=rid or "", abort_all=abort_all).model_dump())

    async def loads(self) -> LoadsResponse:
        return await self._answer(LoadsResponse, "GET", "/v1/loads")

    async def health(self, generate: bool = False, timeout_s: float = 5.0) -> bool:
        """True when /health (or /health_generate) answers 200 within timeout_s."""
        try:
            await self._request("GET", "/health_generate" if generate else "/health", timeout=timeout_s)
        except (EngineUnreachable, EngineError):
            return False
        return True

    async def model_info(self) -> ModelInfo:
        return await self._answer(ModelInfo, "GET", "/model_info")

    async def weight_version(self) -> int | str | None:
        return (await self.model_info()).weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                       abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> UpdateWeightsResponse:
        body = UpdateWeightsFromDiskRequest(model_path=model_path, weight_version=weight_version,
                                            abort_all_requests=abort_all_requests, flush_cache=flush_cache)
        return await self._answer(UpdateWeightsResponse, "POST", "/update_weights_from_disk", body.model_dump())

    async def post(self, path: str, json: Any = None, timeout: float | None = None) -> RawResponse:
        """Any other endpoint (flush_cache, pause_generation, release_memory_occupation, ...); timeout None: see
        post_timeout_s."""
        return RawResponse(*await self._request("POST", path, json, post_timeout_s(path, timeout)))

    async def get(self, path: str, timeout: float | None = None) -> RawResponse:
        return RawResponse(*await self._request("GET", path, timeout=timeout))
