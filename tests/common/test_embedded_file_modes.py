"""The embedded mode's data is its owner's alone: under LORAPLANE_HOME every file the service creates is
0600 and every directory 0700, whatever the umask; a database left 0644 by an older version is narrowed."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs with the embedded settings (no server URL at all) and a permissive umask; reports the mode of
# everything under the home while the database and the bus are open (their -wal/-shm files exist only then).
SCRIPT = """
import json, os, sys
from pathlib import Path
os.umask(0o022)
from sqlalchemy import text
from common.artifacts import get_artifact_store
from common.bus import get_bus
from common.celery import make_celery
from common.db import get_engine, migrate
from common.settings import get_settings

migrate()
with get_engine().begin() as conn:
    conn.execute(text("INSERT INTO tenants (id, name, weight, max_concurrent_trials, max_trials_per_task, "
                      "max_file_bytes, max_storage_bytes, max_files, created_at) "
                      "VALUES (:id, :id, 1, 1, 1, 1, 1, 1, CURRENT_TIMESTAMP)"), {"id": os.urandom(8).hex()})
get_bus().publish("scheduler", {"type": "hello"})
store = get_artifact_store()
store.put_bytes("files/a.jsonl", b"{}")
staged = store.stage("adapters/task/trial.tar.gz")
staged.write(b"x")
staged.publish()
make_celery(get_settings())
home = Path(os.environ["LORAPLANE_HOME"])
modes = {str(p.relative_to(home)): p.stat().st_mode for p in [home, *home.rglob("*")]}
print(json.dumps(modes))
"""


def _run(home: Path) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR"}}
    env.update(LORAPLANE_HOME=str(home), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return {path: int(mode) for path, mode in json.loads(result.stdout.splitlines()[-1]).items()}


def test_embedded_data_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    home = tmp_path / "a" / "home"  # its parents are made too
    modes = _run(home)
    expected_files = {"loraplane.db", "loraplane.db-wal", "loraplane.db-shm", "bus.db", "bus.db-wal", "bus.db-shm",
                      "artifacts/files/a.jsonl", "artifacts/adapters/task/trial.tar.gz"}
    assert expected_files <= set(modes)
    assert {"artifacts", "artifacts/adapters/task", "broker", "broker/processed"} <= set(modes)
    loose = {path: oct(stat.S_IMODE(mode)) for path, mode in modes.items()
             if stat.S_IMODE(mode) != (0o700 if stat.S_ISDIR(mode) else 0o600)}
    assert loose == {}
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700


def test_a_database_left_world_readable_is_narrowed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _run(home)
    for name in ("loraplane.db", "bus.db"):
        (home / name).chmod(0o644)
    modes = _run(home)
    assert stat.S_IMODE(modes["loraplane.db"]) == stat.S_IMODE(modes["bus.db"]) == 0o600
