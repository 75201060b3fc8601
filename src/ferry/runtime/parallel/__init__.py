"""Work over several devices and processes: micro-batches, transfers between ranks."""
