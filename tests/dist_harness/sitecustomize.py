"""Loaded by every Python process the tests start (this folder is on their PYTHONPATH): puts
accelerator semantics on torch.distributed (see tests/dist_harness/checks.py) and installs the
fault injection a test asked for (tests/faults.py); first, before torch is imported, the start-up
shortcut of tests/dist_harness/lazy_dynamo.py."""

from tests.dist_harness.checks import install
from tests.dist_harness.lazy_dynamo import install as install_lazy_dynamo
from tests.faults import install as install_faults

install_lazy_dynamo()
install()
install_faults()
