"""Pure logic shared by the SDK, the embedded runtime and the Flink job: no I/O, no threads, no globals."""
