"""Horovod's Gloo rendezvous server on the Ray driver, behind the job's token (``hvdtrain ray``).

Horovod's runner is imported only when the server starts: the driver needs it, nothing else does.
"""

from __future__ import annotations

from typing import Any

from .ray_plan import RayLaunchError


def rendezvous_class():
    import hmac
    import http.server
    import secrets

    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer, RendezvousServer
    from horovod.runner.util.threads import in_thread

    class TokenHandler(RendezvousHandler):
        """Horovod's handler behind the job's token. Gloo's HTTP store (C++) builds its URLs as
        http://ADDR:PORT/SCOPE/KEY from HOROVOD_GLOO_RENDEZVOUS_ADDR, so ADDR = IP:PORT/TOKEN makes
        every request's path /TOKEN:PORT/SCOPE/KEY: the first segment is checked and dropped, and a
        request without the token (an outsider's PUT of a peer address) is refused with 403."""

        def parse_request(self) -> bool:
            # The check of Horovod's own handler (this repository's patch 0007) is bypassed: it
            # would strip the token a second time. Stock Horovod's handler has none.
            if not http.server.BaseHTTPRequestHandler.parse_request(self):
                return False
            first, _, rest = self.path.lstrip("/").partition("/")
            if not hmac.compare_digest(first.partition(":")[0].encode(), self.server.token.encode()):
                self.send_status_code(403)
                return False
            self.path = "/" + rest
            return True

        def do_HEAD(self):  # SimpleHTTPRequestHandler would list the working directory
            self.send_status_code(403)

    class FixedPortRendezvous(RendezvousServer):
        """Horovod's rendezvous server on an address and port of our choosing, behind a token: its
        start() binds every interface on a random port between 1024 and 65535, which a firewalled
        cluster (or a test confined to a port range) cannot open, and takes writes from anyone.
        The same two steps as RendezvousServer.start, then init(plan) and stop() unchanged."""

        def start_on(self, port: int, address: str = "", token: str = "") -> int:
            self._httpd = RendezvousHTTPServer((address, port), TokenHandler, self._verbose)
            self._httpd.token = token or secrets.token_hex(16)
            self._listen_thread = in_thread(target=self._httpd.serve_forever)
            return self._httpd.server_address[1]

        @property
        def token(self) -> str:
            return self._httpd.token

    return FixedPortRendezvous


def Rendezvous():  # noqa: N802 - a class made on first use: Horovod's runner is imported only here
    return rendezvous_class()()


def rendezvous_addr(addr: str, port: int, token: str) -> str:
    """HOROVOD_GLOO_RENDEZVOUS_ADDR carrying the token (see TokenHandler); the ranks read it from
    their environment, never from a command line."""
    return f"{addr}:{port}/{token}"


def start_rendezvous(port: int, addr: str) -> tuple[Any, int]:
    """The job's rendezvous server, listening on ``addr`` (the address the ranks reach it at) only,
    and its port."""
    rendezvous = Rendezvous()
    try:
        return rendezvous, rendezvous.start_on(port, addr)
    except OSError as error:
        raise RayLaunchError(f"cannot listen on {addr}:{port} for Horovod's rendezvous ({error.strerror}): give "
                             f"--rendezvous-addr an address of this machine and a free --rendezvous-port") from None
