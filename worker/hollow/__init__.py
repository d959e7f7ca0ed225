"""Hollow workers (issue 53), as Kubernetes' kubemark runs hollow kubelets against a real API server: the worker's
real shell (bus client, heartbeats, commands, reports, artifact files, co-location ledger, the Celery consumer) with
the training engine replaced by a timing model and replayed loss curves, many of them in one process, so that the
real control plane can be driven at hundreds of GPUs from a laptop.

- `curves.py`: the recorded sweeps a trial's losses are replayed from (pure, but for reading them once);
- `timing.py`: how long a step takes, from the planner's own cost model (pure);
- `engine.py`: `HollowEngine.train_pack`, the engine's contract on those two;
- `runner.py`: the `PackRunner` of a hollow worker (the real one, with the hollow engine and a cache that loads
  nothing);
- `main.py`: `run_hollow_workers`, N of them in one process, one heartbeat thread and one Celery consumer.

docs/operator-guide.md ("Hollow workers") says what they do not do.
"""
