"""Processes and I/O: the per-process runtime, the allocator daemon, its zygote and procs."""
