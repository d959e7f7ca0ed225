"""each uploaded file's row lengths per model's tokenizer

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No foreign key to base_models: a model's name is what the lengths were counted for, kept if it is retired.
    op.create_table(
        'file_token_lengths',
        sa.Column('file_id', sa.String(length=40), nullable=False),
        sa.Column('base_model', sa.String(length=100), nullable=False),
        sa.Column('tokenizer', sa.String(length=64), nullable=False),
        sa.Column('lengths', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['file_id'], ['files.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('file_id', 'base_model', 'tokenizer'),
    )


def downgrade() -> None:
    op.drop_table('file_token_lengths')
