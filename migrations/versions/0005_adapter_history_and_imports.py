"""adapter history (who uploaded, deleted and moved aliases; when a version was deleted; an import's source) and
imports by reference

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-08 09:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('created_by_key_id', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('deleted_by_key_id', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('source', sa.String(length=2048), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_adapter_versions_created_by_key_id_api_keys'), 'api_keys',
                                    ['created_by_key_id'], ['id'], ondelete='SET NULL')
        batch_op.create_foreign_key(batch_op.f('fk_adapter_versions_deleted_by_key_id_api_keys'), 'api_keys',
                                    ['deleted_by_key_id'], ['id'], ondelete='SET NULL')
    with op.batch_alter_table('adapter_aliases', schema=None) as batch_op:
        batch_op.add_column(sa.Column('updated_by_key_id', sa.String(length=32), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_adapter_aliases_updated_by_key_id_api_keys'), 'api_keys',
                                    ['updated_by_key_id'], ['id'], ondelete='SET NULL')
    op.create_table('adapter_imports',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('adapter_name', sa.String(length=64), nullable=False),
    sa.Column('source', sa.String(length=2048), nullable=False),
    sa.Column('status', sa.Enum('running', 'succeeded', 'failed', name='import_status', native_enum=False,
                                length=16, create_constraint=True), nullable=False),
    sa.Column('bytes_received', sa.BigInteger(), nullable=False),
    sa.Column('version_id', sa.String(length=32), nullable=True),
    sa.Column('deduplicated', sa.Boolean(), nullable=False),
    sa.Column('error_status', sa.Integer(), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('created_by_key_id', sa.String(length=32), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['created_by_key_id'], ['api_keys.id'],
                            name=op.f('fk_adapter_imports_created_by_key_id_api_keys'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_adapter_imports_tenant_id_tenants'),
                            ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['version_id'], ['adapter_versions.id'],
                            name=op.f('fk_adapter_imports_version_id_adapter_versions'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapter_imports')),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name=op.f('uq_adapter_imports_tenant_id_idempotency_key')),
    )
    with op.batch_alter_table('adapter_imports', schema=None) as batch_op:
        batch_op.create_index('ix_adapter_imports_tenant_created', ['tenant_id', 'created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('adapter_imports', schema=None) as batch_op:
        batch_op.drop_index('ix_adapter_imports_tenant_created')
    op.drop_table('adapter_imports')
    with op.batch_alter_table('adapter_aliases', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_adapter_aliases_updated_by_key_id_api_keys'), type_='foreignkey')
        batch_op.drop_column('updated_by_key_id')
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_adapter_versions_deleted_by_key_id_api_keys'), type_='foreignkey')
        batch_op.drop_constraint(batch_op.f('fk_adapter_versions_created_by_key_id_api_keys'), type_='foreignkey')
        batch_op.drop_column('source')
        batch_op.drop_column('deleted_at')
        batch_op.drop_column('deleted_by_key_id')
        batch_op.drop_column('created_by_key_id')
