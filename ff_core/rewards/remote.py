"""The ``remote`` reward: scores computed by an HTTP service (``ff rewards serve``, or any server speaking
:mod:`ff_core.rewards.protocol`).

Flow-GRPO serves GenEval, DeQA and UnifiedReward from their own environments (their dependencies clash with the
trainer's) and Flow-Factory has a remote reward client; this is ff's: a versioned JSON protocol with the media in the
request (no shared filesystem, no pickle), bounded retries with exponential backoff, a timeout on every socket
operation, and one error naming the URL, the attempts and what was wrong. ``GET /info`` is read when the reward is
built, so a wrong URL or a server scoring other media fails the recipe before any weight loads.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Literal

import torch
from torch import Tensor

from ff_core.rewards.base import GROUPWISE, POINTWISE, Reward, RewardBatch
from ff_core.rewards.protocol import (
    ENCODINGS,
    MEDIA_KINDS,
    PROTOCOL_VERSION,
    ProtocolError,
    encode_request,
    parse_info,
    parse_scores,
)

MAX_BACKOFF = 30.0
"""Longest wait between two attempts (seconds), however many retries."""
RETRY_STATUSES = frozenset({408, 429})
"""Besides 5xx: statuses worth another attempt (request timeout, too many requests)."""
_READ_CHUNK = 1 << 16


class RemoteRewardError(RuntimeError):
    """A remote reward that could not score: the message names the URL, the attempts and what went wrong."""


class _Retryable(Exception):
    """One failed attempt that another might mend (no connection, timeout, HTTP 5xx)."""


class RemoteReward(Reward):
    """A reward computed by a server (``ff rewards serve --reward NAME``; docs/objectives.md, "Remote rewards").

    Each call sends the samples in requests of at most ``batch_size`` (a groupwise reward's groups are never split),
    each with the outputs whose kind the served reward scores, encoded in the request. ``GET {url}/info`` is read at
    construction: the served reward's ``kind``, ``media_types`` and ``required_fields`` become this reward's, so
    ``Rewards.check_outputs`` and ``check_records`` hold it to what the server needs.

    Args:
        url: the server, ``http://host:port`` (``https`` too); ``/info`` and ``/score`` are appended.
        timeout: seconds allowed to each request's every socket operation (connect, send, each read) and to reading
            the whole answer once it starts.
        retries: further attempts after a request fails for a reason another attempt may mend (connection refused or
            reset, timeout, HTTP 5xx, 408, 429); a request is tried ``1 + retries`` times. A 4xx answer or a malformed
            one is not retried.
        backoff: seconds before the first retry, doubled for each next one (at most 30).
        batch_size: samples per request.
        kind: ``pointwise`` or ``groupwise`` (groupwise: whole groups are sent with their group ids, after the groups
            are gathered across ranks). Default: the server's. ``groupwise`` may be asked of a pointwise server;
            ``pointwise`` of a groupwise one is refused (its scores depend on samples it would not see).
        media_types: the output kinds to send (default: all the server scores); must be ones it scores.
        required_fields: metadata fields each record must carry, besides those the server names.
        reward: the name the served reward must have (checked against ``/info`` and by the server); default: any.
        token_env: the environment variable holding a bearer token, sent as ``Authorization: Bearer ...`` (the token
            is read when a request is sent, and never written into configs or logs).
        headers: further request headers (not secrets: use ``token_env``).
        encoding: ``raw`` (tensor bytes) or ``png`` (uint8 images as lossless PNG, smaller; other media stay raw).
        check_info: read ``/info`` at construction; ``false`` for a server that has none (then ``kind``,
            ``media_types`` and ``required_fields`` default to pointwise, image, none).
    """

    name = "remote"
    media_types = MEDIA_KINDS

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 1.0,
        batch_size: int = 64,
        kind: Literal["pointwise", "groupwise"] | None = None,
        media_types: list[str] | None = None,
        required_fields: list[str] | None = None,
        reward: str | None = None,
        token_env: str | None = None,
        headers: dict[str, str] | None = None,
        encoding: Literal["raw", "png"] = "raw",
        check_info: bool = True,
    ) -> None:
        super().__init__()
        _check_options(url, timeout, retries, backoff, batch_size, kind, media_types, encoding)
        self.url = url.rstrip("/")
        self.headers = dict(headers or {})
        if any(k.lower() == "authorization" for k in self.headers):
            raise ValueError("headers: do not write a credential into the config; put it in an environment variable "
                             "and name it with token_env")  # fmt: skip
        if token_env is not None and not os.environ.get(token_env):
            raise ValueError(f"token_env: the environment variable {token_env!r} is not set (it holds the token for "
                             f"{self.url})")  # fmt: skip
        self.token_env = token_env
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        self.batch_size, self.encoding, self.served = batch_size, encoding, reward
        self._loopback = _is_loopback(urllib.parse.urlsplit(url).hostname)
        info = self._read_info() if check_info else None
        self._configure(info, kind, media_types, required_fields, reward)

    # -- construction ------------------------------------------------------------------------------------------
    def _read_info(self) -> dict[str, Any]:
        try:
            return parse_info(self._request("GET", "/info"))
        except (RemoteRewardError, ProtocolError) as exc:
            # A ValueError: Rewards reports it as a ConfigError naming the config key, before any weight loads.
            raise ValueError(f"cannot use the reward server at {self.url}: {exc}") from None

    def _configure(self, info: dict[str, Any] | None, kind: str | None, media_types: list[str] | None,
                   required_fields: list[str] | None, reward: str | None) -> None:  # fmt: skip
        if info is None:
            self.kind = kind or POINTWISE
            self.media_types = tuple(media_types or ("image",))
            self.required_fields = tuple(required_fields or ())
            return
        where = f"the reward server at {self.url} serves {info['name']!r}"
        if reward is not None and info["name"] != reward:
            raise ValueError(f"reward: expected {reward!r}, but {where}")
        if kind == POINTWISE and info["kind"] == GROUPWISE:
            raise ValueError(f"kind: {where}, a groupwise reward; scored pointwise it would not see whole groups")
        served = tuple(info["media_types"])
        if media_types is not None and not set(media_types) <= set(served):
            raise ValueError(f"media_types: {where}, which scores {'/'.join(served)}, not "
                             f"{'/'.join(sorted(set(media_types) - set(served)))}")  # fmt: skip
        self.kind = kind or info["kind"]
        self.media_types = tuple(media_types or served)
        self.required_fields = tuple(dict.fromkeys([*info.get("required_fields", []), *(required_fields or [])]))
        self.served = info["name"]

    # -- scoring ---------------------------------------------------------------------------------------------
    def __call__(self, batch: RewardBatch) -> Tensor:
        scores = torch.zeros(len(batch))
        for indices in self._chunks(batch):
            try:
                request = encode_request(batch, indices, self.media_types, self.served, self.kind == GROUPWISE,
                                         self.encoding)  # fmt: skip
            except ProtocolError as exc:
                raise RemoteRewardError(f"remote reward {self.url}: cannot send the batch: {exc}") from None
            answer = self._request("POST", "/score", request)
            try:
                values = parse_scores(answer, len(indices))
            except ProtocolError as exc:
                raise RemoteRewardError(f"remote reward {self.url}/score: malformed answer: {exc}") from None
            scores[torch.tensor(indices)] = torch.tensor(values)
        return scores

    def _chunks(self, batch: RewardBatch) -> list[list[int]]:
        """Sample indices per request: consecutive runs of ``batch_size``; groupwise, whole groups packed up to
        ``batch_size`` (a group larger than that goes alone, whole)."""
        n = len(batch)
        if self.kind != GROUPWISE:
            return [list(range(i, min(i + self.batch_size, n))) for i in range(0, n, self.batch_size)]
        members: dict[int, list[int]] = {}
        for i, g in enumerate(batch.group_ids().tolist()):
            members.setdefault(int(g), []).append(i)
        chunks: list[list[int]] = []
        for group in members.values():
            if chunks and len(chunks[-1]) + len(group) <= self.batch_size:
                chunks[-1].extend(group)
            else:
                chunks.append(list(group))
        return chunks

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One JSON request, tried ``1 + retries`` times; returns the decoded answer."""
        url = self.url + path
        try:
            data = None if body is None else json.dumps(body, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:  # a metadata value JSON cannot carry
            raise RemoteRewardError(f"remote reward {url}: the request is not JSON-serialisable: {exc}") from None
        attempts = 1 + self.retries
        for attempt in range(1, attempts + 1):
            try:
                status, text = self._once(method, url, data)
            except _Retryable as exc:
                if attempt == attempts:
                    raise RemoteRewardError(f"remote reward {url}: {exc} (attempt {attempt} of {attempts}; "
                                            "the service is down, slow or failing)") from None  # fmt: skip
                time.sleep(min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF))
                continue
            if status != 200:
                raise RemoteRewardError(f"remote reward {url}: HTTP {status}: {_error_message(text)} "
                                        f"(attempt {attempt} of {attempts}; not retried)")  # fmt: skip
            try:
                return json.loads(text)
            except ValueError:
                raise RemoteRewardError(f"remote reward {url}: malformed answer: not JSON: {text[:200]!r} "
                                        f"(attempt {attempt} of {attempts})") from None  # fmt: skip
        raise AssertionError("unreachable")

    def _once(self, method: str, url: str, data: bytes | None) -> tuple[int, str]:
        """One attempt: ``(status, body)``; failures another attempt may mend raise :class:`_Retryable`."""
        headers = {"Accept": "application/json", "User-Agent": f"ff-remote-reward/{PROTOCOL_VERSION}", **self.headers}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token_env is not None:
            headers["Authorization"] = f"Bearer {os.environ.get(self.token_env, '')}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            # `timeout` is the socket's: it bounds the connect, every send and every read.
            with _opener(self._loopback).open(request, timeout=self.timeout) as response:
                return response.status, self._read(response)
        except urllib.error.HTTPError as exc:
            text = _read_error(exc)
            if exc.code >= 500 or exc.code in RETRY_STATUSES:
                raise _Retryable(f"HTTP {exc.code}: {_error_message(text)}") from None
            return exc.code, text
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise _Retryable(f"no answer within the {self.timeout:g} s timeout") from None
            raise _Retryable(f"cannot connect ({reason})") from None
        except (TimeoutError, socket.timeout):
            raise _Retryable(f"no answer within the {self.timeout:g} s timeout") from None
        except (OSError, http.client.HTTPException) as exc:  # reset, closed mid-answer, a garbled status line
            raise _Retryable(f"the connection failed ({type(exc).__name__}: {exc})") from None

    def _read(self, response: http.client.HTTPResponse) -> str:
        """The answer's body, read within ``timeout`` seconds in all (a server trickling bytes cannot hold us)."""
        deadline = time.monotonic() + self.timeout
        chunks = []
        while chunk := response.read(_READ_CHUNK):
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise TimeoutError
        return b"".join(chunks).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r}, serves={self.served!r}, kind={self.kind!r})"


