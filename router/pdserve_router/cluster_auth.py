"""The router's proof to PD servers that the bootstrap fields of a request come from it.

With a cluster secret (`--disaggregation-secret`, else PDSERVE_DISAGGREGATION_SECRET, else `--api-key`: the one the
PD servers have), each request to a prefill or decode carries `X-PD-Auth: timestamp.nonce.mac`, an HMAC-SHA256 over
the timestamp, a nonce, the method, the path and the body; the servers refuse generation requests without a valid one
(pdserve.cluster_auth verifies it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time

SECRET_ENV = "PDSERVE_DISAGGREGATION_SECRET"
HEADER = "X-PD-Auth"


def configured_secret(flag: str | None, api_key: str | None = None) -> str | None:
    """As the servers take theirs: the flag, else the environment, else the API key."""
    return flag or os.environ.get(SECRET_ENV) or api_key or None


class RequestSigner:
    def __init__(self, secret: str):
        self._key = hashlib.sha256(b"pdserve-cluster:" + secret.encode()).digest()

    def header_line(self, path: str, body: bytes) -> bytes:
        return f"{HEADER}: {self.token(path, body)}\r\n".encode()

    def token(self, path: str, body: bytes) -> str:
        """The X-PD-Auth value over a POST of `body` to `path`."""
        stamp = f"{time.time()!r}.{secrets.token_hex(16)}."
        signed = stamp.encode() + f"POST {path}\n".encode() + body
        return stamp + hmac.new(self._key, signed, hashlib.sha256).hexdigest()
