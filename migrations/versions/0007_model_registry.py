"""model registry: who may use a base model, its architecture and context, when it was last edited

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # All nullable: the built-in entries keep null (every tenant, architecture unknown until inspected).
    with op.batch_alter_table('base_models', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tenants', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('architecture', sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column('max_context', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('updated_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('base_models', schema=None) as batch_op:
        batch_op.drop_column('updated_at')
        batch_op.drop_column('max_context')
        batch_op.drop_column('architecture')
        batch_op.drop_column('tenants')
