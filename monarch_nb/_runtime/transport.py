"""Socket set-up: where inboxes bind, and how every connection is secured.

Threat model (see docs/security.md): on one host, ipc sockets live in a 0700 runtime
directory and are themselves 0600, so only the user can connect. Across hosts every socket
speaks CurveZMQ with keys derived from the cluster secret; a ZAP handler admits only peers
that prove they hold it. Plain TCP (``trust_all_connections``) is refused off loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import warnings
from dataclasses import dataclass

import zmq
import zmq.auth.thread

from .._wire.keys import curve_keypair
from ..errors import ConfigError

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "monarch_nb"


@dataclass(frozen=True)
class Security:
    """The secret of a cluster (None: ipc / trusted loopback only)."""

    key: bytes | None = None
    trust_all: bool = False

    def check_address(self, addr: str) -> None:
        if not addr.startswith("tcp://") or self.key is not None:
            return
        host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if not _is_loopback(host):
            raise ConfigError(
                f"refusing unauthenticated TCP to {addr}: off loopback every connection needs the cluster key "
                "(pass key_file=/ca= a key file, or set MONARCH_NB_KEY_FILE); "
                "ca='trust_all_connections' is only accepted on loopback and ipc"
            )
        if self.trust_all:
            warnings.warn(
                f"trust_all_connections on {addr}: any local user can connect to this port and run code",
                stacklevel=3,
            )


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "*"):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


class _KeyProvider:
    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.public
        if not ok:
            logger.warning("refused a connection: the peer does not hold the cluster key")
        return ok


class SocketFactory:
    """Makes inbox (server) and outbox (client) sockets with the right security."""

    def __init__(self, ctx: zmq.Context, security: Security) -> None:
        self.ctx = ctx
        self.security = security
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        if security.key is not None:
            self.public, self.secret = curve_keypair(security.key)

    def set_security(self, security: Security) -> None:
        """Adopt a cluster key after start (before any TCP socket uses the old one)."""
        if security.key is not None and security.key != self.security.key and self.security.key is not None:
            from ..errors import ConfigError as _CE

            raise _CE("this process already uses another cluster key; one process joins one cluster")
        self.security = security
        if security.key is not None:
            self.public, self.secret = curve_keypair(security.key)
            if self._auth is not None:
                self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_KeyProvider(self.public))

    def _ensure_auth(self) -> None:
        if self._auth is None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self.ctx, log=logger)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_KeyProvider(self.public))

    def secure_server(self, sock: zmq.Socket, addr: str) -> None:
        if addr.startswith("tcp://"):
            self.security.check_address(addr)
            if self.security.key is not None:
                self._ensure_auth()
                sock.curve_server = True
                sock.curve_secretkey = self.secret
                sock.curve_publickey = self.public
                sock.zap_domain = ZAP_DOMAIN.encode()

    def secure_client(self, sock: zmq.Socket, addr: str) -> None:
        if addr.startswith("tcp://"):
            self.security.check_address(addr)
            if self.security.key is not None:
                sock.curve_serverkey = self.public
                sock.curve_publickey = self.public
                sock.curve_secretkey = self.secret

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def ipc_path(runtime_dir: str, name: str) -> str:
    path = os.path.join(runtime_dir, name)
    if len(path) > 100:
        raise ConfigError(
            f"ipc socket path {path!r} is too long for the OS (limit ~107 bytes); "
            "set MONARCH_NB_RUNTIME_DIR to a shorter directory"
        )
    return path


def route_ip(peer_host: str) -> str:
    """The local IP address the kernel would use to reach ``peer_host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def split_tcp(addr: str) -> tuple[str, int]:
    host, port = addr[len("tcp://") :].rsplit(":", 1)
    return host.strip("[]"), int(port)
