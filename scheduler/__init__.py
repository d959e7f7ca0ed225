"""The scheduler, by concern (docs/ARCHITECTURE.md has the map):

- `service/`: the daemon and what it does to the database each round (ingest, the planner's snapshot and records,
  task results, dispatch, the early-exit shell, webhooks, telemetry);
- `planning/`: the planners, pure: one vocabulary (`types`), the cost model, the shared integer coefficients,
  CP-SAT, the greedy planner, the rules after a solver, the daemon's placement and the estimates;
- `early_exit/`: the early-exit policies, pure;
- `sim/`: offline tools: the trace-driven planner simulator and the replay of logged sweeps.
"""
