"""The README's first task runs as written (issue 32): every command of its "Your first task" block, in order,
in a shell, against a live `loraplane up` on its embedded default, in a folder holding a copy of `examples/` (as
the repository's root does, without writing into it). Only the values a reader copies from an earlier answer are
filled in: the admin token `make up` printed, the key `admin keys create` printed, the task id `tasks create`
printed, and this run's port."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.e2e.flow import wait_for
from tests.e2e.procs import ROOT, cluster, free_port, wait_ready

README = ROOT / "README.md"
SECTION = "## Your first task, in five steps"
EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ADMIN_TOKEN",
                  "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE", "LORAPLANE_API_KEY", "LORAPLANE_API_URL")
WATCH_CEILING_S = 1200  # `tasks watch` returns when the task ends; this only bounds a hung run


def tour_commands(readme: str) -> list[str]:
    """The commands of the section's first bash block: its lines without comments, blank lines dropped."""
    section = readme.split(SECTION, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, f"no bash block under {SECTION!r}"
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines()]
    return [c for c in commands if c and not c.startswith("#")]


def fill(command: str, values: dict[str, str]) -> str:
    for placeholder, value in values.items():
        command = command.replace(placeholder, value)
    assert "..." not in command, f"a placeholder the test does not know: {command}"
    return command


def test_the_tour_commands_are_found_and_filled() -> None:
    commands = tour_commands(README.read_text(encoding="utf-8"))
    assert any(c.startswith("loraplane tasks create") for c in commands), commands
    assert fill("loraplane tasks watch task-...", {"task-...": "task-1"}) == "loraplane tasks watch task-1"


def test_the_readmes_first_task_runs_as_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_SCHEDULER_TICK_S": "0.5",
                "LORAPLANE_HEARTBEAT_S": "1", "XDG_CONFIG_HOME": str(tmp_path / "config"),
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    commands = tour_commands(README.read_text(encoding="utf-8"))
    here = tmp_path / "checkout"
    shutil.copytree(ROOT / "examples", here / "examples")
    with cluster(env, tmp_path) as c:
        up = c.start("up", "up", "--port", str(port))
        wait_ready(base_url, [up])
        token = wait_for(lambda: re.search(r"\b(lpadmin_[A-Za-z0-9_-]+)", up.log_path.read_text()), 60,
                         "the admin token `loraplane up` prints").group(1)
        values = {"lpadmin_...": token, "http://127.0.0.1:8000": base_url}
        env["LORAPLANE_API_URL"] = base_url  # the CLI's default address is make up's, port 8000
        for command in commands:
            filled = fill(command, values)
            if (export := re.fullmatch(r"export (\w+)=(\S+)", filled)) is not None:  # the reader's shell keeps it
                env[export.group(1)] = export.group(2)
                continue
            done = subprocess.run(["bash", "-c", filled], cwd=here, env=env, capture_output=True, text=True,
                                  timeout=WATCH_CEILING_S)
            assert done.returncode == 0, (filled, done.stdout, done.stderr, up.tail())
            if (key := re.search(r"\b(lp_[A-Za-z0-9_-]{20,})", done.stdout)) and "keys create" in command:
                values["lp_..."] = key.group(1)
            if (task := re.search(r"\b(task-[0-9a-f]{8,})", done.stdout)) and "tasks create" in command:
                values["task-..."] = task.group(1)
    # The last step downloaded the best adapter as a PEFT directory.
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (here / "adapter").iterdir()}
