"""tasks.waiting: a cleared wait is SQL NULL, not JSON null (the column now writes None as NULL: none_as_null)

A cleared `waiting` was stored as JSON `null`, which `IS NOT NULL` lets through: the cluster view read such a task as
waiting and failed to parse it (a 500). Existing JSON nulls become SQL NULL.

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-28 03:45:00
"""

from __future__ import annotations

from alembic import op

revision = '0029'
down_revision = '0028'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE tasks SET waiting = NULL WHERE waiting IS NOT NULL AND CAST(waiting AS TEXT) = 'null'")


def downgrade() -> None:
    pass  # SQL NULL reads as "not waiting" to every version
