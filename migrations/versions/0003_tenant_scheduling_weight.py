"""tenants: scheduling_weight, the tenant's share of the engines' tenant-fair scheduling (null: the default)

Revision ID: 0003_tenant_scheduling_weight
Revises: 0002
Create Date: 2026-12-01 09:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003_tenant_scheduling_weight'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('scheduling_weight', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('scheduling_weight')
