"""`trt-diffusion preflight`: the seed's pre-launch checklist as one command and one report that gates a release.

Eight checks (checklist.CHECK_NAMES), each a measurement with its threshold and its own timeout, run against a Triton
server (packaged and started on loopback from the built engines, or the one at --url) or in process. Settings:
the engines.yaml `preflight:` block (engines_file/preflight.py). See docs/preflight.md. Importing this package loads
nothing else (the CLI imports it at start).
"""

from ..checklist import CHECK_NAMES

__all__ = ["CHECK_NAMES"]
