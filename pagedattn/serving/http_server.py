"""uvicorn as `python -m pagedattn serve` runs the app: its HTTP protocol with a head timeout, and a Server
whose stop ends the requests still open with an error instead of cutting them.

    Server(uvicorn_config(build_app(client, "tiny"), host, port, limits=limits)).run()
"""
import asyncio

import uvicorn

from pagedattn.serving.config import HTTP_IMPLS, SHUTDOWN_TIMEOUT_S, ServerLimits
from pagedattn.serving.http_errors import ServerStoppingError


# ---- the HTTP protocol: bounded time to send the request headers ----------------------------------------
def _head_timeout_protocol(base, timeout_s):
    """`base` (uvicorn's httptools or h11 protocol) that closes a connection whose request line and headers are not
    complete within timeout_s of the connection opening or of the first byte of a next request (uvicorn's
    keep-alive timer stops at the first byte, so a client dribbling a header would hold the socket)."""

    class HeadTimeoutProtocol(base):
        head_timeout_s = timeout_s

        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_timer = None
            self._arm_head_timer()

        def _waiting_for_head(self):
            return self.cycle is None or self.cycle.response_complete

        def _arm_head_timer(self):
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data):
            super().data_received(data)
            if self._waiting_for_head():
                self._arm_head_timer()
            else:
                self._disarm_head_timer()

        def _head_timed_out(self):
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            self._disarm_head_timer()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


def http_protocol(impl="auto"):
    """uvicorn's HTTP/1.1 protocol class: "httptools" (the C parser; "auto" picks it when it is installed: it
    is most of the API process's CPU per streamed chunk) or "h11" (pure Python)."""
    if impl not in HTTP_IMPLS:
        raise ValueError(f"http_impl must be 'auto', 'httptools' or 'h11', got {impl!r}")
    if impl != "h11":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
            return HttpToolsProtocol
        except ImportError:
            if impl == "httptools":
                raise
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return H11Protocol


def uvicorn_config(app, host="127.0.0.1", port=8000, log_level="info", limits=None, http_impl="auto",
                   shutdown_timeout_s=SHUTDOWN_TIMEOUT_S, **kwargs):
    """The uvicorn.Config `python -m pagedattn serve` runs `app` with (run it with Server): the HTTP protocol of
    http_impl (see http_protocol) with the head timeout above, uvloop's event loop where it is installed
    (uvicorn's "auto"), limits.timeout_keep_alive_s for idle keep-alive connections (limits: the ServerLimits
    given to build_app, default ServerLimits()), and shutdown_timeout_s: how long open requests may take to
    finish once the server is told to stop (uvicorn's timeout_graceful_shutdown; Server)."""
    limits = ServerLimits() if limits is None else limits
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=_head_timeout_protocol(http_protocol(http_impl), limits.head_timeout_s),
                          timeout_keep_alive=limits.timeout_keep_alive_s, timeout_graceful_shutdown=shutdown_timeout_s,
                          **kwargs)


class Server(uvicorn.Server):
    """uvicorn's Server, whose stop ends the requests still open with an error rather than cutting them.

    On a stop (SIGTERM, Ctrl-C, should_exit): no new connection is accepted and idle keep-alive connections
    close; the open requests get config.timeout_graceful_shutdown seconds (uvicorn_config's shutdown_timeout_s)
    to finish; then every request of the app (build_app's) still open ends with ServerStoppingError, aborted in
    the engine: a stream sends `data: {"error": ...}` and `data: [DONE]`, a non-streamed request answers 503
    (code server_shutting_down). uvicorn's own shutdown follows, and its connections close as those last
    responses complete. (uvicorn alone waits out the same period and then cuts the streams still open: no
    error event, no [DONE].)"""

    async def startup(self, sockets=None):
        jobs = self._open_jobs()
        if jobs is not None:
            jobs.reopen()
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets=None):
        for server in self.servers:     # (uvicorn's own first steps; it repeats them, harmlessly)
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()       # idle: closed now; busy: closed once its response is complete
        grace = self.config.timeout_graceful_shutdown
        loop = asyncio.get_running_loop()
        deadline = None if grace is None else loop.time() + grace
        while (self.server_state.connections and not self.force_exit
               and (deadline is None or loop.time() < deadline)):
            await asyncio.sleep(0.05)
        jobs = self._open_jobs()
        if jobs is not None:
            jobs.fail_all(ServerStoppingError(
                "the server is shutting down: this request was still running when the shutdown grace period "
                f"({grace:g} s) ended" if grace is not None else "the server is shutting down"))
        await super().shutdown(sockets=sockets)

    def _open_jobs(self):
        return getattr(getattr(self.config.app, "state", None), "open_jobs", None)
