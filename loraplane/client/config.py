"""Where the client finds the API and its credentials.

Each setting is taken from the first place that has it:

    base URL     argument  >  LORAPLANE_API_URL  >  config file  >  http://127.0.0.1:8000 (`make up`)
    API key      argument  >  LORAPLANE_API_KEY  >  config file
    admin token  argument  >  LORAPLANE_ADMIN_TOKEN

The config file is what `loraplane login` writes: JSON `{"api_url": ..., "api_key": ...}` at
`$LORAPLANE_CONFIG`, else `$XDG_CONFIG_HOME/loraplane/config.json` (`~/.config/...`; `%APPDATA%` on
Windows), readable by its owner only (0600, in a 0700 directory).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_API_URL = "http://127.0.0.1:8000"
URL_ENV = "LORAPLANE_API_URL"
KEY_ENV = "LORAPLANE_API_KEY"
ADMIN_ENV = "LORAPLANE_ADMIN_TOKEN"
CONFIG_ENV = "LORAPLANE_CONFIG"


@dataclass(frozen=True)
class Settings:
    base_url: str
    api_key: str | None
    admin_token: str | None


def config_path() -> Path:
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser()
    if sys.platform == "win32" and os.environ.get("APPDATA"):
        base = Path(os.environ["APPDATA"])
    else:
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "loraplane" / "config.json"


def read_config(path: Path | None = None) -> dict[str, str]:
    """The stored settings; {} when there is no file. A file that is not a JSON object is an error."""
    path = path or config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"the config file {path} is not a JSON object")
    return {k: str(v) for k, v in data.items() if v is not None}


def write_config(api_url: str, api_key: str, path: Path | None = None) -> Path:
    """Replaces the config file atomically; it is created 0600 (never readable by others, not even briefly)."""
    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config-", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"api_url": api_url, "api_key": api_key}, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def resolve(
    base_url: str | None = None, api_key: str | None = None, admin_token: str | None = None,
    *, config_file: Path | None = None,
) -> Settings:
    """The settings from the arguments, else the environment, else the config file (see the module docstring)."""
    url = base_url or os.environ.get(URL_ENV)
    key = api_key or os.environ.get(KEY_ENV)
    if not url or not key:
        stored = read_config(config_file)
        url = url or stored.get("api_url")
        key = key or stored.get("api_key")
    return Settings(
        base_url=(url or DEFAULT_API_URL).rstrip("/"),
        api_key=key or None,
        admin_token=admin_token or os.environ.get(ADMIN_ENV) or None,
    )
