"""Triton pieces shared by more than one part of the library: the launch fast path, the device
metadata kernel, the LSE merge kernel. No backend lives here, and nothing here imports a backend."""
