"""Offline tools: the trace-driven planner simulator (`loraplane simulate`) and sweep replay (`loraplane replay`)."""
