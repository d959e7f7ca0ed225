"""Secrets the database keeps, encrypted at rest: webhook signing secrets, today.

Unlike an API key (only ever compared, so stored hashed), a webhook secret must be read back: the sender signs
every delivery with it (HMAC needs the secret itself). So it is encrypted with Fernet (AES-128-CBC and
HMAC-SHA256, from `cryptography`) under a key the database does not hold: a copy of the database (a backup, a
read replica, an SQL injection) does not give away the secrets that let anyone forge a tenant's deliveries.

The key comes from `LORAPLANE_SECRET_KEY`: one or more Fernet keys, comma-separated. The first encrypts; every
one decrypts (`MultiFernet`), which is what rotation needs: put a new key first, restart, run
`loraplane rotate-secrets` (re-encrypts every row under the first key), then drop the old key. In the embedded
mode an unset key is generated into LORAPLANE_HOME on first start (a 0600 file), so `loraplane up` needs no
setting; in the distributed mode the API and the scheduler must share the key, so an unset one is an error at
start, naming the setting (two processes generating their own would each fail to read the other's rows).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from common.private_files import FILE_MODE, private_dir
from common.settings import Settings, get_settings

log = logging.getLogger(__name__)

SETTING = "LORAPLANE_SECRET_KEY"
KEY_FILE = "secret.key"  # under LORAPLANE_HOME, embedded mode only
GENERATE_HINT = ("generate one with: python -c 'from cryptography.fernet import Fernet; "
                 "print(Fernet.generate_key().decode())'")


class SecretKeyError(RuntimeError):
    """The key setting is missing or malformed (never says the key itself)."""


class SecretUnreadable(Exception):
    """A stored value that no configured key decrypts (a key was dropped too early, or the keys differ)."""


class SecretBox:
    """Encrypts and decrypts short strings under the configured keys."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise SecretKeyError(f"{SETTING} holds no key; {GENERATE_HINT}")
        fernets: list[Fernet] = []
        for i, key in enumerate(keys, 1):
            try:
                fernets.append(Fernet(key.strip()))
            except ValueError:
                raise SecretKeyError(f"{SETTING}: key {i} of {len(keys)} is not a Fernet key (32 bytes, url-safe "
                                     f"base64); {GENERATE_HINT}") from None
        self._current = fernets[0]
        self._all = MultiFernet(fernets)

    @classmethod
    def parse(cls, text: str) -> SecretBox:
        return cls([k for k in (part.strip() for part in text.split(",")) if k])

    def encrypt(self, plaintext: str) -> str:
        return self._current.encrypt(plaintext.encode()).decode("ascii")

    def decrypt(self, token: str) -> str:
        try:
            return self._all.decrypt(token.encode("ascii")).decode()
        except (InvalidToken, UnicodeError):
            raise SecretUnreadable("no key of LORAPLANE_SECRET_KEY decrypts this value") from None

    def is_current(self, token: str) -> bool:
        """Encrypted under the first key (nothing to rotate)."""
        try:
            self._current.decrypt(token.encode("ascii"))
        except (InvalidToken, UnicodeError):
            return False
        return True

    def rotate(self, token: str) -> str:
        """The same secret, encrypted under the first key."""
        try:
            return self._all.rotate(token.encode("ascii")).decode("ascii")
        except (InvalidToken, UnicodeError):
            raise SecretUnreadable("no key of LORAPLANE_SECRET_KEY decrypts this value") from None


def embedded_key(home: Path) -> str:
    """The embedded home's key: read from `home/secret.key`, made there (0600) by whichever process comes first.
    Written whole to a temporary file and linked into place, so a process starting at the same moment (`loraplane
    api` beside `loraplane scheduler`) reads either no file or the whole key, and both end up with the same one."""
    path = private_dir(home) / KEY_FILE
    if not path.exists():
        tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
        try:
            os.write(fd, Fernet.generate_key() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process linked its key first: then that one is the key
            log.warning("generated %s into %s: keep it with the database (backups too); without it the stored "
                        "webhook secrets cannot be read", SETTING, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


def key_text(settings: Settings) -> str:
    """The configured keys: the setting, else the embedded home's file; in the distributed mode, unset is an
    error that says what to do."""
    if settings.secret_key is not None and settings.secret_key.get_secret_value().strip():
        return settings.secret_key.get_secret_value()
    if settings.embedded:
        return embedded_key(settings.home)
    raise SecretKeyError(
        f"{SETTING} is not set. In the distributed mode (DATABASE_URL set) the API, the scheduler and the migration "
        f"must share one key to read each other's encrypted webhook secrets; set the same {SETTING} for each ("
        f"{GENERATE_HINT}).")


@lru_cache
def get_secret_box() -> SecretBox:
    """The process's box, from its settings (read once, like the settings)."""
    return SecretBox.parse(key_text(get_settings()))
