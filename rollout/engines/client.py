"""Async HTTP client for engines (or the router in front of them) speaking SGLang's native API.

One client per base URL; it keeps a connection pool, so create it once and `aclose()` it (or use
`async with`). Works against the torch engine server, a real SGLang server and the sglang-router
(which forwards /generate but has no /abort_request: abort each worker's URL directly).
"""
from __future__ import annotations

from typing import Any

import httpx

from rollout.engines.protocol import (GenerateResponse, LoadsResponse, ModelInfo, UpdateWeightsResponse,
                                      new_rid)


class EngineError(RuntimeError):
    """An engine answered with an HTTP error; `status` and the engine's message are kept."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", body))
        return str(body.get("message", body))
    return str(body)


class EngineClient:
    def __init__(self, url: str, timeout_s: float | None = None, max_connections: int = 1024):
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> httpx.Response:
        kwargs = {} if timeout is None else {"timeout": timeout}
        resp = await self._http.request(method, path, json=json, **kwargs)
        if resp.status_code >= 400:
            raise EngineError(self.url + path, resp.status_code, _error_message(resp))
        return resp

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None,
                       rid: str | None = None, return_logprob: bool = True) -> GenerateResponse:
        """One /generate call; rid defaults to a fresh fixed-length hex id."""
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                "return_logprob": return_logprob, "rid": rid or new_rid()}
        resp = await self._request("POST", "/generate", json=body)
        return GenerateResponse.model_validate(resp.json())

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort requests whose id starts with rid, or all of them (this URL must be an engine)."""
        if not rid and not abort_all:
            raise ValueError("abort needs a rid or abort_all=True")
        await self._request("POST", "/abort_request", json={"rid": rid or "", "abort_all": abort_all})

    async def loads(self) -> LoadsResponse:
        return LoadsResponse.model_validate((await self._request("GET", "/v1/loads")).json())

    async def health(self, generate: bool = False, timeout_s: float = 5.0) -> bool:
        """True when /health (or /health_generate) answers 200 within timeout_s."""
        try:
            resp = await self._http.get("/health_generate" if generate else "/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def model_info(self) -> ModelInfo:
        return ModelInfo.model_validate((await self._request("GET", "/model_info")).json())

    async def weight_version(self) -> int | str | None:
        return (await self.model_info()).weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                       abort_all_requests: bool = False) -> UpdateWeightsResponse:
        body = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        resp = await self._request("POST", "/update_weights_from_disk", json=body)
        return UpdateWeightsResponse.model_validate(resp.json())

    async def post(self, path: str, json: Any = None, timeout: float | None = None) -> httpx.Response:
        """Any other endpoint (flush_cache, pause_generation, release_memory_occupation, ...)."""
        return await self._request("POST", path, json=json, timeout=timeout)

    async def get(self, path: str, timeout: float | None = None) -> httpx.Response:
        return await self._request("GET", path, timeout=timeout)
