"""Bytes at rest: the metadata database, blob stores, cache codec and key ring."""
