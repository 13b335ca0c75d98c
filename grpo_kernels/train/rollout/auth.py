"""Keys for rollout servers: who may drive a server that `grpo-kernels serve-rollout` or the trainer starts.

A rollout server's routes include more than generation: with vLLM's development routes on (which the weight
stream needs) anyone who reaches its port can post `/init_weight_transfer_engine` (the workers join a TCPStore at
the address the request names), `/update_weights` (the workers size their buffers from the request's shapes and
load what that party broadcasts), `/collective_rpc`, `/sleep`, `/pause`. vLLM's own `--api-key` (VLLM_API_KEY)
guards only /v1, /v2, /inference and /cohere, none of those. So a server carries `KeyGuard`, an ASGI middleware
that vLLM's API server loads (`--middleware grpo_kernels.train.rollout.auth.KeyGuard`) in front of every route:

    env = {..., KEY_ENV: key}                   # the server's environment, never its command line (`ps` shows that)
    cmd = [..., "--middleware", GUARD]          # every request needs `Authorization: Bearer <key>`, else 401

The key is compared in constant time (hmac.compare_digest of SHA-256 digests, so not even its length leaks).
`/health` alone stays open: a liveness probe (load balancers and orchestrators often cannot send a key) that
answers "up" and nothing else; `/metrics`, the docs and every other route are closed.

Where a key comes from: `serve-rollout` takes `--api-key-file PATH` or the environment variable GRPO_KERNELS_API_KEY
and refuses a non-loopback `--host` without one (`serve_key`); servers the trainer starts get a fresh
`new_key()` per run (or the key in the variable sampling.server_api_key_env names), passed in their environment,
so other users of the machine cannot drive them. The key crosses plain HTTP: across machines, use a private
network or a TLS-terminating proxy in front of the server.
"""

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import sys

__all__ = ["GUARD", "KEY_ENV", "KeyGuard", "env_key", "is_loopback", "new_key", "read_key_file", "serve_key"]

KEY_ENV = "GRPO_KERNELS_API_KEY"
GUARD = f"{__name__}.KeyGuard"
OPEN_PATHS = frozenset({"/health"})


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe text) for the servers of one run."""
    return secrets.token_urlsafe(32)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _checked(key: str, source: str) -> str:
    """key, unless it cannot travel in an HTTP header (printable ASCII only): a one-line ValueError naming source."""
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{source}: the key must be printable ASCII (it travels in an HTTP header)")
    return key


def is_loopback(host: str) -> bool:
    """Whether `host` is an address only this machine reaches ("localhost", 127.0.0.0/8, ::1). A host name other
    than localhost counts as not loopback (it may resolve to any interface)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def read_key_file(path, *, warn=None) -> str:
    """The key in file `path` (surrounding whitespace stripped), or a one-line ValueError naming --api-key-file
    when the file is missing, unreadable or empty. A file that group or others may access gets a warning (one line,
    to `warn`, default stderr), as ssh gives for a private key."""
    warn = warn or (lambda message: print(message, file=sys.stderr))
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except FileNotFoundError:
        raise ValueError(f"--api-key-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not key:
        raise ValueError(f"--api-key-file {path} is empty: write the server's key in it")
    if mode & 0o077:
        warn(f"warning: --api-key-file {path} is accessible by group or others (mode {stat.S_IMODE(mode):04o}): "
             f"anyone who reads it can drive the server; chmod 600 {path}")  # fmt: skip
    return _checked(key, f"--api-key-file {path}")


def env_key(name: str, option: str) -> str:
    """The key in environment variable `name`, or a one-line ValueError naming `option` (what named the variable)
    when it is not set or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"{option}: the environment variable {name} is not set (or empty): export the rollout "
                         "servers' key in it before the run starts")  # fmt: skip
    return _checked(value, f"{option}: {name}")


def serve_key(key_file, host: str, *, warn=None) -> str | None:
    """serve-rollout's key: --api-key-file's, else GRPO_KERNELS_API_KEY's, else None (allowed on a loopback --host
    only, with a warning: every local user could drive the server). One-line ValueError: both given, a bad key
    file, a non-loopback host without a key."""
    warn = warn or (lambda message: print(message, file=sys.stderr))
    from_env = os.environ.get(KEY_ENV, "").strip()
    if key_file is not None and from_env:
        raise ValueError(f"--api-key-file and {KEY_ENV} are both set: give the key one way")
    key = read_key_file(key_file, warn=warn) if key_file is not None else from_env or None
    if key_file is None and key is not None:
        _checked(key, KEY_ENV)
    if key is None and not is_loopback(host):
        raise ValueError(f"--host {host} is not a loopback address and no key is given: anyone who reaches it could "
                         f"replace the served weights; give --api-key-file PATH (or set {KEY_ENV})")  # fmt: skip
    if key is None:
        warn(f"warning: no key (--api-key-file or {KEY_ENV}): every user of this machine can drive the server")
    return key


class KeyGuard:
    """ASGI middleware: every HTTP or WebSocket request but those to OPEN_PATHS must carry `Authorization: Bearer
    <key>` with the key in the server's environment (KEY_ENV), else it is answered 401 (a WebSocket closed, 1008)
    before any route sees it. vLLM builds it with the app alone (`app.add_middleware(KeyGuard)`), so the key is read
    here, at start-up: a server told to carry the guard without a key fails to start instead of running open."""

    def __init__(self, app):
        key = os.environ.get(KEY_ENV, "").strip()
        if not key:
            raise RuntimeError(f"{GUARD} needs the key in the environment variable {KEY_ENV}; it is not set")
        self.app, self._digest = app, _digest(key)

    def allows(self, headers) -> bool:
        """Whether the request's headers (ASGI: [(name, value)] in bytes, names lower case) carry the key."""
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").strip().partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan events
            return await self.app(scope, receive, send)
        root = scope.get("root_path", "")
        path = scope["path"][len(root) :] if root and scope["path"].startswith(root) else scope["path"]
        if path in OPEN_PATHS or self.allows(scope.get("headers", ())):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})  # policy violation (before the handshake)
        body = b'{"error": "unauthorized: this server needs the header Authorization: Bearer <its key>"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
