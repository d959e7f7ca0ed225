"""The Python client of the loraplane API: `Client` (sync) and `AsyncClient`, with the same methods.

    from loraplane.client import Client, APIError

    with Client("http://127.0.0.1:8000", "lp_...") as lp:
        print([m.id for m in lp.models.list()])

Nothing here imports the service (`api/`, `common/`): the client needs httpx only.
"""

from loraplane.client._async import AsyncClient
from loraplane.client._sync import Client
from loraplane.client.config import Settings, config_path, read_config, resolve, write_config
from loraplane.client.errors import APIConnectionError, APIError, ConfigurationError, LoraplaneError, WaitTimeout
from loraplane.client.objects import (
    TASK_FINAL_STATES,
    TRIAL_FINAL_STATES,
    ApiKey,
    BestTrial,
    Checkpoint,
    CheckpointDeleted,
    Completion,
    Cost,
    EstimateBasis,
    Event,
    File,
    FileDeleted,
    LossPoint,
    MetricScore,
    Model,
    Page,
    RegisteredModel,
    Task,
    TaskEstimate,
    TaskWaiting,
    Tenant,
    Trial,
    TrialCounts,
    TrialMetrics,
    Usage,
    Webhook,
    WebhookDeleted,
    WebhookDelivery,
    Worker,
)

__all__ = [
    "TASK_FINAL_STATES", "TRIAL_FINAL_STATES", "APIConnectionError", "APIError", "ApiKey", "AsyncClient", "BestTrial",
    "Checkpoint", "CheckpointDeleted", "Client", "Completion", "ConfigurationError", "Cost", "EstimateBasis", "Event",
    "File", "FileDeleted",
    "LoraplaneError", "LossPoint", "MetricScore", "Model", "Page", "RegisteredModel", "Settings", "Task",
    "TaskEstimate", "TaskWaiting", "Tenant", "Trial", "TrialCounts", "TrialMetrics", "Usage", "WaitTimeout", "Webhook",
    "WebhookDeleted", "WebhookDelivery", "Worker", "config_path", "read_config", "resolve", "write_config",
]
