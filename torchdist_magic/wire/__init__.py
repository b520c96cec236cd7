"""The run's channel as bytes: authenticated, optionally TLS, framed and batched transport between
the driver and every launcher and rank, and file transfers over it.  It moves records; what a
record means is ``core.events``'s, what the driver does with it is ``driver``'s."""
