"""Loaded by every Python process the tests start (this folder is on their PYTHONPATH): puts
accelerator semantics on torch.distributed (see tests/dist_harness/checks.py) and installs the
fault injection a test asked for (tests/faults.py)."""

from tests.dist_harness.checks import install
from tests.faults import install as install_faults

install()
install_faults()
