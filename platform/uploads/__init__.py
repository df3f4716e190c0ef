"""The upload path: stream to a spool folder with a size cap, unpack, validate, hash, store, register."""
