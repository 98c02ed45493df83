"""Who may do what on the router's HTTP surface: API keys, the admin gate, cost-model files.

Built once per router replica from `RouterSettings` (`Access.from_settings`), called by the ingress
at the top of each route, before the body is read:
- `Access.api(request)`: the OpenAI routes (`/v1/completions`, `/v1/chat/completions`,
  `/v1/models`). With `router.api_keys_env` set, a request needs `Authorization: Bearer <key>` with
  one of the keys in that environment variable (comma-separated); otherwise 401 in the OpenAI error
  shape, `type` "authentication_error", `code` "missing_api_key" or "invalid_api_key". Unset: open.
- `Access.admin(request)`: `/admin/*`, by `router.admin`: `disabled` → 404 (as an unknown path),
  `loopback` → 403 unless the client address the replica sees is loopback, `token` → 401 unless
  `Authorization: Bearer <token in router.admin_token_env>`.
Both return None to let the request through, or the error response to send. `/health` is never gated.

Secrets: the variables are read on the replica, where the keys are hashed (SHA-256) at once and only
the digests are kept; a presented key is hashed and compared with every digest by
`hmac.compare_digest` (equal-length inputs, no early exit), so neither a key's content nor its length
leaks through timing. No key, token or presented credential is logged or echoed in a response; a
variable that is unset or holds no key stops the replica at start (an API meant to be closed never
silently runs open).

The client address: `request.client.host` is the TCP peer of the replica's HTTP server. Under Serve's
HAProxy (our fast path) that peer is HAProxy — 127.0.0.1 when it runs on the replica's node — and
HAProxy forwards no client address, so *every* client looks loopback there; under Serve's Python
proxy the scope carries the client's real address. X-Forwarded-For / Forwarded are never read here
(any client can send them). So `loopback` means "whoever can reach the HTTP port" unless Serve binds
127.0.0.1 (`config.load_serve_config` refuses `loopback` with any other `http_options.host`); use
`token` for anything not on a single machine.

`CostModelFiles.load(source)`: what `POST /admin/cost_model` may load — a shipped profile name, or a
`.yaml`/`.yml` file inside `router.cost_model_dir` after symlinks and `..` are resolved. Everything
else (missing, outside, not a regular file, not YAML, not a mapping) is one and the same 400, which
says nothing about whether the path exists.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import yaml
from fastapi import Request
from fastapi.responses import JSONResponse

from disagg.core.cost_model import CostModel, load_profile, shipped_profiles
from serve_app.config import AdminAccess, RouterSettings
from serve_app.openai_api import ApiError


class AccessConfigError(ValueError):
    """An access setting that cannot be served (names the variable, never its value)."""


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _secrets(environ: Mapping[str, str], var: str, field: str, many: bool) -> tuple[bytes, ...]:
    """The digests of the secrets in environment variable `var` (comma-separated when `many`)."""
    raw = environ.get(var)
    if raw is None:
        raise AccessConfigError(f"router.{field}: environment variable {var} is not set on this router replica "
                                "(export it where Ray starts, on every node that may run a router)")
    parts = [p.strip() for p in raw.split(",")] if many else [raw.strip()]
    parts = [p for p in parts if p]
    if not parts:
        raise AccessConfigError(f"router.{field}: environment variable {var} holds no {'key' if many else 'token'}")
    for i, p in enumerate(parts):
        if not all(33 <= ord(c) <= 126 for c in p):  # what a Bearer header can carry, spaces excluded
            raise AccessConfigError(f"router.{field}: {'key #' + str(i + 1) if many else 'the token'} in {var} "
                                    "has a character outside printable ASCII (or a space)")
    return tuple(_digest(p) for p in parts)


def is_loopback(host: str | None) -> bool:
    """`host` is a loopback address (127.0.0.0/8, ::1, or IPv4-mapped ::ffff:127.x)."""
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _bearer(request: Request) -> str | None:
    """The Bearer credential, '' when the header is malformed, None when there is none."""
    values = request.headers.getlist("authorization")
    if not values:
        return None
    if len(values) > 1:
        return ""
    scheme, _, credential = values[0].strip().partition(" ")
    credential = credential.strip()
    if scheme.lower() != "bearer" or not credential or " " in credential:
        return ""
    return credential


def _error(status: int, message: str, kind: str, code: str | None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_CHALLENGE = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True)
class Access:
    api_keys: tuple[bytes, ...]  # SHA-256 digests of the API keys; empty: the API is open
    admin_mode: AdminAccess
    admin_token: bytes | None  # SHA-256 digest of the admin token (admin_mode TOKEN)

    @classmethod
    def from_settings(cls, rc: RouterSettings, environ: Mapping[str, str] = os.environ) -> "Access":
        """Read the secrets the settings name; raises AccessConfigError on an unset or empty variable."""
        keys = _secrets(environ, rc.api_keys_env, "api_keys_env", many=True) if rc.api_keys_env else ()
        token = (_secrets(environ, rc.admin_token_env, "admin_token_env", many=False)[0]
                 if rc.admin is AdminAccess.TOKEN else None)
        return cls(keys, rc.admin, token)

    def describe(self) -> str:
        """For the start-up log: counts and modes, never a secret."""
        api = f"{len(self.api_keys)} API key(s)" if self.api_keys else "open (no API keys)"
        return f"/v1: {api}; /admin: {self.admin_mode.value}"

    @staticmethod
    def _matches(presented: str, digests: tuple[bytes, ...]) -> bool:
        d = _digest(presented)
        ok = False
        for known in digests:  # every digest compared: the time does not say which key matched
            ok |= hmac.compare_digest(d, known)
        return ok

    def api(self, request: Request) -> JSONResponse | None:
        """None when the request may use the OpenAI routes; else the 401 to send."""
        if not self.api_keys:
            return None
        presented = _bearer(request)
        if presented is None:
            return _error(401, "no API key: send the header 'Authorization: Bearer <key>'", "authentication_error",
                          "missing_api_key", _CHALLENGE)
        if not presented or not self._matches(presented, self.api_keys):
            return _error(401, "invalid API key: send the header 'Authorization: Bearer <key>' with a key this "
                          "server accepts", "authentication_error", "invalid_api_key", _CHALLENGE)
        return None

    def admin(self, request: Request) -> JSONResponse | None:
        """None when the request may use `/admin/*`; else the 404, 403 or 401 to send."""
        if self.admin_mode is AdminAccess.DISABLED:
            return _error(404, f"unknown path {request.method} {request.url.path}", "not_found_error", None)
        if self.admin_mode is AdminAccess.LOOPBACK:
            if is_loopback(request.client.host if request.client else None):
                return None
            return _error(403, "the admin routes are served to loopback clients only (router.admin: loopback)",
                          "permission_error", None)
        presented = _bearer(request)
        if not presented or not self._matches(presented, (self.admin_token,)):
            return _error(401, "the admin routes need 'Authorization: Bearer <admin token>' (router.admin: token)",
                          "authentication_error", "invalid_admin_token", _CHALLENGE)
        return None


def run_dir() -> Path:
    """The folder the stack was launched from (DISAGG_RUN_DIR): relative configured paths start there."""
    return Path(os.environ.get("DISAGG_RUN_DIR", "."))


@dataclass(frozen=True)
class CostModelFiles:
    """What `POST /admin/cost_model` may load: a shipped profile, or a YAML file inside `allowed`.

    `allowed` None: profile names only. A relative source is taken from `relative_to` (the run
    folder, as every relative path in the config), so `runs/cpu-calibrated.yaml` names the same
    file for `disagg calibrate --out` and for the router."""

    allowed: Path | None = None
    relative_to: Path = Path(".")

    @classmethod
    def from_settings(cls, rc: RouterSettings) -> "CostModelFiles":
        base = run_dir()
        return cls(base / rc.cost_model_dir if rc.cost_model_dir else None, base)

    def load(self, source: object) -> CostModel:
        """The cost model an admin client named. Raises ApiError (400) with one message for everything
        refused (missing, outside `allowed` once symlinks and '..' are resolved, not a regular
        .yaml/.yml file, not YAML, not a mapping), so the answer never tells whether a path exists. A
        file found and parsed that describes no valid cost model raises CostModelError naming the
        field (it is inside the allowed folder: its content is the admin's to see)."""
        known = shipped_profiles()
        where = (" or a .yaml file inside router.cost_model_dir" if self.allowed is not None
                 else " (router.cost_model_dir is not set: no file may be loaded over HTTP)")
        refused = ApiError(f"cost_model must be a shipped profile name {known}{where}", param="cost_model")
        if not isinstance(source, str):
            raise refused
        if source in known:
            return load_profile(source)
        if self.allowed is None or not source:
            raise refused
        try:
            allowed = self.allowed.resolve()
            real = (self.relative_to / source).resolve()  # symlinks and '..' resolved before the check
            if (not real.is_relative_to(allowed) or real.suffix.lower() not in (".yaml", ".yml")
                    or not real.is_file()):  # is_file: a regular file (no FIFO, device, folder)
                raise refused
            data = yaml.safe_load(real.read_text(encoding="utf-8"))
        except (OSError, RuntimeError, ValueError, yaml.YAMLError):  # symlink loops, NUL bytes, bad bytes or YAML
            raise refused from None
        if not isinstance(data, dict):
            raise refused
        return CostModel.from_dict(data, real)
