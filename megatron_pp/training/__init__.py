"""Training loop, arguments, optimizer and logging."""
