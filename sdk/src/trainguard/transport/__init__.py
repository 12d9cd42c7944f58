"""Delivery of encoded batches: a background worker, the HTTP/gRPC/file transports and the disk spool."""
