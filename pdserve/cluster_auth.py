"""The cluster secret: HMAC-SHA256 over every internal message (control channel, KV writes, bootstrap routes).

A signed control message carries `auth: [timestamp, nonce, mac]`, the MAC taken over the timestamp, the nonce and
the msgpack bytes of the message without `auth`. A token for an HTTP request (bootstrap routes, the router's
bootstrap fields) is "timestamp.nonce.mac" over the same parts and the request's method, path and body.
A receiver refuses a MAC that does not verify, a timestamp more than `max_age_s` away from its clock, and a
nonce it saw within that window (replay). Torch-free, one module for the whole package: the PD roles, their
transfer engines, the bootstrap server and the HTTP server's router-token middleware use it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict

import msgpack

SECRET_ENV = "PDSERVE_DISAGGREGATION_SECRET"
HEADER = "X-PD-Auth"  # the HTTP header carrying a token
MAX_AGE_S = 30.0
MAX_NONCES = 200_000


class AuthError(ValueError):
    """A message or request without a valid MAC, too old, or replayed."""


def cluster_secret(configured: str | None, api_key: str | None = None) -> str | None:
    """`--disaggregation-secret`, else the environment's PDSERVE_DISAGGREGATION_SECRET, else the server's
    `--api-key` (a server with only an API key keeps its bootstrap server and control ports closed too), else None."""
    return configured or os.environ.get(SECRET_ENV) or api_key or None


class ClusterAuth:
    """Signs and verifies with one secret; thread-safe (the nonce window is shared by every receiving thread)."""

    def __init__(self, secret: str, max_age_s: float = MAX_AGE_S, max_nonces: int = MAX_NONCES):
        self._key = hashlib.sha256(b"pdserve-cluster:" + secret.encode()).digest()
        self.max_age_s = max_age_s
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it leaves the window
        self._lock = threading.Lock()

    def _mac(self, timestamp: float, nonce: str, data: bytes) -> str:
        return hmac.new(self._key, f"{timestamp!r}.{nonce}.".encode() + data, hashlib.sha256).hexdigest()

    # ---- msgpack maps (control channel, tcp KV writes) ---------------------------------------------------

    def sign(self, header: dict) -> dict:
        timestamp, nonce = time.time(), secrets.token_hex(16)
        return {**header, "auth": [timestamp, nonce, self._mac(timestamp, nonce, msgpack.packb(header))]}

    def verify(self, header: dict) -> dict:
        """`header` without its `auth` field; raises AuthError."""
        proof = header.get("auth")
        if not (isinstance(proof, list) and len(proof) == 3 and type(proof[0]) is float
                and all(isinstance(p, str) for p in proof[1:])):
            raise AuthError("message is not signed with the cluster secret")
        body = {k: v for k, v in header.items() if k != "auth"}
        self._check(proof[0], proof[1], proof[2], msgpack.packb(body))
        return body

    # ---- HTTP tokens ---------------------------------------------------------------------------------------

    def token(self, method: str, path: str, body: bytes = b"") -> str:
        timestamp, nonce = time.time(), secrets.token_hex(16)
        return f"{timestamp!r}.{nonce}.{self._mac(timestamp, nonce, _request_bytes(method, path, body))}"

    def verify_token(self, token: str | None, method: str, path: str, body: bytes = b"") -> None:
        parts = (token or "").rsplit(".", 2)
        if len(parts) != 3:
            raise AuthError(f"missing or malformed {HEADER} header")
        try:
            timestamp = float(parts[0])
        except ValueError:
            raise AuthError(f"malformed {HEADER} timestamp") from None
        self._check(timestamp, parts[1], parts[2], _request_bytes(method, path, body))

    # ---- shared ---------------------------------------------------------------------------------------------

    def _check(self, timestamp: float, nonce: str, mac: str, data: bytes) -> None:
        if not hmac.compare_digest(mac, self._mac(timestamp, nonce, data)):
            raise AuthError("bad cluster-secret MAC")
        now = time.time()
        if not abs(now - timestamp) <= self.max_age_s:
            raise AuthError(f"signed {now - timestamp:.1f}s ago: outside the {self.max_age_s:g}s window")
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError("replayed message")
            if len(self._seen) >= self.max_nonces:
                raise AuthError("too many signed messages in the replay window")
            self._seen[nonce] = now + 2 * self.max_age_s


def _request_bytes(method: str, path: str, body: bytes) -> bytes:
    return f"{method.upper()} {path}\n".encode() + body


def make_auth(configured: str | None, api_key: str | None = None) -> ClusterAuth | None:
    secret = cluster_secret(configured, api_key)
    return ClusterAuth(secret) if secret else None
