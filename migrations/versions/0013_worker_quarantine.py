"""worker quarantine and trial attempts blamed on the right party

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 08:30:00
"""

from __future__ import annotations

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
