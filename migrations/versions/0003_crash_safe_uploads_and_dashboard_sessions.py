"""adapter versions: the blob key recorded before the upload (crash-safe uploads, janitor); dashboard sessions

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 10:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('blob_key', sa.String(length=1024), nullable=True))
        batch_op.create_index(batch_op.f('ix_adapter_versions_blob_key'), ['blob_key'], unique=False)
        batch_op.create_index('ix_adapter_versions_status_updated_at', ['status', 'updated_at'], unique=False)

    # versions written before this revision: their key is the path of their URI after the bucket (s3://bucket/key)
    # or the blob folder (file:///root/adapters/...): "adapters/<tenant>/<adapter>/<sha256>.safetensors"
    versions = sa.table('adapter_versions', sa.column('id', sa.String), sa.column('blob_uri', sa.String),
                        sa.column('blob_key', sa.String))
    conn = op.get_bind()
    rows = conn.execute(sa.select(versions.c.id, versions.c.blob_uri).where(versions.c.blob_uri.is_not(None))).all()
    for version_id, uri in rows:
        key = "/".join(uri.split("#", 1)[0].split("/")[-4:])
        conn.execute(versions.update().where(versions.c.id == version_id).values(blob_key=key))

    op.create_table('dashboard_sessions',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('key_id', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('token_hash', name=op.f('pk_dashboard_sessions'))
    )
    with op.batch_alter_table('dashboard_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_dashboard_sessions_expires_at'), ['expires_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('dashboard_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_dashboard_sessions_expires_at'))

    op.drop_table('dashboard_sessions')
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.drop_index('ix_adapter_versions_status_updated_at')
        batch_op.drop_index(batch_op.f('ix_adapter_versions_blob_key'))
        batch_op.drop_column('blob_key')
