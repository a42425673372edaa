"""Engine adapters, one module per engine; each imports its engine there alone, so
installing weightcache never pulls an engine in (docs/engines.md)."""