def _check_options(url: str, timeout: float, retries: int, backoff: float, batch_size: int, kind: str | None,
                   media_types: list[str] | None, encoding: str) -> None:  # fmt: skip
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"url must be http://host:port or https://..., got {url!r}")
    if not _is_number(timeout) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not _is_number(backoff) or not backoff >= 0:
        raise ValueError(f"backoff must be a number of seconds >= 0, got {backoff!r}")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if kind not in (None, POINTWISE, GROUPWISE):
        raise ValueError(f"kind must be {POINTWISE!r} or {GROUPWISE!r}, got {kind!r}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    if media_types is not None and (not media_types or not set(media_types) <= set(MEDIA_KINDS)):
        raise ValueError(f"media_types must be a non-empty list of {', '.join(MEDIA_KINDS)}, got {media_types!r}")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _opener(loopback: bool) -> urllib.request.OpenerDirector:
    """urllib's opener, built per request (the reward stays picklable: EMA and spawn copy the module); for a loopback
    host without the environment's proxies (an ``http_proxy`` set for the internet would otherwise carry requests for
    ``127.0.0.1`` away; Flow-Factory met this)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({})) if loopback else urllib.request.build_opener()


def _read_error(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(_READ_CHUNK).decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return ""
    finally:
        exc.close()


def _error_message(text: str) -> str:
    """The ``error`` of a JSON error answer (what ``ff rewards serve`` sends), else the body's start."""
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return answer["error"]
    return repr(text[:200]) if text else "(empty answer)"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
