"""sampling_usage: the tokens of each answered sampling request, for its tenant's usage

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-27 23:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0028'
down_revision = '0027'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'sampling_usage',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('prompt_tokens', sa.Integer(), nullable=False),
        sa.Column('completion_tokens', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index(op.f('ix_sampling_usage_tenant_id'), 'sampling_usage', ['tenant_id'], unique=False)
    op.create_index(op.f('ix_sampling_usage_created_at'), 'sampling_usage', ['created_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_sampling_usage_created_at'), table_name='sampling_usage')
    op.drop_index(op.f('ix_sampling_usage_tenant_id'), table_name='sampling_usage')
    op.drop_table('sampling_usage')
