"""Usage metering: one ``UsageEvent`` per finished request, buffered and written to SQL in batches
(``UsageWriter``), read back per tenant, adapter and UTC day (``usage_summary``)."""
from loraplex.platform.usage.events import UsageEvent
from loraplex.platform.usage.queries import usage_summary
from loraplex.platform.usage.writer import UsageWriter

__all__ = ["UsageEvent", "UsageWriter", "usage_summary"]
