"""initial registry

Revision ID: 0001
Revises:
Create Date: 2026-11-29 16:50:22.737000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('disabled', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('requests_per_minute', sa.Integer(), nullable=True),
    sa.Column('tokens_per_minute', sa.Integer(), nullable=True),
    sa.Column('max_concurrency', sa.Integer(), nullable=True),
    sa.Column('tokens_per_day', sa.BigInteger(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('name', name=op.f('uq_tenants_name'))
    )
    op.create_table('adapters',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_adapters_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapters')),
    sa.UniqueConstraint('tenant_id', 'name', name=op.f('uq_adapters_tenant_id_name'))
    )
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_adapters_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('api_keys',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('prefix', name=op.f('uq_api_keys_prefix'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('adapter_versions',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('adapter_id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('uploading', 'validating', 'ready', 'failed', 'deleted', name='adapter_status', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=True),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('alpha', sa.Float(), nullable=True),
    sa.Column('targets', sa.JSON(), nullable=False),
    sa.Column('dtype', sa.String(length=8), nullable=True),
    sa.Column('base_model', sa.String(length=300), nullable=True),
    sa.Column('adapter_config', sa.JSON(), nullable=True),
    sa.Column('blob_uri', sa.String(length=1024), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.id'], name=op.f('fk_adapter_versions_adapter_id_adapters'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_adapter_versions_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapter_versions')),
    sa.UniqueConstraint('adapter_id', 'number', name=op.f('uq_adapter_versions_adapter_id_number')),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name=op.f('uq_adapter_versions_tenant_id_idempotency_key'))
    )
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_adapter_versions_adapter_id'), ['adapter_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_adapter_versions_sha256'), ['sha256'], unique=False)

    op.create_table('adapter_aliases',
    sa.Column('adapter_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('version_id', sa.String(length=32), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.id'], name=op.f('fk_adapter_aliases_adapter_id_adapters'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['version_id'], ['adapter_versions.id'], name=op.f('fk_adapter_aliases_version_id_adapter_versions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('adapter_id', 'name', name=op.f('pk_adapter_aliases'))
    )
    op.create_table('usage_records',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('adapter_version_id', sa.String(length=32), nullable=True),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['adapter_version_id'], ['adapter_versions.id'], name=op.f('fk_usage_records_adapter_version_id_adapter_versions'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_records_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_records'))
    )
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_usage_records_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_usage_records_tenant_id'), ['tenant_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_records_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_usage_records_created_at'))

    op.drop_table('usage_records')
    op.drop_table('adapter_aliases')
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_adapter_versions_sha256'))
        batch_op.drop_index(batch_op.f('ix_adapter_versions_adapter_id'))

    op.drop_table('adapter_versions')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant_id'))

    op.drop_table('api_keys')
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_adapters_tenant_id'))

    op.drop_table('adapters')
    op.drop_table('tenants')
