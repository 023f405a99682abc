"""An OpenAI-compatible Images API in front of Triton: /v1/images/generations, /v1/images/edits, /v1/models.

The API holds no engine: it reads the served entries from Triton (catalog.py), turns an OpenAI body into the
entry's request tensors (bodies.py, triton_calls.py) and the images back into PNGs (pngs.py), over gRPC.
"""
