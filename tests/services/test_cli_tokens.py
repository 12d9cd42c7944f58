"""``trainguard token create|list|revoke`` on a data directory, including token lifetimes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard_server.cli import main, parse_duration
from trainguard_server.storage.sqlite import open_sqlite_stores


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_create_list_and_revoke_with_a_lifetime(tmp_path: Path, capsys: Any) -> None:
    data = str(tmp_path / "data")
    code, token, _ = run(capsys, "token", "create", "--project", "alpha", "--kind", "read",
                         "--description", "ci", "--expires-in", "30d", "--data-dir", data)
    assert code == 0 and token.startswith("tg_read_")
    stores = open_sqlite_stores(Path(data))
    try:
        info = stores.projects.authenticate(token.strip())
        assert info is not None and info.expires_ns > 0
        lifetime_days = (info.expires_ns - info.created_ns) / 86400e9
        assert 29.99 < lifetime_days < 30.01
    finally:
        stores.close()
    code, listing, _ = run(capsys, "token", "list", "--project", "alpha", "--data-dir", data)
    (line,) = [row for row in listing.splitlines() if "\tci" in row]
    assert "\tactive\tuntil " in line
    token_id = line.split("\t")[0]
    assert run(capsys, "token", "revoke", "--token-id", token_id, "--data-dir", data)[0] == 0
    assert "\trevoked\t" in run(capsys, "token", "list", "--project", "alpha", "--data-dir", data)[1]


def test_a_bad_lifetime_is_refused(tmp_path: Path, capsys: Any) -> None:
    code, _, err = run(capsys, "token", "create", "--project", "alpha", "--expires-in", "soon",
                       "--data-dir", str(tmp_path / "data"))
    assert code == 2 and "--expires-in: a duration is a positive number with a unit" in err


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("15m", 900), ("12h", 43200), ("30d", 2592000),
                                          ("2w", 1209600), (" 1.5h ", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0d", "-1d", "5", "3y", "d"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="a duration is a positive number"):
        parse_duration(text)
