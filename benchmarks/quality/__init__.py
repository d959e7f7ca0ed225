"""The quality benchmark (issue 33): does the service's winner generalise? Tasks in tasks.py, scorers in scoring.py,
intervals in stats.py."""
