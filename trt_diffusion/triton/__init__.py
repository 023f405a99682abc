"""Triton: model repository generation, the server process, and the client."""
