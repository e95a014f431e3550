"""`dyn k8s render`'s batch database: a SQLite one on a ReadWriteOnce claim the frontend pod mounts read-write
(its Deployment recreated, never surged); a PostgreSQL one passed through, its password from a Secret as
PGPASSWORD; none with `--batch-db off`."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_cli.errors import ConfigError
from tests.k8s.render_cases import (
    BATCH_DB_PASSWORD,
    BATCH_DB_URL,
    Files,
    by_kind,
    cases,
    deployment,
    dump,
    make_files,
    render,
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return make_files(tmp_path_factory.mktemp("batch-files"))


def _frontend(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The frontend's Deployment spec, pod spec and container."""
    spec = deployment(objects, "dyn-frontend")["spec"]
    pod = spec["template"]["spec"]
    return spec, pod, pod["containers"][0]


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return str(args[args.index(flag) + 1])


@pytest.mark.parametrize(
    ("flags", "storage", "storage_class"),
    [
        pytest.param([], "10Gi", None, id="the default SQLite file"),
        pytest.param(["--batch-db", "./state/batches.db"], "10Gi", None, id="a relative path"),
        pytest.param(
            ["--batch-db", "/srv/dyn/b.db", "--batch-storage", "50Gi", "--storage-class", "fast-ssd"],
            "50Gi",
            "fast-ssd",
            id="an absolute path, a size and a class",
        ),
    ],
)
def test_a_sqlite_batch_db_is_on_a_claim_the_frontend_mounts_read_write_where_its_args_point(
    flags: list[str], storage: str, storage_class: str | None
) -> None:
    objects, _ = render(flags)
    (claim,) = by_kind(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "dyn-batches"
    assert claim["metadata"]["labels"]["app.kubernetes.io/component"] == "frontend"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == storage
    assert claim["spec"].get("storageClassName") == storage_class

    spec, pod, container = _frontend(objects)
    db = _arg(container, "--batch-db")
    assert db == "/var/lib/dyn/batches/batches.db"  # the local path is replaced by the claim's
    (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": "dyn-batches"}  # not readOnly
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount == {"name": volume["name"], "mountPath": posixpath.dirname(db)}  # the db and its files dir
    assert not mount.get("readOnly")

    # RWO: the old pod must be gone before the new one starts, never a surge pod on another node
    assert spec["strategy"] == {"type": "Recreate"}
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 10001
    assert objects.index(claim) < objects.index(deployment(objects, "dyn-frontend"))
    for other in by_kind(objects, "Deployment"):
        if other["metadata"]["name"] != "dyn-frontend":
            assert other["spec"]["strategy"]["type"] == "RollingUpdate"


def test_a_postgres_batch_db_passes_through_with_pgpassword_from_the_secret_the_kubectl_line_makes(
    files: Files,
) -> None:
    objects, stderr = render(cases(files)["batch-postgres"])
    assert not by_kind(objects, "PersistentVolumeClaim")
    spec, pod, container = _frontend(objects)
    assert _arg(container, "--batch-db") == BATCH_DB_URL
    env = {e["name"]: e for e in container["env"]}
    assert env["PGPASSWORD"] == {
        "name": "PGPASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "dyn-batch-db", "key": "password"}},
    }
    assert f"kubectl -n dyn create secret generic dyn-batch-db --from-file=password={files.batch_db_password}" in (
        stderr.splitlines()
    )
    assert BATCH_DB_PASSWORD not in dump(objects) and not by_kind(objects, "Secret")
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert all("persistentVolumeClaim" not in v for v in pod["volumes"])
    worker = deployment(objects, "dyn-worker")["spec"]["template"]["spec"]["containers"][0]
    assert "PGPASSWORD" not in {e["name"] for e in worker["env"]}  # only the frontend opens the database


def test_a_postgres_batch_db_without_a_password_file_gets_no_pgpassword() -> None:
    objects, stderr = render(["--batch-db", "postgres://dyn@pg.infra/batches?sslmode=verify-full"])
    _, _, container = _frontend(objects)
    assert _arg(container, "--batch-db") == "postgres://dyn@pg.infra/batches?sslmode=verify-full"
    assert "PGPASSWORD" not in {e["name"] for e in container["env"]}
    assert "dyn-batch-db" not in stderr


def test_batch_db_off_renders_no_claim_and_keeps_the_rolling_update() -> None:
    objects, stderr = render(["--batch-db", "off"])
    assert not by_kind(objects, "PersistentVolumeClaim")
    spec, pod, container = _frontend(objects)
    assert _arg(container, "--batch-db") == "off"
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert "PGPASSWORD" not in {e["name"] for e in container["env"]} and "batch" not in stderr


def test_out_puts_the_claim_in_the_frontends_file(tmp_path: Path) -> None:
    render(["--out", str(tmp_path)])
    kinds = sorted(o["kind"] for o in yaml.safe_load_all((tmp_path / "frontend.yaml").read_text()))
    assert kinds == ["Deployment", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--batch-db", "postgresql://dyn:hunter2@pg/b"], "holds a password", id="password in the URL"),
        pytest.param(["--batch-db", "postgres://dyn@pg/b?password=x"], "holds a password", id="password= in the query"),
        pytest.param(["--batch-db-password-file", "PW"], "PostgreSQL --batch-db", id="a file with SQLite"),
        pytest.param(["--batch-db", "off", "--batch-db-password-file", "PW"], "is 'off'", id="a file with off"),
        pytest.param(["--batch-storage", "10GB"], "not a Kubernetes quantity", id="a bad size"),
        pytest.param(["--batch-db", BATCH_DB_URL, "--batch-db-password-file", "NL"], "line break", id="a newline"),
        pytest.param(["--batch-db", BATCH_DB_URL, "--batch-db-password-file", "EMPTY"], "is empty", id="empty"),
        pytest.param(["--batch-db", BATCH_DB_URL, "--batch-db-password-file", "NONE"], "cannot be read", id="none"),
    ],
)
def test_bad_batch_input_is_a_config_error_naming_it(args: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "PW").write_text("pw")
    (tmp_path / "NL").write_text("pw\n")
    (tmp_path / "EMPTY").write_text("")
    paths = {name: str(tmp_path / name) for name in ("PW", "NL", "EMPTY", "NONE")}
    with pytest.raises(ConfigError, match=message):
        render([paths.get(arg, arg) for arg in args])
