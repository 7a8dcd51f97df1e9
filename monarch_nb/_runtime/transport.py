"""Socket set-up: where inboxes bind, and how every connection is secured.

Threat model (see docs/security.md): on one host, ipc sockets live in a 0700 runtime
directory and are themselves 0600, so only the user can connect. Across hosts every socket
speaks CurveZMQ with keys derived from the cluster secret; a ZAP handler admits only peers
that prove they hold it. No TCP socket is ever plain: without a cluster key, loopback TCP
uses a key kept in the runtime directory (made 0600 on first use, so the user's own processes
share it and nobody else can read it), and TCP off loopback is refused.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

import zmq
import zmq.auth.thread

from .._wire.keys import curve_keypair, load_or_create_key
from ..errors import ConfigError

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "monarch_nb"
#: the key of a runtime directory's loopback TCP sockets when no cluster key is given
LOCAL_KEY_FILE = "loopback-tcp.key"


def local_key(runtime_dir: str) -> bytes:
    """This runtime directory's loopback key (created 0600 on first use)."""
    return load_or_create_key(os.path.join(runtime_dir, LOCAL_KEY_FILE))


@dataclass(frozen=True)
class Security:
    """The secret of a cluster (None: ipc, and loopback TCP with the runtime directory's key).

    ``trust_all`` (``ca="trust_all_connections"``, ``--trust-all``) is kept for Monarch's API;
    it means no more than no key: loopback TCP is still authenticated, with the local key.
    """

    key: bytes | None = None
    trust_all: bool = False

    def check_address(self, addr: str) -> None:
        """Refuse TCP to ``addr`` that no key we hold could authenticate."""
        if not addr.startswith("tcp://") or self.key is not None:
            return
        host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if not _is_loopback(host):
            raise ConfigError(
                f"refusing unauthenticated TCP to {addr}: off loopback every connection is authenticated "
                "with one. Make one with `monarch-nb keygen KEYFILE`, copy it to every host, and pass it "
                "(--key-file KEYFILE, key_file=/ca=KEYFILE, or MONARCH_NB_KEY_FILE=KEYFILE); "
                "ca='trust_all_connections' / --trust-all only serve loopback"
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

    def __init__(self, ctx: zmq.Context, security: Security, runtime_dir: str = "") -> None:
        self.ctx = ctx
        self.security = security
        self.runtime_dir = runtime_dir
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._keys: tuple[bytes, bytes] | None = None
        if security.key is not None:
            self._keys = curve_keypair(security.key)

    def set_security(self, security: Security) -> None:
        """Adopt a cluster key after start (before any TCP socket uses the old one)."""
        if security.key is not None and security.key != self.security.key and self.security.key is not None:
            raise ConfigError("this process already uses another cluster key; one process joins one cluster")
        if security.key is None:
            # dropping a key would leave our TCP sockets on it: keep it
            security = Security(self.security.key, security.trust_all)
        self.security = security
        if security.key is not None:
            self._keys = curve_keypair(security.key)
            if self._auth is not None:
                self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_KeyProvider(self._keys[0]))

    def _tcp_keys(self, addr: str) -> tuple[bytes, bytes]:
        self.security.check_address(addr)
        if self._keys is None:
            from ..config import runtime_dir

            self._keys = curve_keypair(local_key(self.runtime_dir or runtime_dir()))
        return self._keys

    def _ensure_auth(self, public: bytes) -> None:
        if self._auth is None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self.ctx, log=logger)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_KeyProvider(public))

    def secure_server(self, sock: zmq.Socket, addr: str) -> None:
        if addr.startswith("tcp://"):
            public, secret = self._tcp_keys(addr)
            self._ensure_auth(public)
            sock.curve_server = True
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.zap_domain = ZAP_DOMAIN.encode()

    def secure_client(self, sock: zmq.Socket, addr: str) -> None:
        if addr.startswith("tcp://"):
            public, secret = self._tcp_keys(addr)
            sock.curve_serverkey = public
            sock.curve_publickey = public
            sock.curve_secretkey = secret

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
