"""One trial's run written to Weights & Biases by W&B's own client, in a process of its own
(`python -m scheduler.service.wandb_run`, the job as JSON on stdin; scheduler/service/trackers.py starts it).

A process per run: W&B's client starts a service process of its own, keeps global state per process and reads its
key from the environment, so the scheduler hands each run a clean process with that tenant's key alone and a time
limit, and nothing of one run (or a hung upload) stays in the scheduler. The run's id is the trial's and it is opened
with `resume="allow"`: a run written again after a failure is the same run, its steps logged again in order.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    job: dict[str, Any] = json.load(sys.stdin)
    import wandb  # here: the scheduler itself never imports W&B's client

    run = wandb.init(project=job["project"], entity=job.get("entity"), id=job["run_id"], name=job["name"],
                     config=job["config"], tags=job["tags"], dir=job["dir"], mode=job["mode"], resume="allow",
                     settings=wandb.Settings(init_timeout=60, console="off", x_disable_stats=True,
                                             disable_git=True, save_code=False))
    for step, values in job["history"]:
        run.log(values, step=step)
    run.summary.update(job["summary"])
    if job.get("adapter_dir"):
        artifact = wandb.Artifact(name=f"adapter-{job['run_id']}", type="model")
        artifact.add_dir(job["adapter_dir"])
        run.log_artifact(artifact)
    run.finish(exit_code=0 if job["ok"] else 1)


if __name__ == "__main__":
    main()
