"""The scheduler daemon and what it does to the database each round (ingest, planner_io, task_results, dispatch,
exits)."""
