"""Serving the dashboard: bind the port first (a taken port is a one-line error before the
trace is read, not a traceback from deep in the server), then print the URL and serve
until Ctrl-C."""
from __future__ import annotations

import errno
import sys
import threading
import webbrowser
from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..terminal import safe_text


class LateApp:
    """A WSGI app whose target is set once the page is built: the port is bound (and its
    error reported) before seconds are spent reading a large trace."""

    def __init__(self):
        self.target = None

    def __call__(self, environ, start_response):
        if self.target is None:
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"memadvisor: still reading the trace, reload in a moment\n"]
        return self.target(environ, start_response)


def bind(host: str, port: int, app=None):
    """A threaded WSGI server, already bound (port 0: any free port).

    The socket is bound here, not by werkzeug, whose own bind prints and exits on a
    taken port."""
    import socket

    from werkzeug.serving import get_sockaddr, make_server, select_address_family

    if not 0 <= int(port) <= 65535:
        raise UserError(f"cannot serve on {host}:{port}: a port is 0-65535")
    try:
        family = select_address_family(host, port)
        listener = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, OverflowError, ValueError) as exc:
        raise UserError(f"cannot serve on {host}:{port}: {exc}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(get_sockaddr(host, int(port), family))
        listener.listen(128)
        return make_server(host, port, app if app is not None else LateApp(), threaded=True,
                           fd=listener.fileno())
    except OSError as exc:
        why = exc.strerror or str(exc)
        hint = (" (is another dashboard running? pass another --port, or 0 for any)"
                if exc.errno == errno.EADDRINUSE else "")
        raise UserError(f"cannot serve on {host}:{port}: {why}{hint}") from None
    except (OverflowError, ValueError) as exc:  # a port outside 0-65535
        raise UserError(f"cannot serve on {host}:{port}: {exc}") from None
    finally:
        listener.close()  # the server holds its own duplicate of the socket


def one_line_errors(flask_app, stream=None):
    """Make a request that fails answer 500 and leave one line on the server's terminal,
    not Flask's traceback: the page's callbacks take whatever a client posts (a malformed
    or hostile body would fill the terminal; the HTTP answer stays generic either way).
    The line names the exception and the innermost frame, enough to find a real bug."""
    import traceback

    def log_exception(exc_info) -> None:
        from flask import request

        kind, error, tb = exc_info
        frames = traceback.extract_tb(tb) if tb is not None else []
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        text = str(error).splitlines()[0][:200] if str(error).strip() else ""
        line = (f"memadvisor: dashboard: {request.method} {request.path[:100]} failed "
                f"({kind.__name__}{': ' + text if text else ''}{where}); answered 500")
        print(safe_text(line), file=stream if stream is not None else sys.stderr, flush=True)

    flask_app.log_exception = log_exception  # the instance's, called by Flask with exc_info
    return flask_app


def url_of(server) -> str:
    host = server.host if ":" not in server.host else f"[{server.host}]"
    return f"http://{host}:{server.port}/"


def should_open_browser(no_browser: bool, stream=None) -> bool:
    """Open a browser unless told not to, and only for a person at a terminal."""
    stream = stream if stream is not None else sys.stdout
    return not no_browser and bool(getattr(stream, "isatty", lambda: False)())


def serve(server, *, open_browser: bool = False,
          announce: Callable[[str], None] = print) -> None:
    """Serve a bound server until Ctrl-C (without a log line per request)."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    url = url_of(server)
    announce(url)
    if open_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
