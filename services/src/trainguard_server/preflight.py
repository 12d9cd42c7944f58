"""Operator mistakes said in one line before anything starts: ``trainguard <command>: <what>: <fix>``.

Contract: :func:`settings_from` builds :class:`Settings` from flags and ``TRAINGUARD_*`` variables and turns
a refused value into a :class:`UsageError` naming the variable (or flag), the value and what it should
be. :func:`check_serve` looks, for the roles a process runs, at what would otherwise end in a traceback
half-way through the start: the data directory (a file, not writable, not creatable), the detection
overrides (not JSON, an unknown or bad threshold), the roles, and the listening ports (in use, not allowed).
The CLI prints the message and exits 2; nothing here starts anything or writes outside a probe it removes.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from pydantic import ValidationError

from .config import Settings, parse_roles

#: The flags that set a setting (the rest come from TRAINGUARD_<NAME> alone).
FLAGS = {"data_dir": "--data-dir", "host": "--host", "http_port": "--http-port", "grpc_port": "--grpc-port",
         "processor_runtime": "--runtime"}
SETTINGS_TABLE = 'python -c "from trainguard_engine.catalogue import settings_table as t; print(t())"'


class UsageError(Exception):
    """What the operator got wrong and how to fix it, as one line (the CLI exits 2)."""


def _name(field: str, flagged: Iterable[str]) -> str:
    env = f"TRAINGUARD_{field.upper()}"
    return f"{FLAGS[field]} ({env})" if field in flagged and field in FLAGS else env


def settings_from(overrides: Mapping[str, Any]) -> Settings:
    """``Settings(**overrides)`` (flags over the environment); UsageError naming a refused value."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "?"
        value = overrides.get(field, os.environ.get(f"TRAINGUARD_{field.upper()}", first.get("input")))
        raise UsageError(f"{_name(field, overrides)}={value!r} is not valid: {first['msg']}; fix or unset "
                         "it") from None


def check_serve(settings: Settings, roles: Optional[str] = None, flagged: Iterable[str] = ()) -> None:
    """Raise UsageError for the first thing that would stop ``serve`` (or one role) from starting."""
    flagged = set(flagged)
    try:
        wanted = parse_roles(roles or settings.roles)
    except ValueError as exc:
        raise UsageError(f"TRAINGUARD_ROLES: {exc}") from None
    check_data_dir(Path(settings.data_dir), _name("data_dir", flagged))
    if "processor" in wanted:
        check_overrides(settings.detection_overrides)
    ports: list[Tuple[str, int, str]] = []
    if "gateway" in wanted or "api" in wanted:
        ports.append(("HTTP", settings.http_port, _name("http_port", flagged | {"http_port"})))
    if "gateway" in wanted:
        ports.append(("gRPC", settings.grpc_port, _name("grpc_port", flagged | {"grpc_port"})))
    for what, port, name in ports:
        check_port(settings.host, port, what, name)


def check_data_dir(path: Path, name: str = "--data-dir") -> None:
    """The directory exists or can be made, and this user can write in it."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{name} {path} is a file, not a directory: give a directory (it is created when "
                         "missing)")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        verb = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        raise UsageError(f"{name} {path} {verb} by this user: give a directory you can write in")


def check_overrides(text: str) -> None:
    """``detection_overrides`` is a JSON object of known thresholds with valid values."""
    from trainguard_engine.catalogue import DetectionSettings

    try:
        overrides: Dict[str, Any] = json.loads(text or "{}")
    except ValueError as exc:
        raise UsageError(f"TRAINGUARD_DETECTION_OVERRIDES is not JSON ({exc}): give an object such as "
                         "'{\"stall_min_s\": 30}'") from None
    if not isinstance(overrides, dict):
        raise UsageError("TRAINGUARD_DETECTION_OVERRIDES must be a JSON object such as "
                         f"'{{\"stall_min_s\": 30}}', got {type(overrides).__name__}")
    try:
        DetectionSettings.from_overrides(overrides)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"TRAINGUARD_DETECTION_OVERRIDES: {exc} (every threshold: "
                         f"{SETTINGS_TABLE})") from None


def check_port(host: str, port: int, what: str, name: str) -> None:
    """``host:port`` can be listened on now (0: any free port, not checked)."""
    if port == 0:
        return
    if not 0 < port < 65536:
        raise UsageError(f"{name} {port} is not a port: give 1-65535 (0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} (TRAINGUARD_HOST) cannot be bound: {exc.strerror}; give an "
                         "address of this machine such as 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise port_error(exc, host, port, what, name) from None


def port_error(exc: OSError, host: str, port: int, what: str, name: str) -> UsageError:
    """The one-line message for a failed bind of ``host:port``."""
    if exc.errno == errno.EADDRINUSE:
        return UsageError(f"{host}:{port} ({what}) is already in use: stop what listens there or choose "
                          f"another port with {name}")
    if exc.errno == errno.EACCES:
        return UsageError(f"{host}:{port} ({what}) is not allowed for this user (ports below 1024 need "
                          f"privileges): choose another port with {name}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return UsageError(f"{host} is not an address of this machine ({what} port {port}): give one with "
                          "--host (TRAINGUARD_HOST), such as 127.0.0.1 or 0.0.0.0")
    return UsageError(f"{host}:{port} ({what}) cannot be listened on: {exc.strerror}; choose another with "
                      f"{name}")


def check_reachable(url: str, flag: str, timeout: float = 3.0) -> None:
    """A TCP connection to ``url``'s host and port opens within ``timeout`` s (a stopped backend is said at
    once instead of after the retries of a whole import); UsageError naming ``flag`` otherwise."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    default = {"http": 80, "https": 443, "grpc": 4317, "grpcs": 443}.get(parts.scheme, 0)
    try:
        host, port = parts.hostname or "", parts.port or default
    except ValueError as exc:
        raise UsageError(f"{flag} {url!r} is not a URL ({exc})") from None
    if not host or not port:
        return  # the transport says what is wrong with it
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"cannot reach {url} ({reason}): is the TrainGuard backend running there? ({flag})"
                         ) from None
