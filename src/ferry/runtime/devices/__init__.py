"""Devices: allocators (host, CUDA, emulated), streams and events, CUDA graphs, tensors over planned memory."""
