"""Kernel choices made at load by timing: GEMMs with a bias, attention, convolutions of one image."""
