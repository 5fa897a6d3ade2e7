"""The reference reward server: any installed reward over HTTP (:mod:`ff_core.rewards.protocol`), for the ``remote``
reward (:mod:`ff_core.rewards.remote`).

``ff rewards serve --reward NAME [--args JSON_OR_YAML] [--host 127.0.0.1] [--port 0] [--device cpu]`` (also
``python -m ff_core.rewards.serve ...``) builds the reward as a recipe would (a registered name or a dotted path
``pkg.module:Class``, ``--args`` its ``__init__`` arguments), prints ``serving <name> on http://HOST:PORT`` (port 0:
a free one) and answers ``GET /info`` and ``POST /score`` until interrupted. Requests are read on their own threads
(a ``ThreadingHTTPServer``); scoring is one batch at a time (a model on an accelerator is not thread-safe). A
malformed request gets HTTP 400 with ``{"error": message}``, a reward that fails HTTP 500 with its message; the
client shows either.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import traceback
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from ff_core.rewards.base import Reward
from ff_core.rewards.protocol import ProtocolError, decode_request, reward_info

SOCKET_TIMEOUT = 120.0
"""Seconds the server waits on any one socket operation of a request (a stalled client frees its thread)."""
MAX_REQUEST_BYTES = 2 << 30
"""Largest request body accepted (2 GiB: 64 raw 1024^2 images are 270 MB with base64)."""
EXIT_USAGE = 2


class RewardServer(ThreadingHTTPServer):
    """An HTTP server scoring with one reward.

    Args:
        reward: the reward, on its device.
        host: address to bind.
        port: port to bind; 0 picks a free one (see :attr:`url`).
        args: the reward's arguments, reported by ``/info``.
        quiet: do not log each request to stderr.
    """

    daemon_threads = True  # a request in flight does not keep the process alive after shutdown

    def __init__(self, reward: Reward, host: str = "127.0.0.1", port: int = 0, args: dict[str, Any] | None = None,
                 quiet: bool = False) -> None:  # fmt: skip
        super().__init__((host, port), _Handler)
        self.reward = reward
        self.info = reward_info(reward, args)
        self.quiet = quiet
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host if ":" not in host else f"[{host}]"
        return f"http://{host}:{port}"

    def score(self, request: Any) -> list[float]:
        """Scores of a decoded ``/score`` request; :class:`ProtocolError` for a request the reward cannot take."""
        batch = decode_request(request)
        name = request.get("reward")
        if name is not None and name != self.reward.name:
            raise ProtocolError(f"reward: this server serves {self.reward.name!r}, the request asks for {name!r}")
        for field in self.reward.required_fields:
            lacking = [i for i, m in enumerate(batch.metadata) if field not in m]
            if lacking:
                raise ProtocolError(f"metadata[{lacking[0]}]: reward {self.reward.name!r} needs the field {field!r} "
                                    f"({len(lacking)} of {len(batch)} samples lack it)")  # fmt: skip
        if len(batch) == 0:
            return []
        try:
            with self.lock, torch.no_grad():
                scores = self.reward(batch)
        except ValueError as exc:  # the reward's own check of the batch (media it does not score, ...)
            raise ProtocolError(str(exc)) from None
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (len(batch),):
            shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise RuntimeError(f"reward {self.reward.name!r} returned {shape} for {len(batch)} samples")
        values = scores.detach().float().cpu().tolist()
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RuntimeError(f"reward {self.reward.name!r} returned a non-finite score for sample {bad[0]}: "
                               f"{values[bad[0]]}")  # fmt: skip
        return values


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    timeout = SOCKET_TIMEOUT
    server_version = "ff-reward-server"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/info":
            self._answer(200, self.server.info)
        else:
            self._answer(404, {"error": f"no {self.path}: the endpoints are GET /info and POST /score"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/score":
            self._answer(404, {"error": f"no {self.path}: the endpoints are GET /info and POST /score"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._answer(411, {"error": "a /score request needs a Content-Length header"})
            return
        if not 0 <= length <= MAX_REQUEST_BYTES:
            self._answer(413, {"error": f"request of {length} bytes; the largest accepted is {MAX_REQUEST_BYTES}"})
            self.close_connection = True
            return
        try:
            request = json.loads(self.rfile.read(length))
        except ValueError as exc:
            self._answer(400, {"error": f"the request is not JSON: {exc}"})
            return
        try:
            scores = self.server.score(request)
        except ProtocolError as exc:
            self._answer(400, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - the reward's failure goes back to the client, and to our log
            traceback.print_exc(file=sys.stderr)
            self._answer(500, {"error": f"reward {self.server.reward.name!r} failed: {type(exc).__name__}: {exc}"})
        else:
            self._answer(200, {"scores": scores})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        if not self.server.quiet:
            super().log_message(format, *args)


def build_reward(name: str, args: dict[str, Any], device: str = "cpu") -> Reward:
    """The reward a recipe entry ``{name, args}`` builds (a registered name or a dotted path), moved to ``device``;
    a mistake raises :class:`~ff_core.errors.ConfigError` naming ``--reward`` or ``--args``."""
    from ff_core.errors import ConfigError
    from ff_core.plugins import get_reward_class

    try:
        cls = get_reward_class(name)
    except KeyError as exc:
        raise ConfigError("--reward", exc.args[0]) from None
    try:
        reward = cls(**args)
    except (TypeError, ValueError) as exc:  # an unknown argument, the reward's own check of a value
        raise ConfigError("--args", f"reward {name!r}: {exc}") from None
    return reward.to(device)


def parse_args_value(text: str) -> dict[str, Any]:
    """``--args``: a JSON or YAML mapping (YAML reads JSON too)."""
    import yaml

    try:
        value = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise ValueError(f"--args: not JSON or YAML: {exc}") from None
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"--args: expected a mapping of the reward's arguments, found {value!r}")
    return value


def parser(prog: str = "ff rewards serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve an installed reward over HTTP for the `remote` reward "
                                                       "(GET /info, POST /score; docs/objectives.md).")  # fmt: skip
    p.add_argument("--reward", required=True, help="a registered reward name (`ff plugins` lists them) or a dotted "
                                                   "path pkg.module:Class")  # fmt: skip
    p.add_argument("--args", default="{}", help="the reward's arguments, a JSON or YAML mapping (default: {})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only; "
                                                       "0.0.0.0 for every interface)")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="port to bind (default: 0, a free one, printed)")
    p.add_argument("--device", default="cpu", help="device the reward scores on (default: cpu)")
    p.add_argument("--quiet", action="store_true", help="do not log each request to stderr")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m ff_core.rewards.serve") -> int:
    """Parse ``argv``, build the reward, serve until interrupted; returns the exit status."""
    from ff_core.errors import ConfigError

    a = parser(prog).parse_args(argv)
    try:
        args = parse_args_value(a.args)
        reward = build_reward(a.reward, args, a.device)
        server = RewardServer(reward, a.host, a.port, args, quiet=a.quiet)
    except (ConfigError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the port is taken, the address is not this machine's
        print(f"{prog}: cannot listen on {a.host}:{a.port}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"serving {reward.name} on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
