"""Opening a model: where its files are (a local path, or a Hub id resolved to the cache)."""
