"""Plane URLs parse into typed options, refuse what is ambiguous, and never show a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.runtime.urls import EtcdTarget, NatsTarget, TlsFiles, parse_etcd_target, parse_nats_target, redact_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            "etcd://a:1,b",
            EtcdTarget(endpoints=(("a", 1), ("b", 2379)), redacted="etcd://a:1,b"),
            id="plain-two-members",
        ),
        pytest.param(
            "etcd://root:p%40ss@h:2379",
            EtcdTarget(endpoints=(("h", 2379),), user="root", password="p@ss", redacted="etcd://root:***@h:2379"),
            id="user-password-percent-encoded",
        ),
        pytest.param(
            "etcds://h",
            EtcdTarget(endpoints=(("h", 2379),), tls=TlsFiles(), redacted="etcds://h"),
            id="etcds-turns-tls-on-with-the-system-cas",
        ),
        pytest.param(
            "etcd://h?ca=/c.pem&cert=/me.pem&key=/me.key",
            EtcdTarget(
                endpoints=(("h", 2379),),
                tls=TlsFiles(ca="/c.pem", cert="/me.pem", key="/me.key"),
                redacted="etcd://h?ca=/c.pem&cert=/me.pem&key=/me.key",
            ),
            id="query-files-turn-mutual-tls-on",
        ),
    ],
)
def test_etcd_urls_parse_into_targets(url: str, expected: EtcdTarget) -> None:
    assert parse_etcd_target(url) == expected


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            "nats://a,b:5",
            NatsTarget(servers=("nats://a:4222", "nats://b:5"), redacted="nats://a,b:5"),
            id="plain-two-servers",
        ),
        pytest.param(
            "nats://u:pw@h:4222",
            NatsTarget(servers=("nats://h:4222",), user="u", password="pw", redacted="nats://u:***@h:4222"),
            id="user-password",
        ),
        pytest.param(
            "nats://tok@h", NatsTarget(servers=("nats://h:4222",), token="tok", redacted="nats://***@h"), id="token"
        ),
        pytest.param(
            "nats://h?creds=/x/u.creds",
            NatsTarget(servers=("nats://h:4222",), creds="/x/u.creds", redacted="nats://h?creds=/x/u.creds"),
            id="creds-file",
        ),
        pytest.param(
            "tls://h?ca=/c.pem",
            NatsTarget(servers=("tls://h:4222",), tls=TlsFiles(ca="/c.pem"), redacted="tls://h?ca=/c.pem"),
            id="tls-with-a-ca",
        ),
    ],
)
def test_nats_urls_parse_into_targets(url: str, expected: NatsTarget) -> None:
    assert parse_nats_target(url) == expected


def test_passwords_and_tokens_come_from_files_stripped_of_the_newline(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    (tmp_path / "tok").write_text("t0ken\n")
    url = f"etcd://root@h?password-file={tmp_path / 'pw'}"
    etcd = parse_etcd_target(url)
    assert (etcd.user, etcd.password, etcd.redacted) == ("root", "from-file", url)
    assert parse_nats_target(f"nats://u@h?password-file={tmp_path / 'pw'}").password == "from-file"
    assert parse_nats_target(f"nats://h?token-file={tmp_path / 'tok'}").token == "t0ken"


def test_secrets_stay_out_of_repr() -> None:
    text = repr(parse_etcd_target("etcd://root:hunter2@h")) + repr(parse_nats_target("nats://sekrit@h"))
    assert "hunter2" not in text and "sekrit" not in text


@pytest.mark.parametrize(
    ("parse", "url", "message"),
    [
        pytest.param(parse_etcd_target, "http://h", "must start with etcd:// or etcds://", id="etcd-scheme"),
        pytest.param(parse_etcd_target, "etcd://", "names no server", id="etcd-no-host"),
        pytest.param(parse_etcd_target, "etcd://h:xx", "'h:xx' is not HOST:PORT", id="etcd-bad-port"),
        pytest.param(parse_etcd_target, "etcd://root@h", "names user 'root' without a password", id="etcd-no-pw"),
        pytest.param(parse_etcd_target, "etcd://:pw@h", "has a password but no user", id="etcd-no-user"),
        pytest.param(
            parse_etcd_target,
            "etcd://h?cafile=/x",
            "unknown option 'cafile'; known options: ca, cert",
            id="unknown-option",
        ),
        pytest.param(parse_etcd_target, "etcd://h?cert=/c", "give cert and key together", id="cert-without-key"),
        pytest.param(parse_nats_target, "nats://h?ca=", "option 'ca' needs a value", id="empty-option"),
        pytest.param(
            parse_nats_target,
            "nats://u:p@h?creds=/c",
            "more than one of user/password, token and creds",
            id="two-kinds-of-credentials",
        ),
        pytest.param(
            parse_nats_target,
            "nats://h?token-file=/no/such/file",
            "cannot read token-file '/no/such/file'",
            id="unreadable-file",
        ),
    ],
)
def test_bad_urls_are_config_errors_that_say_what_to_fix(parse, url: str, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        parse(url)


def test_a_config_error_never_shows_the_password() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_nats_target("nats://u:hunter2@h?bogus=1")
    assert "hunter2" not in str(caught.value) and "nats://u:***@h?bogus=1" in str(caught.value)


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        pytest.param("etcd://h:1", "etcd://h:1", id="nothing-to-hide"),
        pytest.param("etcd://u:p@h?ca=/x", "etcd://u:***@h?ca=/x", id="password"),
        pytest.param("tls://tok@h", "tls://***@h", id="nats-token"),
        pytest.param("etcd://u@h", "etcd://u@h", id="etcd-user-alone-is-a-name"),
    ],
)
def test_redaction_hides_passwords_and_tokens_only(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted
