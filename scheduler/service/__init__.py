"""The scheduler daemon and what it does to the database each round (ingest, lifecycle, dispatch, exits)."""
