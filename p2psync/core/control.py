"""Engine control calls over HTTP with JSON bodies.

The engine side serves a few routes from a daemon thread; the trainer side posts
to them. Engines that have their own HTTP API (sglang) are driven through that
instead, by their adapter.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .errors import ControlError, EngineUnreachable

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any] | None]
TOKEN_HEADER = "X-P2PSync-Token"


class Refused(Exception):
    """Raised by a handler for a call the engine's state does not allow: answered with
    `status` (409 conflict, 503 not serving) and the message, and not logged as a failure."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class ControlServer:
    """Serves `POST /<route>` by calling `handlers[route](json_body)`, and `GET /<page>` with the
    text `pages[page]()` returns (its content type the page's first element).

    A POST whose token header differs from `token` is refused (403), so only the job the engine
    joined can drive it. Pages need no token: they must hold nothing a stranger may not read
    (an engine's metrics).
    """

    def __init__(
        self, handlers: Mapping[str, Handler], *, host: str = "127.0.0.1", port: int = 0, token: str = "",
        pages: Mapping[str, tuple[str, Callable[[], str]]] | None = None,
    ) -> None:
        routes = dict(handlers)
        texts = dict(pages or {})

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                page = texts.get(self.path.strip("/"))
                if page is None:
                    return self._reply(404, {"error": f"no page {self.path!r}"})
                content_type, text = page
                self._send(200, content_type, text().encode())

            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                route = self.path.strip("/")
                if not hmac.compare_digest(self.headers.get(TOKEN_HEADER, ""), token):
                    return self._reply(403, {"error": "wrong or missing job token"})
                if route not in routes:
                    return self._reply(404, {"error": f"no control route {route!r}"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    result = routes[route](body) or {}
                except Refused as exc:
                    return self._reply(exc.status, {"error": str(exc)})
                except Exception as exc:  # reported to the caller, which names the engine
                    log.exception("control route %s failed", route)
                    return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
                self._reply(200, result)

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                self._send(status, "application/json", json.dumps(body).encode())

            def _send(self, status: int, content_type: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("control: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="p2psync-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def post(url: str, route: str, body: Mapping[str, Any] | None = None, *, token: str = "", timeout: float) -> dict[str, Any]:
    """POST a JSON body to `url/route`; raise ControlError with the engine's message on failure."""
    request = urllib.request.Request(
        f"{url.rstrip('/')}/{route}",
        data=json.dumps(dict(body or {})).encode(),
        headers={"Content-Type": "application/json", TOKEN_HEADER: token},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read() or b"{}")
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise ControlError(f"{route} at {url} answered {exc.code}: {detail}") from exc
    except (OSError, http.client.HTTPException) as exc:  # HTTPException: the engine died mid-answer
        raise EngineUnreachable(f"{route} at {url} got no answer: {exc}") from exc
    except ValueError as exc:
        raise ControlError(f"{route} at {url} failed: {exc}") from exc


def http_json(url: str, path: str, body: dict[str, Any] | None = None, *, timeout: float) -> Any:
    """GET (no body) or POST JSON to an engine's own HTTP API (an sglang or vLLM server); the
    decoded JSON answer, or its text."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise ControlError(f"{path} at {url} failed: {exc.read().decode()[:300]}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise EngineUnreachable(f"{path} at {url} got no answer: {exc}") from exc
    try:
        return json.loads(text)
    except ValueError:
        return text
