"""Storage error classification, redaction of credentials, and retry with backoff under a deadline
(tenacity, with this module's classification of which errors are transient).

Kept apart from infra/storage/store.py so the policy (what is transient, what is secret) reads in one place.
"""
from __future__ import annotations

import errno
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

import tenacity

log = logging.getLogger("spillover.storage")
T = TypeVar("T")

# s3fs maps S3 error codes to OSError errnos (500 -> EREMOTEIO, 503/SlowDown -> EBUSY).
_TRANSIENT_ERRNOS = {errno.EREMOTEIO, errno.EBUSY, errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED,
                     errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN}
_TRANSIENT_S3_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed",
                       "500", "502", "503", "504",
                       # the server got a body other than the one sent (cut or damaged on the way): send it again
                       "BadDigest", "IncompleteBody", "XAmzContentSHA256Mismatch"}
_TRANSIENT_TYPE_NAMES = {  # by name, so botocore/aiohttp stay optional imports here
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ResponseStreamingError", "IncompleteReadError", "ResponseParserError", "ProxyConnectionError",
    "ClientConnectorError", "ClientPayloadError", "ServerDisconnectedError", "ClientOSError",
    "ServerTimeoutError", "FSTimeoutError", "IncompleteRead",
}
_AUTH_S3_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken",
                  "AuthorizationHeaderMalformed", "InvalidSecurity"}


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL (never credentials) and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the object."""


class StorageUnreachable(StorageError):
    """The storage endpoint did not answer (or kept failing transiently) until the deadline."""


class StorageAuthError(StorageError):
    """The storage rejected the credentials."""


class ObjectMissing(StorageError):
    """The object (or bucket, or directory) does not exist."""


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _s3_code_and_status(exc: BaseException) -> tuple[str | None, int | None]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code, status


def is_auth_error(exc: BaseException) -> bool:
    for e in _chain(exc):
        code, status = _s3_code_and_status(e)
        if code in _AUTH_S3_CODES or status == 403 or type(e).__name__ in ("NoCredentialsError",
                                                                           "PartialCredentialsError"):
            return True
    return any(isinstance(e, PermissionError) for e in _chain(exc))


def is_transient(exc: BaseException) -> bool:
    """Connection refused/reset, timeouts, 5xx and throttling are transient; auth, missing keys and bad
    arguments are not."""
    if is_auth_error(exc):
        return False
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)):
            return False
        code, status = _s3_code_and_status(e)
        if code in _TRANSIENT_S3_CODES or (status is not None and (status >= 500 or status == 429)):
            return True
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in _TRANSIENT_TYPE_NAMES:
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


class Redactor:
    """Replaces every known secret (and the access key id) in text with '***'."""

    def __init__(self, secrets: Iterable[str | None]):
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def contains_secret(self, text: str) -> bool:
        return any(secret in text for secret in self._secrets)


def describe(exc: BaseException, redact: Redactor) -> str:
    """'TypeName: message' of the innermost informative exception, credentials removed."""
    parts = []
    for e in _chain(exc):
        text = f"{type(e).__name__}: {e}".strip().rstrip(":")
        if text not in parts:
            parts.append(text)
    shown = parts if len(parts) <= 2 else [parts[0], parts[-1]]  # outermost and root cause
    return redact(" <- ".join(shown))[:600]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff (with +-25% jitter) on transient errors until `deadline_s` has passed in all.
    `sleep` and `clock` are injectable (tests pass a fake clock that the fake sleep advances)."""
    deadline_s: float = 120.0
    first_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based), before jitter."""
        return min(self.first_backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


@dataclass(frozen=True)
class Fixes:
    """What to tell the user for each kind of failure of one storage location."""
    auth: str
    unreachable: str
    other: str | None = None  # for other non-transient errors (e.g. a local directory that cannot be made)


def _final_error(exc: BaseException, *, what: str, url: str, redact: Redactor, fixes: Fixes, attempts: int,
                 elapsed_s: float) -> StorageError:
    """The StorageError subclass a failed call ends in; its message names `what`, `url` and the fix."""
    detail = describe(exc, redact)
    if is_auth_error(exc):
        return StorageAuthError(f"{what} {url} was refused: {detail}. Fix: {fixes.auth}")
    if any(isinstance(e, FileNotFoundError) for e in _chain(exc)):
        return ObjectMissing(f"{what} {url} failed, it does not exist: {detail}")
    if not is_transient(exc):
        fix = f". Fix: {fixes.other}" if fixes.other else ""
        return StorageError(f"{what} {url} failed: {detail}{fix}")
    return StorageUnreachable(f"{what} {url} kept failing for {elapsed_s:.1f} s ({attempts} attempts): {detail}. "
                              f"Fix: {fixes.unreachable}")


def with_retries(fn: Callable[[], T], *, what: str, url: str, policy: RetryPolicy, redact: Redactor,
                 fixes: Fixes) -> T:
    """Run `fn` until it succeeds, a non-transient error occurs, or the deadline passes (tenacity).

    Errors become StorageError subclasses whose message names `what`, `url` and the fix, with credentials
    redacted and no chained original (its text may carry request details).
    """
    start = policy.clock()

    def left_s() -> float:
        return policy.deadline_s - (policy.clock() - start)

    def wait(state: tenacity.RetryCallState) -> float:
        return min(policy.backoff(state.attempt_number) * random.uniform(0.75, 1.25), max(left_s(), 0.0))

    def log_retry(state: tenacity.RetryCallState) -> None:
        log.warning("storage: %s %s failed (attempt %d: %s); retrying in %.2f s", what, url, state.attempt_number,
                    describe(state.outcome.exception(), redact), state.next_action.sleep)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient), stop=lambda _state: left_s() <= 0, wait=wait,
        sleep=policy.sleep, before_sleep=log_retry, reraise=True)
    try:
        return retrying(fn)
    except Exception as exc:  # noqa: BLE001 - classified by _final_error
        raise _final_error(exc, what=what, url=url, redact=redact, fixes=fixes,
                           attempts=retrying.statistics.get("attempt_number", 1),
                           elapsed_s=policy.clock() - start) from None
