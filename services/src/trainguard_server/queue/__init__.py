"""The queue between the gateway and the processor: base contract, memory and SQLite implementations."""
