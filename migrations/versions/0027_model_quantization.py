"""base_models.quantization: a registered model whose base a worker holds in 4 bits (NF4, QLoRA)

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-27 23:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0027'
down_revision = '0026'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('base_models', sa.Column('quantization', sa.String(length=20), nullable=True))


def downgrade() -> None:
    op.drop_column('base_models', 'quantization')
