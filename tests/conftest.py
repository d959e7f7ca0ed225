"""Suite-wide set-up: real PostgreSQL and Redis, a fresh database per run, offline model loading.

The environment is fixed here, before any of our modules is imported, because settings are read once.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import bindparam, create_engine, text

from tests.services import MissingService, find_postgres, find_redis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if shutil.which("nvidia-smi") is None:
    # No GPU: the Triton LoRA kernels run (slowly, on CPU tensors) in Triton's interpreter. It is read when
    # the kernels are defined, so it must be set before kernels.triton_lora is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

RUN_ID = uuid.uuid4().hex[:8]

# The servers are found once per run: the processes pytest-xdist starts (`make test` runs the suite in two) inherit
# them from the one that started them, whose DATABASE_URL below already names its own (never created) database.
if "LORAPLANE_TEST_SERVER_URL" in os.environ:
    _SERVER_URL, REDIS_URL = os.environ["LORAPLANE_TEST_SERVER_URL"], os.environ["LORAPLANE_TEST_REDIS_URL"]
else:
    try:
        _SERVER_URL = find_postgres()
        REDIS_URL = find_redis()
    except MissingService as exc:
        raise pytest.UsageError(f"loraplane tests need PostgreSQL and Redis: {exc}") from exc
    os.environ.update({"LORAPLANE_TEST_SERVER_URL": _SERVER_URL, "LORAPLANE_TEST_REDIS_URL": REDIS_URL})


def _with_database(url: str, name: str) -> str:
    base, _, _old = url.rpartition("/")
    return f"{base}/{name}"


def _normalise(url: str) -> str:
    if url.startswith(("postgres://", "postgresql://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


SERVER_URL = _normalise(_SERVER_URL)
DB_NAME = f"loraplane_test_{RUN_ID}"
DATABASE_URL = _with_database(SERVER_URL, DB_NAME)
HOME = Path(os.environ.get("LORAPLANE_TEST_HOME", f"/tmp/loraplane-test-{RUN_ID}"))
# Models are materialised once per machine, not once per run.
MODEL_CACHE = Path(os.environ.get("LORAPLANE_TEST_MODEL_CACHE", "/tmp/loraplane-test-models"))
ADMIN_TOKEN = "test-admin-token"

os.environ.update(
    {
        "DATABASE_URL": DATABASE_URL,
        "REDIS_URL": REDIS_URL,
        "CELERY_BROKER_URL": REDIS_URL,
        "LORAPLANE_HOME": str(HOME),
        "LORAPLANE_ARTIFACT_DIR": str(HOME / "artifacts"),
        "LORAPLANE_MODEL_CACHE": str(MODEL_CACHE),
        "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN,
        "LORAPLANE_NAMESPACE": f"lp-test-{RUN_ID}",
        # The distributed mode's processes share one key for the secrets the database keeps (the API and the
        # scheduler refuse to start without it): one for the run, inherited by every process a test starts.
        "LORAPLANE_SECRET_KEY": Fernet.generate_key().decode(),
        # One torch thread in each worker (and pack and rank) process the suite starts, not the default 2: beside the
        # API, the scheduler and the test itself on a two-core machine, the tiny model trained ~5x slower with two
        # threads waiting for each other (85 steps/s with one thread, 16 with two, measured under load). Nothing
        # here tests the thread count; the multi-rank tests already ran with one thread a rank.
        "LORAPLANE_WORKER_CPU_THREADS": "1",
    }
)


@pytest.fixture(scope="session", autouse=True)
def database() -> Iterator[str]:
    """A fresh database for this run, migrated to head; dropped at the end."""
    admin = create_engine(SERVER_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{DB_NAME}"'))
    from common.db import migrate

    migrate(DATABASE_URL)
    yield DATABASE_URL
    from common.db import get_engine

    get_engine().dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)'))
    admin.dispose()


TABLES = ("audit_log", "sampling_usage", "tracker_runs", "trackers", "checkpoints", "webhook_deliveries",
          "webhook_endpoints", "metric_points", "events", "trials", "tasks", "packs", "workers", "api_keys", "files",
          "tenants")


@pytest.fixture
def clean_db(database: str) -> Iterator[None]:
    """Empties every table a test may fill, before and after the test. The model registry goes back to its
    default entries, open to every tenant and not retired (admin calls may have added, restricted or retired
    entries)."""
    from common.db import get_engine, session_scope
    from common.registry import DEFAULT_MODELS, ensure_default_models

    defaults = {"names": [m.name for m in DEFAULT_MODELS]}

    def truncate() -> None:
        # Row deletes in foreign-key order: on tables this small, much faster than TRUNCATE.
        with get_engine().begin() as conn:
            for table in TABLES:
                conn.execute(text(f"DELETE FROM {table}"))
            conn.execute(text("DELETE FROM base_models WHERE name NOT IN :names").bindparams(
                bindparam("names", expanding=True)), defaults)
            # The fields ensure_default_models fills in where null go back to the built-ins' own.
            conn.execute(text("UPDATE base_models SET tenants = NULL, deleted_at = NULL, architecture = NULL, "
                              "max_context = NULL, chat_template = NULL"))
        with session_scope() as session:
            ensure_default_models(session)

    truncate()
    yield
    truncate()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Hugging Face model directory (tiny random Llama, safetensors, tokenizer), written once a session."""
    from tests.model_dirs import tiny_llama_dir  # imports torch: only the tests that use it pay for it

    return tiny_llama_dir(tmp_path_factory.mktemp("models") / "tiny-llama")
