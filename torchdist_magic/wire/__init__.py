"""The run's channel as bytes: authenticated, optionally TLS, framed and batched transport between
the driver and every launcher and rank, and file transfers over it.  It moves records; what a
record means is ``core.events``'s, what the driver does with it is ``driver``'s.

Start at ``frames`` (the wire format: frames, the handshake's proofs).  Then ``handshake`` (the
challenge and the hello, both ends), ``server`` (the driver's one thread: strangers, ranks),
``connection`` (one connection it accepted, its TLS or authenticated records), ``delivery`` (what
the driver does with an authenticated connection's frames), ``transfers`` (files both ways),
``client`` (a rank's side), ``batching`` (what a rank sends in one frame), ``tls`` (the run's
identity, the client's TLS socket), ``framemac`` (records without TLS), ``relay`` (a host's
ranks over one connection) and ``fanin`` (what a relay and the driver say)."""
