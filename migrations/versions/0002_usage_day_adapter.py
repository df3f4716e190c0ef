"""usage records: UTC day and adapter name, indexed by (tenant, day) for the usage API

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 17:40:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.add_column(sa.Column('day', sa.Date(), nullable=True))
        batch_op.add_column(sa.Column('adapter_name', sa.String(length=64), nullable=True))
        batch_op.create_index('ix_usage_records_tenant_day', ['tenant_id', 'day'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_records_tenant_day')
        batch_op.drop_column('adapter_name')
        batch_op.drop_column('day')
