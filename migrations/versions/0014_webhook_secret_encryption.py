"""webhook secrets encrypted at rest

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 08:30:01

webhook_endpoints.secret (the signing secret as issued) becomes secret_encrypted: the same secret, Fernet-encrypted
under the first key of LORAPLANE_SECRET_KEY (common/secret_box.py; generated into LORAPLANE_HOME in the embedded
mode). Every row at 0013 is plaintext and every row at 0014 encrypted, so each direction converts all rows. The key
is read only when there are rows to convert: a fresh database migrates without it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

# A Fernet token of a 49-character secret is 164 characters; room for longer secrets and another scheme.
ENCRYPTED_LENGTH = 500


def _convert(column: str, convert_name: str) -> None:
    """Rewrites every row's `column` through the configured keys' encrypt or decrypt."""
    from common.secret_box import SecretBox, key_text
    from common.settings import get_settings

    bind = op.get_bind()
    table = sa.table('webhook_endpoints', sa.column('id', sa.String), sa.column(column, sa.String))
    rows = bind.execute(sa.select(table.c.id, table.c[column])).all()
    if not rows:
        return
    convert = getattr(SecretBox.parse(key_text(get_settings())), convert_name)
    for row_id, value in rows:
        bind.execute(table.update().where(table.c.id == row_id).values({column: convert(value)}))


def upgrade() -> None:
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.alter_column('secret', new_column_name='secret_encrypted', existing_type=sa.String(length=100),
                              type_=sa.String(length=ENCRYPTED_LENGTH), existing_nullable=False)
    _convert('secret_encrypted', 'encrypt')


def downgrade() -> None:
    _convert('secret_encrypted', 'decrypt')  # fails, naming the setting, if no configured key decrypts a row
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.alter_column('secret_encrypted', new_column_name='secret',
                              existing_type=sa.String(length=ENCRYPTED_LENGTH), type_=sa.String(length=100),
                              existing_nullable=False)
