"""The job's token comes from the job (issue #46): the environment, a launcher's file, else one
per-user file per job on this host, made once; never from the rendezvous."""

from __future__ import annotations

import stat

import pytest

from p2psync.core.rendezvous import Rendezvous
from p2psync.core.token import TOKEN_DIR_ENV, TOKEN_ENV, TOKEN_FILE_ENV, job_token


@pytest.fixture(autouse=True)
def own_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv(TOKEN_DIR_ENV, str(tmp_path / "tokens"))
    return tmp_path / "tokens"


def test_the_environment_names_the_token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-the-launcher")
    assert job_token("j") == "from-the-launcher"


def test_a_launchers_file_names_it_and_an_empty_one_is_an_error(monkeypatch, tmp_path):
    path = tmp_path / "token"
    path.write_text("in-a-file\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    assert job_token("j") == "in-a-file"
    path.write_text("")
    with pytest.raises(ValueError, match="holds no token"):
        job_token("j")


def test_on_one_host_each_job_has_one_private_token_made_once(own_dir):
    first = job_token("a")
    assert len(first) == 32 and job_token("a") == first  # read again, not made again
    assert job_token("b") != first
    assert stat.S_IMODE((own_dir / "a").stat().st_mode) == 0o600
    assert sorted(p.name for p in own_dir.iterdir()) == ["a", "b"]  # no temporary file left


def test_the_rendezvous_store_never_holds_the_token():
    server = Rendezvous(host="127.0.0.1", port=0, job_id="j", is_server=True, timeout=5)
    token = server.token()
    client = Rendezvous(host="127.0.0.1", port=server.port, job_id="j", timeout=5)
    assert client.token() == token  # from the job, the same file
    assert not server.store.check(["token"])
