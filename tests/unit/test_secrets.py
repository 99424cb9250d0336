"""investigation.secrets: detect-secrets' rules, masked deterministically and cheaply."""

from __future__ import annotations

import pytest

from investigation.secrets import SecretMasker, _rules, mask_marker, private_key_lines

MASKED = [
    ("OPENAI_API_KEY=sk-live-4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c",
     "OPENAI_API_KEY=[secret masked: Secret Keyword]"),
    ("export DB_PASSWORD=hunter2hunter2", "export DB_PASSWORD=[secret masked: Secret Keyword]"),
    ('password = "correct horse battery"', 'password = "[secret masked: Secret Keyword]"'),
    ('{"api_key": "0123456789abcdef"}', '{"api_key": "[secret masked: Secret Keyword]"}'),
    ("aws_access_key_id = AKIAIOSFODNN7EXAMPLE",
     "aws_access_key_id = [secret masked: AWS Access Key]"),
    ("token: ghp_16C7e42F292c6912E7710c838347Ae178B4a", "token: [secret masked: GitHub Token]"),
    ("STRIPE=sk_live_4eC39HqLyjWDarjtT1zdp7dc", "STRIPE=[secret masked: Stripe Access Key]"),
    ("url = postgres://admin:S3cr3tPassw0rd@db:5432/app",
     "url = postgres://admin:[secret masked: Basic Auth Credentials]@db:5432/app"),
    ("hook https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXX ok",
     "hook [secret masked: Slack Token] ok"),
    ("<db_password>hunter2x</db_password>",
     "<db_password>[secret masked: Secret Keyword]</db_password>"),
    ("INFO login user=ada password=hunter2 took 3ms",
     "INFO login user=ada password=[secret masked: Secret Keyword] took 3ms"),
]

KEPT = [
    "    return total - total * percent / 10",
    "password = get_password()",
    "secret_key = settings.SECRET_KEY",
    "password=$DB_PASSWORD",
    'help="the password to use"',
    '{"password": "Password"}',
    "def check_password(password, hashed):",
    "if password == stored_password:",
    'PASSWORD = "changeme"',
    "password: <your password here>",
    "api_key = None",
]


@pytest.mark.parametrize(("line", "shown"), MASKED)
def test_secrets_are_masked(line: str, shown: str) -> None:
    masker = SecretMasker()
    assert masker.mask(line) == (shown, 1)
    assert masker.mask(line) == (shown, 1)  # cached, and the same


@pytest.mark.parametrize("line", KEPT)
def test_references_placeholders_and_code_are_kept(line: str) -> None:
    assert SecretMasker().mask(line) == (line, 0)


def test_every_detect_secrets_rule_but_entropy_and_ip_is_used() -> None:
    names = set(_rules().plugin_names)
    assert {"AWSKeyDetector", "GitHubTokenDetector", "KeywordDetector", "PrivateKeyDetector",
            "SlackDetector", "StripeDetector", "OpenAIDetector", "JwtTokenDetector",
            "BasicAuthDetector", "GitLabTokenDetector"} <= names
    assert not names & {"Base64HighEntropyString", "HexHighEntropyString", "IPPublicDetector"}
    assert len(_rules().detectors) >= 40


def test_private_key_blocks_are_masked_whole() -> None:
    lines = ["x = 1", "-----BEGIN OPENSSH PRIVATE KEY-----", "b3BlbnNzaC1rZXktdjEAAAAA",
             "-----END OPENSSH PRIVATE KEY-----", "y = 2"]
    assert private_key_lines(lines) == {1, 2, 3}
    shown, count = SecretMasker().mask_lines(lines)
    assert shown == ["x = 1", *[mask_marker("Private Key")] * 3, "y = 2"] and count == 3


def test_database_values_under_a_keyword_column_are_masked() -> None:
    masker = SecretMasker()
    assert masker.mask_value("password_hash", "pbkdf2:sha256:abc") == \
        (mask_marker("Secret Keyword"), 1)
    assert masker.mask_value("name", "ada") == ("ada", 0)
    assert masker.mask_value("password", "") == ("", 0)


def test_hostile_lines_stay_linear() -> None:
    """Every rule runs on RE2: lines built to make backtracking engines explode finish
    where detect-secrets' own Python patterns backtrack)."""
    masker = SecretMasker()
    for line in ["/" * 200_000, "password=" + "a" * 200_000, "eyJ" + "a." * 100_000,
                 "aws " + "key " * 50_000, "-----BEGIN " * 20_000]:
        shown, _ = masker.mask(line)
        assert len(shown) <= len(line) + 64


def test_build_scan_reports_names_and_bounds_the_slow_scanner(tmp_path, monkeypatch) -> None:
    """Every line is checked by the linear rules; detect-secrets (super-linear on crafted
    lines) sees a bounded number of short lines; a secret in a file name is reported."""
    from pathlib import Path

    from investigation import secrets

    seen: list[int] = []
    real = secrets._detect_secrets

    def counting(files, wanted):  # type: ignore[no-untyped-def]
        seen.append(sum(len(lines) for lines in wanted.values()))
        return real(files, wanted)

    monkeypatch.setattr(secrets, "_detect_secrets", counting)
    crafted = "var a={password:'abcdef12'};"
    big = tmp_path / "min.js"
    big.write_text((crafted + "\n") * (secrets.MAX_DETECT_SECRETS_LINES + 500)
                   + "x = '" + "password" * 10_000 + "'\n")
    named = tmp_path / "AKIAIOSFODNN7EXAMPLE.txt"
    named.write_text("nothing here\n")
    files = {"source/min.js": big, "source/AKIAIOSFODNN7EXAMPLE.txt": named}
    found = secrets.scan_files(files, {k: Path(v).read_bytes() for k, v in files.items()})
    assert seen == [secrets.MAX_DETECT_SECRETS_LINES]
    lines = {f.line for f in found if f.path == "source/min.js"}
    assert lines == set(range(1, secrets.MAX_DETECT_SECRETS_LINES + 501))
    assert str(secrets.SecretFinding("source/AKIAIOSFODNN7EXAMPLE.txt", 0, "AWS Access Key")) \
        in {str(f) for f in found}
