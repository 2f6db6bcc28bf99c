"""Models, KV caches, drafting and lossless verification. No gRPC in here."""
