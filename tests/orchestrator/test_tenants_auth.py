"""Principals: the keys file (``--api-keys``), ``--api-key``/``--admin-key``, the gateway's tenant
header, and the middleware that resolves them (unit tests on ASGI scopes; the real-server tests
are in tests/orchestrator/test_tenants_server.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from contract.errors import ErrorCode
from orchestrator.tenants.gateway import TenantHeader, parse_networks
from orchestrator.tenants.keys import KeyRing, KeysFileError, parse_keys, read_keys_file
from orchestrator.tenants.principal import DEFAULT_TENANT, Principal
from orchestrator.web.auth import Authenticator, require_admin
from orchestrator.web.errors import ApiError

KEYS = """\
# tenants of the test
alpha-key   alpha
beta-key    beta        # a trailing comment
root-key    ops   admin

sha256:{digest} gamma user
"""


def keys_text() -> str:
    return KEYS.format(digest=hashlib.sha256(b"gamma-key").hexdigest())


def scope(headers: dict[str, str] | None = None, query: str = "", client: str = "127.0.0.1") -> dict[str, object]:
    return {
        "type": "http",
        "path": "/v1/chat/completions",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "query_string": query.encode(),
        "client": (client, 50000),
    }


def test_keys_file_names_tenants_and_roles() -> None:
    keys = parse_keys(keys_text(), "keys.txt")
    ring = {d: p for d, p in keys.items()}
    assert ring[hashlib.sha256(b"alpha-key").digest()] == Principal("alpha", admin=False)
    assert ring[hashlib.sha256(b"beta-key").digest()] == Principal("beta", admin=False)
    assert ring[hashlib.sha256(b"root-key").digest()] == Principal("ops", admin=True)
    # a sha256: line is the digest of the key a client presents: the file holds no secret
    assert ring[hashlib.sha256(b"gamma-key").digest()] == Principal("gamma", admin=False)
    assert len(keys) == 4


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("lonely-key", "expected 'KEY TENANT'"),
        ("k t admin extra", "expected 'KEY TENANT'"),
        ("k t root", "the role is 'user' or 'admin'"),
        ("k bad/tenant", "bad tenant name"),
        ("k " + "t" * 65, "bad tenant name"),
        ("sha256:abcd t", "64 hexadecimal digits"),
        ("sha256:" + "z" * 64 + " t", "64 hexadecimal digits"),
    ],
)
def test_a_bad_line_is_refused_with_its_file_and_line(line: str, why: str) -> None:
    with pytest.raises(KeysFileError) as err:
        parse_keys(f"# first line\nok-key ok\n{line}\n", "keys.txt")
    assert str(err.value).startswith("keys.txt:3: ") and why in str(err.value), err.value


def test_a_refused_line_does_not_echo_its_key() -> None:
    for line in ("supersecret-key t root", "supersecret-key bad/t", "supersecret-key t admin x"):
        with pytest.raises(KeysFileError) as err:
            parse_keys(line, "keys.txt")
        assert "supersecret" not in str(err.value), err.value


def test_a_key_listed_twice_is_refused() -> None:
    digest = hashlib.sha256(b"same").hexdigest()
    with pytest.raises(KeysFileError, match=r"keys.txt:2: this key is listed twice"):
        parse_keys(f"same a\nsha256:{digest} b\n", "keys.txt")


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="cannot read the keys file"):
        read_keys_file(tmp_path / "missing.txt")


def test_reload_takes_a_good_file_and_keeps_the_keys_over_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("old-key alpha\n")
    ring = KeyRing(keys_file=path)
    assert ring.lookup(["old-key"]) == Principal("alpha")
    path.write_text("new-key beta admin\n")
    assert ring.reload() is True
    assert ring.lookup(["old-key"]) is None and ring.lookup(["new-key"]) == Principal("beta", admin=True)
    path.write_text("new-key beta admin\nbroken\n")
    assert ring.reload() is False  # logged; the keys in use stay
    assert ring.lookup(["new-key"]) == Principal("beta", admin=True)


def test_single_api_key_is_the_default_tenant_and_admin_only_when_alone() -> None:
    alone = KeyRing(api_key="k")
    assert alone.lookup(["k"]) == Principal(DEFAULT_TENANT, admin=True)
    with_admin = KeyRing(api_key="k", admin_key="a")
    assert with_admin.lookup(["k"]) == Principal(DEFAULT_TENANT, admin=False)
    assert with_admin.lookup(["a"]) == Principal(DEFAULT_TENANT, admin=True)
    assert not KeyRing().configured and alone.configured


def test_the_middleware_resolves_keys_from_every_place_a_client_puts_them(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(keys_text())
    auth = Authenticator(KeyRing(keys_file=path))
    assert auth.resolve(scope({"Authorization": "Bearer alpha-key"})) == Principal("alpha")
    assert auth.resolve(scope({"X-Api-Key": "beta-key"})) == Principal("beta")
    assert auth.resolve(scope(query="api_key=gamma-key")) == Principal("gamma")
    assert auth.resolve(scope({"X-Admin-Key": "root-key"})) == Principal("ops", admin=True)
    for bad in (scope(), scope({"Authorization": "Bearer wrong"}), scope({"Authorization": "alpha-key"})):
        with pytest.raises(ApiError) as err:
            auth.resolve(bad)
        assert err.value.code == ErrorCode.UNAUTHORIZED


def test_no_keys_is_one_tenant_with_the_admin_role() -> None:
    auth = Authenticator(KeyRing())
    assert auth.resolve(scope()) == Principal(DEFAULT_TENANT, admin=True)
    require_admin({"state": {"slotserve.principal": auth.resolve(scope())}})


def test_admin_endpoints_refuse_a_user_principal() -> None:
    with pytest.raises(ApiError) as err:
        require_admin({"state": {"slotserve.principal": Principal("alpha")}})
    assert err.value.code == ErrorCode.UNAUTHORIZED
    with pytest.raises(ApiError):
        require_admin({})  # nothing resolved: no role
    require_admin({"state": {"slotserve.principal": Principal("ops", admin=True)}})


def test_the_tenant_header_is_believed_only_with_the_secret_or_from_listed_addresses() -> None:
    header = TenantHeader("X-Tenant-Id", "s3cret", parse_networks(("10.0.0.0/8", "192.168.1.7")))
    auth = Authenticator(KeyRing(keys_file=None, api_key="k", admin_key="a"), header)
    assert auth.resolve(scope({"X-Tenant-Id": "acme", "X-Gateway-Secret": "s3cret"})) == Principal("acme")
    assert auth.resolve(scope({"X-Tenant-Id": "acme"}, client="10.2.3.4")) == Principal("acme")
    assert auth.resolve(scope({"X-Tenant-Id": "acme"}, client="192.168.1.7")) == Principal("acme")
    refused = [
        scope({"X-Tenant-Id": "acme"}),  # from 127.0.0.1, no secret
        scope({"X-Tenant-Id": "acme", "X-Gateway-Secret": "wrong"}),
        scope({"X-Tenant-Id": "acme"}, client="192.168.1.8"),
        scope({"X-Tenant-Id": "bad tenant!", "X-Gateway-Secret": "s3cret"}),
        scope({"X-Gateway-Secret": "s3cret"}),  # no tenant named and no key: keys are configured
    ]
    for s in refused:
        with pytest.raises(ApiError) as err:
            auth.resolve(s)
        assert err.value.code == ErrorCode.UNAUTHORIZED, s
    # a valid key wins over the header, whoever sends it: the key names its own tenant
    assert auth.resolve(scope({"X-Tenant-Id": "acme", "Authorization": "Bearer k"})) == Principal(DEFAULT_TENANT)


def test_a_tenant_header_without_whom_to_believe_is_never_believed() -> None:
    auth = Authenticator(KeyRing(), TenantHeader("X-Tenant-Id"))
    with pytest.raises(ApiError):
        auth.resolve(scope({"X-Tenant-Id": "acme", "X-Gateway-Secret": ""}, client="10.0.0.1"))
    # without keys and without the header: the default tenant, as a user (the gateway decides roles)
    assert auth.resolve(scope()) == Principal(DEFAULT_TENANT, admin=False)
