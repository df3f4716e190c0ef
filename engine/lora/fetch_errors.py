"""The errors every fetcher raises (``fetch.py``'s file fetcher, ``fetch_s3.py``'s S3 fetcher, the platform's)."""


class AdapterFetchError(RuntimeError):
    """The adapter's bytes could not be fetched (missing file, unknown scheme, transport error)."""


class AdapterFetchUnavailableError(AdapterFetchError):
    """The blob store could not be reached or failed (connection, timeout, 5xx): the same fetch may succeed
    later, so the next request for the adapter tries again and clients get a retryable 503."""
