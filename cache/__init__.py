"""KV cache data structures and policies (torch only, no I/O)."""
