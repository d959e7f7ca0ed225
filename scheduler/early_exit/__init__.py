"""The early-exit policies, pure: a task's trials' curves in, decisions out (`policy.decide`)."""
