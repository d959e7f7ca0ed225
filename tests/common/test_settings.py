from __future__ import annotations

from pathlib import Path

import pytest

from common.settings import Settings

SERVICE_VARS = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_HOME", "LORAPLANE_ARTIFACT_DIR",
                "LORAPLANE_MODEL_CACHE")


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SERVICE_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_embedded_defaults_live_under_dot_loraplane_whatever_home_is(bare_env: pytest.MonkeyPatch) -> None:
    bare_env.setenv("HOME", "/somewhere/else")  # the field is `home`: it must not read $HOME
    settings = Settings()
    assert settings.home == Path(".loraplane")
    assert settings.resolved_database_url == f"sqlite:///{Path('.loraplane/loraplane.db').resolve()}"
    assert settings.resolved_broker_url == "filesystem://"
    assert settings.resolved_artifact_dir == Path(".loraplane/artifacts").resolve()


def test_distributed_settings_come_from_the_environment(bare_env: pytest.MonkeyPatch) -> None:
    bare_env.setenv("DATABASE_URL", "postgresql://u:p@db:5432/lp")
    bare_env.setenv("REDIS_URL", "redis://r:6379/0")
    settings = Settings()
    assert settings.resolved_database_url == "postgresql+psycopg://u:p@db:5432/lp"  # psycopg 3, not psycopg2
    assert settings.resolved_broker_url == "redis://r:6379/0"  # the broker defaults to the bus's Redis
    bare_env.setenv("CELERY_BROKER_URL", "amqp://guest:guest@rabbit//")
    assert Settings().resolved_broker_url == "amqp://guest:guest@rabbit//"
