"""Cluster keys for CurveZMQ.

Every process of one cluster derives the same Curve25519 keypair from a 32-byte secret the
user holds (a key file, 0600). Servers accept only clients that prove they hold that keypair,
and clients only talk to servers that do, so the secret never crosses the wire and CurveZMQ
encrypts and authenticates every byte (with per-connection nonces, which also stops replays).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat

import zmq
import zmq.utils.z85  # not imported by `import zmq`: curve_keypair may run before anything else imports it

from ..errors import ConfigError

KEY_BYTES = 32


def generate_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write_key_file(path: str, key: bytes | None = None) -> bytes:
    """Write a new key to ``path``, mode 0600, owned by us, or raise :class:`ConfigError`.

    The key is written to a fresh file beside ``path`` (``O_EXCL``: nobody else's file, no
    symlink followed) and renamed over it, so an existing file of any mode, or a symlink
    someone planted, is replaced rather than written through and left readable.
    """
    key = key or generate_key()
    if not path:
        # the rename below failed with a FileNotFoundError traceback naming '' and a temporary file
        raise ConfigError("no path given; give keygen the path of the key file to write")
    if os.path.isdir(path):
        raise ConfigError(f"{path!r} is a directory; give keygen the path of the key file to write")
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ConfigError(f"cannot write cluster key file {path!r}: {e.strerror}") from e
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return key


def load_or_create_key(path: str) -> bytes:
    """The key in ``path``, made (0600) on first use; race-free between processes."""
    if os.path.lexists(path):
        return read_key_file(path)
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    write_key_file(tmp)
    try:
        os.link(tmp, path)  # the first process to link wins; the others read its key
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return read_key_file(path)


def read_key_file(path: str) -> bytes:
    try:
        # O_NONBLOCK: a FIFO planted at the path would block the open (and the kernel or the
        # allocator with it) until someone writes to it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"cannot read cluster key file {path!r}: {e.strerror}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"cluster key file {path!r} is not a regular file; make one with monarch-nb keygen")
    with os.fdopen(fd) as f:
        text = f.read(4096).strip()
    if st.st_mode & 0o077:
        raise ConfigError(f"cluster key file {path!r} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"cluster key file {path!r} belongs to uid {st.st_uid}, not to this user; make your own with monarch-nb keygen"
        )
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
