"""Indexes for the dashboard's reads at scale (issue 53): tasks newest first, per tenant and overall; packs by state
newest first; packs by when they finished

- `ix_tasks_tenant_id_created_at_id` (replaces `ix_tasks_tenant_id`, which it covers): a tenant's tasks list
  (`GET /v1/tasks`, newest first, created_at then id) reads its first page from the index instead of sorting every
  task of the tenant;
- `ix_tasks_created_at_id`: the operator's list of every tenant's tasks, likewise;
- `ix_packs_state_created_at_id` (replaces `ix_packs_state`): `GET /v1/admin/packs?state=finished`, newest first,
  over every pack that ever finished;
- `ix_packs_finished_at`: the packs that ran inside a usage window (finished after its start, or live: NULL), which
  the cluster view reads for each tenant's GPU time over the fairness window, instead of every pack ever;
- `ix_tasks_waiting`, partial (`waiting IS NOT NULL`): the few tasks that say why they wait, which the cluster view
  lists, instead of a scan of every task stored.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-02 07:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0030'
down_revision = '0029'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_tasks_tenant_id_created_at_id', 'tasks', ['tenant_id', 'created_at', 'id'], unique=False)
    op.drop_index('ix_tasks_tenant_id', table_name='tasks')
    op.create_index('ix_tasks_created_at_id', 'tasks', ['created_at', 'id'], unique=False)
    op.create_index('ix_packs_state_created_at_id', 'packs', ['state', 'created_at', 'id'], unique=False)
    op.drop_index('ix_packs_state', table_name='packs')
    op.create_index('ix_packs_finished_at', 'packs', ['finished_at'], unique=False)
    op.create_index('ix_tasks_waiting', 'tasks', ['created_at', 'id'], unique=False,
                    postgresql_where=sa.text('waiting IS NOT NULL'), sqlite_where=sa.text('waiting IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_tasks_waiting', table_name='tasks')
    op.drop_index('ix_packs_finished_at', table_name='packs')
    op.create_index('ix_packs_state', 'packs', ['state'], unique=False)
    op.drop_index('ix_packs_state_created_at_id', table_name='packs')
    op.drop_index('ix_tasks_created_at_id', table_name='tasks')
    op.create_index('ix_tasks_tenant_id', 'tasks', ['tenant_id'], unique=False)
    op.drop_index('ix_tasks_tenant_id_created_at_id', table_name='tasks')
