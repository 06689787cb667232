"""Loaded by every Python process the tests start (this folder is on their PYTHONPATH): puts
accelerator semantics on torch.distributed (see tests/dist_harness/checks.py)."""

from tests.dist_harness.checks import install

install()
