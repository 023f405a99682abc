"""Code that runs inside Triton's python backend stubs. Generated `model.py` files only re-export the
`TritonPythonModel` classes defined here, so the served code is the installed, tested package.

`triton_python_backend_utils` exists only inside a stub: it is imported lazily (see `pb.py`), so these
modules still import anywhere."""
