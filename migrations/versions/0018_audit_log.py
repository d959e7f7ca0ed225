"""the audit log of the operator's reads of tenants' data

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No foreign key to tenants: the record of who read a tenant's data outlives the tenant.
    op.create_table('audit_log',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('actor', sa.String(length=64), nullable=False),
    sa.Column('method', sa.String(length=10), nullable=False),
    sa.Column('route', sa.String(length=200), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=True),
    sa.Column('resource_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('audit_log', schema=None) as batch_op:
        batch_op.create_index('ix_audit_log_created_at_id', ['created_at', 'id'], unique=False)
        batch_op.create_index(batch_op.f('ix_audit_log_tenant_id'), ['tenant_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('audit_log', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_audit_log_tenant_id'))
        batch_op.drop_index('ix_audit_log_created_at_id')
    op.drop_table('audit_log')
