"""tenant storage quota: bytes and number of live files

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from common.settings import get_settings

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing tenants get the deployment's defaults for new tenants (settings, not a copy of them here); the
    # server default only fills those rows and is dropped, like the other quotas' (the API always sets them).
    settings = get_settings()
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_storage_bytes', sa.BigInteger(), nullable=False,
                                      server_default=str(settings.default_max_storage_bytes)))
        batch_op.add_column(sa.Column('max_files', sa.Integer(), nullable=False,
                                      server_default=str(settings.default_max_files)))
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.alter_column('max_storage_bytes', server_default=None)
        batch_op.alter_column('max_files', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('max_files')
        batch_op.drop_column('max_storage_bytes')
