"""The planners, pure: no I/O, no database (the API imports them for estimates)."""
