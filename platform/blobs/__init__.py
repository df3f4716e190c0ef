"""Blob storage for adapter weights: one interface, a local folder and an S3 implementation."""
from loraplex.platform.blobs.base import BlobInfo, BlobNotFound, BlobStore, BlobStoreUnavailable, IncompleteUpload
from loraplex.platform.blobs.factory import make_blob_store

__all__ = ["BlobInfo", "BlobNotFound", "BlobStore", "BlobStoreUnavailable", "IncompleteUpload", "make_blob_store"]
