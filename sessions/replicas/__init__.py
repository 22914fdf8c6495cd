"""Replicas: several `chatkv serve` processes sharing one database and one Redis
(docs/replicas.md). `role` is this process's part (its id, the leases it holds), `ownership` the
leases and their keeper thread, `startup` what a replica builds at start (its id, the Redis tier,
the registered keeper)."""
