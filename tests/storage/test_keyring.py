"""The key ring: AES-256-GCM seal/open with associated data, the master key file, and tenant data
keys wrapped by the master key (unwrapped only with the right key and tenant)."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from storage.keyring import (
    BLOB_MAGIC,
    NONCE_BYTES,
    AuthenticationFailed,
    BadMasterKey,
    MasterKey,
    NoDataKey,
    TenantKeys,
    blob_aad,
    key_id,
    load_master_key,
    open_sealed,
    parse_master_key,
    seal,
)
from storage.metadata_store import MetadataStore
from tests.conftest import MASTER_KEY

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
AAD = blob_aad("tn_a", "s_1", "fp-a", 1)


def test_seal_and_open_round_trip() -> None:
    blob = seal(KEY, b"payload" * 100, AAD)
    assert blob.startswith(BLOB_MAGIC)
    assert len(blob) == len(BLOB_MAGIC) + NONCE_BYTES + 700 + 16
    assert open_sealed(KEY, blob, AAD) == b"payload" * 100


def test_two_seals_of_the_same_plaintext_use_different_nonces() -> None:
    first, second = seal(KEY, b"same", AAD), seal(KEY, b"same", AAD)
    head = len(BLOB_MAGIC)
    assert first[head : head + NONCE_BYTES] != second[head : head + NONCE_BYTES]
    assert first != second
    assert open_sealed(KEY, first, AAD) == open_sealed(KEY, second, AAD) == b"same"


@pytest.mark.parametrize(
    "aad",
    [
        blob_aad("tn_b", "s_1", "fp-a", 1),
        blob_aad("tn_a", "s_2", "fp-a", 1),
        blob_aad("tn_a", "s_1", "fp-b", 1),
        blob_aad("tn_a", "s_1", "fp-a", 2),
    ],
    ids=["tenant", "name", "fingerprint", "format-version"],
)
def test_associated_data_binds_tenant_name_fingerprint_and_version(aad: bytes) -> None:
    blob = seal(KEY, b"cache bytes", AAD)
    with pytest.raises(AuthenticationFailed):
        open_sealed(KEY, blob, aad)


def test_tampered_truncated_and_wrong_key_blobs_fail_authentication() -> None:
    blob = seal(KEY, b"cache bytes" * 10, AAD)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x01
    cases = {
        "flipped byte": (KEY, bytes(flipped)),
        "truncated": (KEY, blob[:-1]),
        "truncated to header": (KEY, blob[: len(BLOB_MAGIC) + NONCE_BYTES + 3]),
        "bad magic": (KEY, b"XXXXX" + blob[5:]),
        "empty": (KEY, b""),
        "wrong key": (OTHER_KEY, blob),
    }
    for name, (key, data) in cases.items():
        with pytest.raises(AuthenticationFailed):
            open_sealed(key, data, AAD)
            pytest.fail(f"{name} opened")


@pytest.mark.parametrize(
    "text", ["", "not base64!", base64.b64encode(b"short").decode(), base64.b64encode(bytes(33)).decode()]
)
def test_parse_master_key_rejects_anything_but_32_bytes(text: str) -> None:
    with pytest.raises(BadMasterKey):
        parse_master_key(text)


def test_parse_master_key_accepts_32_bytes_with_whitespace() -> None:
    assert len(parse_master_key(f"  {MASTER_KEY}\n")) == 32


def test_master_key_file_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = load_master_key(home, None)
    path = home / "master.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not first.from_env
    assert first.id == key_id(first.key)
    again = load_master_key(home, None)
    assert again.key == first.key
    assert [p.name for p in home.iterdir()] == ["master.key"]


def test_master_key_from_the_environment_writes_no_file(tmp_path: Path) -> None:
    master = load_master_key(tmp_path, MASTER_KEY)
    assert master.from_env and master.key == parse_master_key(MASTER_KEY)
    assert list(tmp_path.iterdir()) == []


def test_a_staged_key_is_used_only_when_the_database_names_it(tmp_path: Path) -> None:
    """`master.key.next` is what a rotation wrote before its commit: kept only if the commit happened."""
    current = load_master_key(tmp_path, None)
    staged_raw = OTHER_KEY
    staged = tmp_path / "master.key.next"
    staged.write_text(base64.b64encode(staged_raw).decode())
    # Crash before the commit: the database still names the current key; the staged key goes.
    assert load_master_key(tmp_path, None, {current.id}).key == current.key
    assert not staged.exists()
    # Crash after the commit: the database names the staged key; it replaces master.key.
    staged.write_text(base64.b64encode(staged_raw).decode())
    os.chmod(staged, 0o600)
    assert load_master_key(tmp_path, None, {key_id(staged_raw)}).key == staged_raw
    assert not staged.exists()
    assert parse_master_key((tmp_path / "master.key").read_text()) == staged_raw
    assert stat.S_IMODE((tmp_path / "master.key").stat().st_mode) == 0o600


def tenant_keys(metadata: MetadataStore, raw: bytes) -> TenantKeys:
    return TenantKeys(metadata, MasterKey(raw, key_id(raw), from_env=True))


def test_data_keys_unwrap_only_with_their_master_key_and_tenant(metadata: MetadataStore) -> None:
    keys = tenant_keys(metadata, KEY)
    wrapped = keys.new_wrapped_key("tn_a")
    metadata.create_tenant(tenant_id="tn_a", name="a", wrapped_data_key=wrapped, master_key_id=key_id(KEY))
    data_key = keys.data_key("tn_a")
    assert len(data_key) == 32
    # A fresh ring (restart) unwraps the same key from the database.
    assert tenant_keys(metadata, KEY).data_key("tn_a") == data_key
    # Another master key does not unwrap it.
    with pytest.raises(AuthenticationFailed):
        tenant_keys(metadata, OTHER_KEY).data_key("tn_a")
    # A wrapped key copied to another tenant does not unwrap there.
    metadata.create_tenant(tenant_id="tn_b", name="b", wrapped_data_key=wrapped, master_key_id=key_id(KEY))
    with pytest.raises(AuthenticationFailed):
        tenant_keys(metadata, KEY).data_key("tn_b")


def test_a_tenant_without_a_data_key_has_no_key(metadata: MetadataStore) -> None:
    metadata.create_tenant(tenant_id="tn_a", name="a")
    with pytest.raises(NoDataKey):
        tenant_keys(metadata, KEY).data_key("tn_a")
    with pytest.raises(NoDataKey):
        tenant_keys(metadata, KEY).data_key("tn_missing")


def test_rewrap_all_wraps_the_same_data_keys_under_the_new_master(metadata: MetadataStore) -> None:
    keys = tenant_keys(metadata, KEY)
    for tenant in ("tn_a", "tn_b"):
        metadata.create_tenant(
            tenant_id=tenant, name=tenant, wrapped_data_key=keys.new_wrapped_key(tenant), master_key_id=key_id(KEY)
        )
    before = {t: tenant_keys(metadata, KEY).data_key(t) for t in ("tn_a", "tn_b")}
    new_master = MasterKey(OTHER_KEY, key_id(OTHER_KEY), from_env=True)
    rewrapped = keys.rewrap_all(new_master)
    assert set(rewrapped) == {"tn_a", "tn_b"}
    assert {ident for _, ident in rewrapped.values()} == {new_master.id}
    metadata.set_tenant_keys(wrapped=rewrapped)
    assert {t: tenant_keys(metadata, OTHER_KEY).data_key(t) for t in before} == before
    with pytest.raises(AuthenticationFailed):
        tenant_keys(metadata, KEY).data_key("tn_a")
