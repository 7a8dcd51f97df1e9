"""Cluster keys for CurveZMQ.

Every process of one cluster derives the same Curve25519 keypair from a 32-byte secret the
user holds (a key file, 0600). Servers accept only clients that prove they hold that keypair,
and clients only talk to servers that do, so the secret never crosses the wire and CurveZMQ
encrypts and authenticates every byte (with per-connection nonces, which also stops replays).
"""

from __future__ import annotations

import hashlib
import os
import secrets

import zmq

from ..errors import ConfigError

KEY_BYTES = 32


def generate_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write_key_file(path: str, key: bytes | None = None) -> bytes:
    key = key or generate_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def read_key_file(path: str) -> bytes:
    try:
        st = os.stat(path)
        text = open(path).read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read cluster key file {path!r}: {e.strerror}") from e
    if st.st_mode & 0o077:
        raise ConfigError(f"cluster key file {path!r} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    try:
        key = bytes.fromhex(text)
    except ValueError as e:
        raise ConfigError(f"cluster key file {path!r} does not hold a hex key") from e
    if len(key) != KEY_BYTES:
        raise ConfigError(f"cluster key file {path!r} holds {len(key)} bytes, expected {KEY_BYTES}")
    return key


def curve_keypair(key: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys derived from the cluster secret."""
    seed = hashlib.sha256(b"monarch_nb curve v1\0" + key).digest()
    secret = zmq.utils.z85.encode(seed)
    return zmq.curve_public(secret), secret
