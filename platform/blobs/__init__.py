"""Blob storage for adapter weights: one interface, a local folder and an S3 implementation."""
from loraplex.platform.blobs.base import BlobNotFound, BlobStore, BlobStoreUnavailable
from loraplex.platform.blobs.factory import make_blob_store

__all__ = ["BlobNotFound", "BlobStore", "BlobStoreUnavailable", "make_blob_store"]
