"""Routing policy: which worker a request should go to (KV overlap, load, cost); pure, no I/O."""
