"""The Files and Batch routes over a real store, through Starlette's test client: the upload limits, each a
4xx naming the limit with nothing kept; a file listed, read and deleted; OpenAI's list pages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from dynamo_cli.batch.api import BatchApi
from dynamo_cli.batch.runner import BatchRunner
from dynamo_cli.batch.sql import Sqlite
from dynamo_cli.batch.store import BatchStore, Result


async def _never(endpoint: str, raw: bytes, left: float) -> Result:
    raise AssertionError("no line runs here")


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BatchStore:
    """A SQLite store, or one on a fresh PostgreSQL database (skipped without a server)."""
    if request.param == "sqlite":
        return BatchStore(tmp_path / "b.db")
    return BatchStore(request.getfixturevalue("postgres_url"))


@pytest.fixture
def client(store: BatchStore) -> TestClient:
    api = BatchApi(store, BatchRunner(store, _never, lambda: 1), max_file_bytes=1000, max_lines=3)
    return TestClient(Starlette(routes=api.routes()))


def _kept(store: BatchStore) -> int:
    """Files' bytes kept anywhere: the SQLite store's directory, or the PostgreSQL store's table."""
    if isinstance(store.database, Sqlite):
        return len(list(store.database.files_dir.iterdir()))
    with store.database.connection() as db:
        return int(db.execute("SELECT COUNT(*) FROM file_data").fetchone()[0])


def _upload(client: TestClient, content: bytes, purpose: str = "batch") -> object:
    return client.post("/v1/files", data={"purpose": purpose}, files={"file": ("in.jsonl", content)})


def test_an_upload_over_a_limit_is_refused_naming_it_and_nothing_is_kept(client: TestClient, store: BatchStore) -> None:
    too_long = _upload(client, b"{}\n" * 4)
    assert too_long.status_code == 400 and "limit of 3 lines" in too_long.json()["error"]["message"]  # type: ignore[attr-defined]
    too_big = _upload(client, b"x" * 1001)
    assert too_big.status_code == 413 and too_big.json()["error"]["param"] == "file"  # type: ignore[attr-defined]
    wrong = _upload(client, b"{}", purpose="fine-tune")
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"  # type: ignore[attr-defined]
    assert client.get("/v1/files").json()["data"] == []
    assert _kept(store) == 0


def test_a_file_is_listed_read_and_deleted(client: TestClient) -> None:
    ids = [_upload(client, f"{{}}\n{i}\n".encode()).json()["id"] for i in range(3)]  # type: ignore[attr-defined]
    page = client.get("/v1/files?limit=2").json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = client.get(f"/v1/files?limit=2&after={page['last_id']}").json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert client.get(f"/v1/files/{ids[1]}/content").content == b"{}\n1\n"
    assert client.delete(f"/v1/files/{ids[1]}").json() == {"id": ids[1], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{ids[1]}").status_code == 404
    assert client.get("/v1/files?limit=0").json()["error"]["param"] == "limit"


def test_a_batch_body_is_checked_field_by_field(client: TestClient) -> None:
    file_id = _upload(client, b"{}\n").json()["id"]  # type: ignore[attr-defined]
    good = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    for change, param in [
        ({"endpoint": "/v1/images"}, "endpoint"),
        ({"completion_window": "7d"}, "completion_window"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input_file_id": "file-none"}, "input_file_id"),
    ]:
        response = client.post("/v1/batches", json=good | change)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, change
    assert client.post("/v1/batches", content=b"[").json()["error"]["param"] == "body"
    created = client.post("/v1/batches", json=good | {"metadata": {"team": "eval"}}).json()
    assert created["status"] == "validating" and created["metadata"] == {"team": "eval"}
    assert created["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    cancelled = client.post(f"/v1/batches/{created['id']}/cancel").json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    assert client.post("/v1/batches/batch_none/cancel").status_code == 404


def test_a_chunked_upload_with_no_length_is_cut_off_at_the_limit(client: TestClient, store: BatchStore) -> None:
    """No Content-Length to refuse up front: the body is counted as it arrives, so a stranger cannot fill the
    disk through the form parser's spooled files."""
    head = b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'

    def body() -> Iterator[bytes]:
        yield head
        for _ in range(200):  # 200 KiB of file: over 1000 bytes + the form's allowance
            yield b"x" * 1024
        yield b"\r\n--b--\r\n"

    response = client.post("/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=b"})
    assert response.status_code == 413 and response.json()["error"]["param"] == "file"
    assert client.get("/v1/files").json()["data"] == []
    assert _kept(store) == 0


async def test_the_body_cap_stops_reading_at_the_limit() -> None:
    from dynamo_cli.batch.api import TooLarge, _capped

    calls = 0

    async def receive() -> dict[str, object]:
        nonlocal calls
        calls += 1
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}

    capped = _capped(receive, 1000, TooLarge("over", param="file"))
    with pytest.raises(TooLarge):
        while True:
            await capped()
    assert calls == 11  # 1,100 bytes read, none after: the rest of the upload is never taken in


def test_a_batch_body_nested_too_deeply_is_a_400(client: TestClient) -> None:
    response = client.post("/v1/batches", content=b"[" * 5000 + b"]" * 5000)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_a_database_out_of_reach_is_a_503_and_the_api_comes_back_with_it(postgres_server: object) -> None:
    """PostgreSQL stopped under a running frontend: a batch call is an OpenAI-shaped 503 naming why, never a 500
    or a hang; once the server is back, the same store serves again (its broken connections reopened)."""
    from tests.postgres import find_postgres, start_postgres

    bindir = find_postgres()
    assert bindir is not None
    pg = start_postgres(bindir)
    try:
        store = BatchStore(pg.new_database())
        api = BatchApi(store, BatchRunner(store, _never, lambda: 1), max_file_bytes=1000, max_lines=3)
        client = TestClient(Starlette(routes=api.routes()))
        assert client.get("/v1/batches").status_code == 200
        pg.stop()
        down = client.get("/v1/batches")
        assert down.status_code == 503 and "batch database is out of reach" in down.json()["error"]["message"]
        assert down.headers["retry-after"] == "5"
        pg.start()
        # a thread's connection broken while the server was down fails its next call once (a 503, which the
        # official client retries), then is reopened: at most one failure per thread of the pool
        codes = [client.get("/v1/batches").status_code for _ in range(12)]
        assert set(codes) <= {200, 503} and codes[-6:] == [200] * 6, codes
    finally:
        pg.remove()
