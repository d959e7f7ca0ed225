"""model availability: which registered models a worker can load, a model's chat template, retired models

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # workers.models null: a worker that does not say (an older one), taken to load every model.
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('models', sa.JSON(), nullable=True))
    # base_models.chat_template null: not known (built-ins); deleted_at: retired by DELETE, kept because finished
    # tasks still name it (tasks.base_model is a foreign key).
    with op.batch_alter_table('base_models', schema=None) as batch_op:
        batch_op.add_column(sa.Column('chat_template', sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('base_models', schema=None) as batch_op:
        batch_op.drop_column('deleted_at')
        batch_op.drop_column('chat_template')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('models')
