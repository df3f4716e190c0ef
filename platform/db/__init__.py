"""The registry: SQLAlchemy 2 ORM models and sessions (schema changes go through Alembic in migrations/)."""
