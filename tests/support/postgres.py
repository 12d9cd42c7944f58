"""A real PostgreSQL server for the tests: Debian's ``postgresql`` package (``make test`` installs it; the
binaries live in ``/usr/lib/postgresql/<version>/bin``). :class:`PostgresServer` runs ``initdb`` into a
fresh temporary directory and starts ``postgres`` on a free 127.0.0.1 port as a process we hold the PID of.

PostgreSQL refuses to run as root: when the tests run as root (CI on a fresh Debian machine) both run as
the ``postgres`` user the package creates, in a directory made theirs. Test-only settings: ``fsync=off``
and ``synchronous_commit=off`` (a throwaway cluster; durability is not what these tests measure), trust
authentication on loopback. A missing install fails the tests that need it, saying what installs it.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import psycopg

from tests.support.net import free_port

SUPERUSER = "trainguard"


def pg_bin_dir() -> Path:
    """The directory of ``initdb``/``postgres``: the newest ``/usr/lib/postgresql/<version>/bin``, else
    the one ``pg_ctl`` is on PATH in."""
    found = []
    for path in Path("/usr/lib/postgresql").glob("*/bin/postgres"):
        match = re.fullmatch(r"\d+", path.parent.parent.name)
        if match:
            found.append((int(path.parent.parent.name), path.parent))
    if found:
        return max(found)[1]
    on_path = shutil.which("initdb")
    if on_path and (Path(on_path).resolve().parent / "postgres").exists():
        return Path(on_path).resolve().parent
    raise RuntimeError("no PostgreSQL server binaries (initdb, postgres): `make test` installs Debian's "
                       "postgresql package (apt-get install -y postgresql)")


class PostgresServer:
    """One throwaway PostgreSQL cluster on 127.0.0.1:``port``: ``start()`` (initdb, then waits until it
    accepts connections), ``dsn(dbname)``, ``create_database(name)``, ``halt()`` (fast shutdown; ``start()``
    again restarts it), ``stop()`` (fast shutdown, then the directory is removed)."""

    def __init__(self, port: Optional[int] = None, settings: Sequence[str] = ()) -> None:
        self.bin = pg_bin_dir()
        self.port = port or free_port()
        self.settings = list(settings)  # "name=value", after (so over) the test defaults
        self.root: Optional[Path] = None
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._run_as: Dict[str, Any] = {}

    @property
    def data_dir(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        assert self.root is not None
        return self.root / "postgres.log"

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname={dbname} connect_timeout=10"

    def start(self, timeout: float = 60.0) -> PostgresServer:
        """initdb (first start only), then run the server and wait until it accepts connections; after
        :meth:`halt` it restarts on the same data and port."""
        if self.root is None:
            self._init()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        options: List[str] = []
        for setting in (f"port={self.port}", "listen_addresses=127.0.0.1", f"unix_socket_directories={self.root}",
                        "fsync=off", "synchronous_commit=off", "full_page_writes=off", "max_connections=200",
                        "shared_buffers=32MB", "log_min_messages=warning", *self.settings):
            options += ["-c", setting]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(self.bin / "postgres"), "-D", str(self.data_dir), *options],
                                         env=env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, **self._run_as)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return self
            except psycopg.OperationalError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"PostgreSQL did not accept connections on 127.0.0.1:{self.port} "
                                   f"(exit code {code})\n--- log ---\n{tail}")
            time.sleep(0.05)

    def _init(self) -> None:
        # not under pytest's tmp_path: that is 0700 root-owned, and the server may run as another user
        self.root = Path(tempfile.mkdtemp(prefix="tg-postgres-"))
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root, and there is no 'postgres' user to run PostgreSQL as "
                                   "(Debian's postgresql package creates it)") from None
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        init = subprocess.run(
            [str(self.bin / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8",
             "--locale=C", "--no-sync", "--no-instructions"],
            env=env, cwd=self.root, capture_output=True, text=True, **self._run_as)
        if init.returncode != 0:
            self._remove()
            raise RuntimeError(f"initdb failed ({init.returncode}):\n{init.stdout}\n{init.stderr}")

    def create_database(self, name: str) -> str:
        """Create database ``name``; returns its DSN."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        return self.dsn(name)

    def halt(self) -> None:
        """Stop the server ("fast" shutdown: sessions rolled back, connections closed), keeping its data."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        self.halt()
        self._remove()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except (OSError, AssertionError):
            return ""

    def _remove(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
